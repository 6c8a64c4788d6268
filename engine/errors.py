"""The engine's error taxonomy. Every error a user can cause says how to fix it."""


class DitServeError(Exception):
    """Base class of every error raised on purpose by ditserve.engine."""


class ConfigError(DitServeError, ValueError):
    """An engine option, or a combination of options, is invalid."""


class ModelLoadError(DitServeError):
    """A model directory is missing, incomplete, or of an unsupported pipeline class."""


class HostMemoryError(ConfigError):
    """Loading would commit more host memory than is available (the engine refuses to start
    instead of being OOM-killed); the message names the flags that would fit."""


class InvalidRequestError(DitServeError, ValueError):
    """A generation request has an invalid field; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class RequestAborted(DitServeError):
    """The request was cancelled (client gone, timeout, or shutdown) before it finished."""


class EngineStoppedError(DitServeError):
    """The engine is not running (never started, shutting down, or its loop died)."""


class QueueFullError(DitServeError):
    """The waiting queue is at ``max_queue``; retry later."""


class BatchMismatchError(DitServeError, ValueError):
    """Requests given one denoise forward disagree on its tensor contract (shape group or
    static tensors): a pipeline bug, not a user error."""


class OffloadError(DitServeError):
    """Layerwise offload could not be enabled or failed while running."""


class DistributedError(DitServeError):
    """A worker process died, hung, or disagreed with the group."""


class FormatError(DitServeError, ValueError):
    """A packed or quantized weight format is malformed, or does not fit where it is used."""


class AdapterError(DitServeError, ValueError):
    """A LoRA adapter file cannot be served (format, targets, rank), or an adapter operation
    is refused (unknown name, in use by a running request)."""


class AdapterFileNotFoundError(AdapterError):
    """An adapter path names no file (or a directory without a ``.safetensors``)."""


class AdapterConflictError(AdapterError):
    """The adapter operation conflicts with the current state: the name is already loaded,
    or the adapter is in use by a queued or running request."""


class AdapterNotFoundError(AdapterError, KeyError):
    """No adapter of that name is loaded."""

    def __str__(self) -> str:  # KeyError quotes its argument
        return str(self.args[0]) if self.args else ""


class DeadlineError(DitServeError):
    """A request cannot meet its ``deadline_s`` by the scheduler's estimate: refused at
    admission, or stopped at a step boundary (``deadline_exceeded``), never silently late.
    ``started``: it had run denoise steps (False: refused, or stopped while it waited)."""

    def __init__(self, message: str, *, estimate_s: float | None = None,
                 started: bool = False) -> None:
        super().__init__(message)
        self.estimate_s = estimate_s
        self.started = started
