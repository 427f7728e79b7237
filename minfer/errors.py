"""The exceptions minfer raises on bad input: one class per kind of problem.

Every message is one line that names the thing at fault (file, tensor, option), so that the CLI can
print it as-is and exit non-zero.
"""

from __future__ import annotations


class MinferError(Exception):
    """Base class of every error minfer raises on purpose."""


class ConfigError(MinferError):
    """A config.json value or a user option is missing, malformed or unsupported."""


class CheckpointError(MinferError):
    """A weights file is malformed, truncated, or does not match the model's config."""


class ArenaExhausted(MinferError, MemoryError):
    """A request for arena memory does not fit in what the arena has left."""

    def __init__(self, arena: str, requested: int, available: int, capacity: int, what: str = ""):
        self.arena = arena
        self.requested = requested
        self.available = available
        self.capacity = capacity
        label = f" for {what}" if what else ""
        super().__init__(
            f"arena '{arena}' cannot hand out {requested} bytes{label}: "
            f"{available} bytes available of {capacity} (raise the workspace or lower batch/length)"
        )


class InputError(MinferError, ValueError):
    """A request's inputs are empty, out of range or inconsistent (token ids, lengths, options)."""


class ModelNotFoundError(MinferError):
    """A model name resolves to nothing: no such folder, no such hub repo, or not cached offline."""


class TokenizerError(MinferError):
    """A tokenizer file is missing, malformed or unusable."""


class StreamingError(MinferError, OSError):
    """Streamed layers cannot be stored or read back (the temporary disk is missing or full)."""


class Cancelled(MinferError):
    """A request was cancelled (`Stream.cancel()`, e.g. a client that disconnected) before it
    ended."""


class NonFiniteError(MinferError, ArithmeticError):
    """A model's outputs hold NaN or infinity (weights that load but overflow in float16 or in
    their own arithmetic): the message names the model and the layer where they began."""
