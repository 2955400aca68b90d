"""Data formats and curation: schema, readers, adapters, filters, dedup, mixture, stats.

schema.py (Arrow shapes, stable ids) · readers.py (files, S3, Hugging Face; streaming)
· sources.py (format adapters) · filters.py (drop reasons) · dedup.py (exact and
MinHash near-dup on digests) · mixture.py (quotas, shuffle, split) · stats.py
(per-source figures, PNG) · scan.py (one part: read -> convert -> filter -> partial)
· decisions.py (the merge's keep/drop decisions, decontamination) · self_instruct.py
(prompts the target writes, cached as a prompt file) · code_stubs.py ("complete this
function" prompts from installed Python code).
"""
