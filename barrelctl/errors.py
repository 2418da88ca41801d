"""Exit codes of the contract, and the one mapping from gRPC status codes to them."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


class CliError(Exception):
    """An expected failure: printed as one line on stderr, then the process exits with `code`."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def exit_code_for(status_name: str) -> int:
    """INVALID_ARGUMENT is the caller's mistake (2); UNAVAILABLE means no daemon (3); the rest failed (1)."""
    if status_name == "INVALID_ARGUMENT":
        return EXIT_USAGE
    if status_name == "UNAVAILABLE":
        return EXIT_UNREACHABLE
    return EXIT_FAILED


class ClientError(CliError):
    """A call to the daemon that failed: its gRPC status name (`status`), the daemon's own message
    (`details`, empty when it sent none) and the exit code the contract gives that status."""

    def __init__(self, status: str, details: str, message: str | None = None) -> None:
        super().__init__(message or details or status.lower(), exit_code_for(status))
        self.status = status
        self.details = details


class DaemonDied(ClientError):
    """A call broke because the daemon died: the message says of what, where it was, and where its log is.
    The status stays UNAVAILABLE (the daemon is gone) but the exit code is 1: the operation failed, and
    starting another daemon does not help until the cause is dealt with."""

    def __init__(self, details: str, sentence: str) -> None:
        super().__init__("UNAVAILABLE", details, sentence)
        self.code = EXIT_FAILED
