"""Chat formatting: render conversations with the target's template; ids and loss masks.

`ChatFormat` (in `format.py`) gives serving prompt ids, completion ids and training rows;
`encode.py` holds the supervision policies, `validate.py` the conversation checks and their
reason codes, `render.py` the compiled-template renderer. See `format.py` for the mask rules.
"""

from draftflow.chat.encode import DEFAULT_POLICY, POLICIES, EncodedRow, EncodeRequest
from draftflow.chat.format import ChatFormat
from draftflow.chat.render import FIXED_DATE
from draftflow.chat.validate import REASONS, ROLES

__all__ = [
    "DEFAULT_POLICY",
    "FIXED_DATE",
    "POLICIES",
    "REASONS",
    "ROLES",
    "ChatFormat",
    "EncodeRequest",
    "EncodedRow",
]
