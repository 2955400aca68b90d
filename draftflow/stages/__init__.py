"""Stage entry points: pure functions from (config, input shard) to output shard.

A stage is one module here and one `StageSpec` in `registry.py`: a per-shard function (`run_shard`) that
writes one output shard atomically and returns a `ShardResult`, or a whole-stage `run`; `common.finalize`
writes the manifest. The Prefect layer (`tasks/`, `flows/`) only wraps these calls.
"""
