"""Drafter kinds. Each kind is one folder, `<kind>/`: `taps.py` (its light `DataRule`: taps, checks,
minimum supervised tokens), `settings.py` (its own fields of the `drafter` section), `config.py`,
`model.py`, `objective.py`, `batches.py`, `export.py` and `spec.py` (its `DrafterSpec`). What the kinds
share: `spec` and `rule` (the two records), `registry` (the full specs and lookups), `taps` (the light
rules, read by tokenize and extract without models), `batches` (the step plan), `objectives`
(`LossStats`), `export` (the folder writer).
"""
