"""Prefect tasks: thin wrappers that give library calls a cache key, retries and tags.

No data logic lives here. Each task calls one library function and returns what it returns: a
`ShardResult` or a `Manifest` (names, counts, digests; `draftflow.contracts`), never tensors or tables.
"""
