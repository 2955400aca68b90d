"""Error types that carry a one-line, user-facing message.

Every error a user can cause (bad config, bad path, bad conversation) is a
`DraftflowError`; the CLI prints its message as one line and exits non-zero
instead of showing a traceback. Internal invariants still use `assert`.
"""


class DraftflowError(Exception):
    """A problem the user can fix; the message says what and how."""


class ConfigError(DraftflowError):
    """The run config is missing, malformed or inconsistent."""


class SourceError(DraftflowError):
    """A data source cannot be found or read."""


class ConversationError(DraftflowError):
    """A conversation cannot be rendered (e.g. it has no user turn).

    `reason` is the short code the stages count in their manifests.
    """

    reason: str = "conversation_error"

    def __init__(self, message: str = "", reason: str | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class StoreError(DraftflowError):
    """An artifact is missing, incomplete or fails its checksum."""


class LosslessError(DraftflowError):
    """Speculative decoding produced tokens that differ from the target's own."""
