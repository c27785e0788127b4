"""Errors the core raises on purpose: each says what was wrong and what to change. Imports nothing: backends
raise these too."""


class BackendNotFoundError(ValueError):
    """The requested backend does not exist or cannot run on this machine."""


class ConfigError(ValueError):
    """An engine setting (flag, env var or argument) is invalid or conflicts with another."""


class InvalidRequestError(ValueError):
    """A request cannot be served as given (prompt too long, bad sampling parameter, ...).

    ``param`` names the offending field, for the OpenAI error format.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BackendDeadError(RuntimeError):
    """The backend cannot run any further step (a worker process died): the engine stops at once instead of
    failing only the step's requests."""


class QueueFullError(RuntimeError):
    """The engine already holds ``max_waiting_requests`` queued requests: try again later."""


class ModelNotFoundError(ValueError):
    """The model path does not exist or is not a format pagedllm reads."""


class UnsupportedModelError(ValueError):
    """The model's architecture is not one this backend runs."""


def client_message(exc: BaseException) -> str:
    """What a client may be told of an error: the text of the errors above, written for users, else only its kind
    (an arbitrary exception's text may name files and internals; the server's log has it)."""
    if isinstance(exc, (BackendNotFoundError, ConfigError, InvalidRequestError, BackendDeadError, QueueFullError,
                        ModelNotFoundError, UnsupportedModelError)):
        return str(exc)
    return f"{type(exc).__name__}; the server log has the details"


__all__ = [
    "BackendDeadError",
    "BackendNotFoundError",
    "ConfigError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "QueueFullError",
    "UnsupportedModelError",
]
