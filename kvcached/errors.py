"""Errors the store raises for a caller's request; each API maps them to its own status.

The message is for a person: it names the block or key and says what is wrong. The gRPC layer
maps the class to a status code (INVALID_ARGUMENT, NOT_FOUND, ...); the agent socket (later)
maps it to an error frame.
"""

from __future__ import annotations


class KvError(Exception):
    """Base class: a request that cannot be served as asked. The daemon goes on serving."""


class InvalidArgument(KvError):
    """The request itself is malformed (bad digest length, empty payload, ...)."""


class NotFound(KvError):
    """A block that is not stored (unknown, evicted, or lost at a restart)."""


class ResourceExhausted(KvError):
    """No room: the tier is full of blocks in use, or a message is over its limit."""


class FailedPrecondition(KvError):
    """The block is busy (being written or read) and cannot be changed now."""


class DataLoss(KvError):
    """Bytes do not match their BLAKE3 checksum."""


class Unavailable(KvError):
    """The daemon cannot do it now (its index cannot be written); nothing of the request was kept."""


class PermissionDenied(KvError):
    """The caller may not do this: its tenant is not the one it asked to act as, or none serves it."""
