"""draftflow: train speculative-decoding drafters from raw chat data.

The library package. It does all the work and never imports Prefect; the
`flows/` and `tasks/` packages wrap it for orchestration.
"""

__version__ = "0.1.0"
