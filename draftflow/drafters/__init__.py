"""Drafter kinds: `registry` (one `DrafterSpec` per kind, the lookups) and `taps` (the one path that
resolves and validates tap ids, kept light so the extract stage's code fingerprint does not take in
training, export or evaluation code). One module per kind: `dflash`, `eagle3`.
"""
