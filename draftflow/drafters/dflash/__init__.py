"""The DFlash kind (arXiv 2602.06036), one folder: `taps` (its data rule: light, read by tokenize and
extract), `settings` (its own fields of the `drafter` section), `config`, `model`, `objective`, `batches`,
`export` (+ `modeling_dflash`, copied into vLLM exports) and `spec` (the `DrafterSpec` the registry lists).
Empty on purpose: importing `taps` must not import the rest.
"""
