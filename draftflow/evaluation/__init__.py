"""Measuring a drafter: speculative decoding loops, baselines, tree budgets, reports and the gate.

The evaluate stage (`draftflow.stages.evaluate`) calls into this package; nothing here knows stores,
manifests or Prefect. `decode` holds the reference (uncached) loop every faster path is checked against.
"""
