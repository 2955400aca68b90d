"""The EAGLE-3 kind (arXiv 2503.01840), one folder: `taps` (its data rule: light, read by tokenize and
extract), `settings` (its own fields of the `drafter` section), `config`, `model`, `objective`, `batches`,
`export`, `vocab` (the draft vocabulary) and `spec` (the `DrafterSpec` the registry lists). Empty on
purpose: importing `taps` must not import the rest.
"""
