"""Errors a user can act on. Each message says what was wrong and what to pass instead.

The CLI prints these without a traceback; the server maps them to 4xx responses.
"""


class SpecError(Exception):
    """Base class for every error caused by the user's input or environment, not by a bug."""


class ConfigError(SpecError, ValueError):
    """A flag or a combination of flags is invalid."""


class ModelLoadError(SpecError):
    """A model path, file or architecture cannot be loaded."""


class RequestError(SpecError, ValueError):
    """A request (prompt, sampling parameters) is invalid; `param` names the offending parameter."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class DistributedError(SpecError):
    """A tensor-parallel rank failed to start, died or stopped answering: the engine cannot go on."""
