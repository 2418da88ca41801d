"""Domain errors: each carries the category the server maps to a gRPC status, and one line for the user."""

from __future__ import annotations


class BarrelError(Exception):
    """Base of every error a client may see; the message is one line that says what to do next."""

    code = "INTERNAL"


class InvalidArgument(BarrelError):
    code = "INVALID_ARGUMENT"


class NotFound(BarrelError):
    code = "NOT_FOUND"


class FailedPrecondition(BarrelError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(BarrelError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(BarrelError):
    code = "UNAVAILABLE"


class PermissionDenied(BarrelError):
    code = "PERMISSION_DENIED"


class Unauthenticated(BarrelError):
    code = "UNAUTHENTICATED"


class ContextLengthExceeded(InvalidArgument):
    """The prompt does not fit the model's context (OpenAI's `context_length_exceeded`)."""
