"""Prefect flows: the pipeline flow and one flow per stage. Wiring only."""
