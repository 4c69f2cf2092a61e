"""One error hierarchy for dipaco: every rejection carries a machine-readable reason."""

from __future__ import annotations


class DipacoError(Exception):
    """Base class. ``reason`` is a short stable slug that is counted and shown to users."""

    reason: str = "error"
    counted: bool = False  # set once the coordinator has counted this rejection

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class ConfigError(DipacoError):
    """A user-written configuration is invalid; the message names the field."""

    reason = "bad-config"


class DataError(DipacoError):
    """A data source or shard is missing, malformed or empty; the message names the file."""

    reason = "bad-data"


class CorruptFileError(DataError):
    """A file on disk fails its checksum or is truncated."""

    reason = "corrupt-file"


class WireError(DipacoError):
    """A message on the wire is malformed, truncated, oversized or uses a forbidden dtype."""

    reason = "bad-message"


class RejectedError(DipacoError):
    """The coordinator refused a request (stale version, unknown task, wrong shapes, ...)."""

    reason = "rejected"


class TransportError(DipacoError):
    """The transport could not deliver a request (connection refused, closed, timed out)."""

    reason = "transport"
