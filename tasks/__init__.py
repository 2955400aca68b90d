"""Prefect tasks: thin wrappers that give library calls a cache key, retries and tags.

No data logic lives here. Each task calls one library function and returns its
small result dict (names, counts, digests), never tensors or tables.
"""
