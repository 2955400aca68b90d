"""draftflow: train speculative-decoding drafters from raw chat data.

The library package. It does all the work and never imports Prefect; the
`flows/` and `tasks/` packages wrap it for orchestration.
"""

from draftflow.threadsafe_ast import install as _serialize_ast_parse

__version__ = "0.1.0"

_serialize_ast_parse()  # CPython < 3.13 fails concurrent parses from task threads: see draftflow/threadsafe_ast.py
