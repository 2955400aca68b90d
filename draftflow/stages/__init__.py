"""Stage entry points: pure functions from (config, input shard) to output shard.

Each stage module exposes `fingerprint(...)`, a per-shard function that
writes one output shard atomically and returns a small result dict, and
`finalize(...)` that writes the manifest. The Prefect layer (`tasks/`,
`flows/`) only wraps these calls.
"""
