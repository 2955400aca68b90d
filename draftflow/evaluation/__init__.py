"""Measuring a drafter: speculative decoding loops, baselines, tree budgets, reports and the gate.

The evaluate stage (`draftflow.stages.evaluate`) calls into this package; nothing here knows Prefect, and only
`compare_with` reads stores and manifests (the other drafters it names are train stages or export folders).
`decode` holds the reference (uncached) loop every faster path is checked against.
"""
