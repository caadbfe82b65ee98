"""Typed errors. The library raises these; only cli.py turns them into messages and exit codes."""
import math


class EdgespecError(Exception):
    """Base class. `exit_code` 2 means bad usage or input, 1 a runtime failure."""

    exit_code = 1


class UsageError(EdgespecError, ValueError):
    """A bad argument: out-of-range sampling parameter, unknown drafter, prompt too long."""

    exit_code = 2


class ConstraintError(UsageError):
    """A schema, regex or grammar that no text satisfies (found when its matcher starts, or when
    an answer reaches a dead end of it)."""


class ModelFileError(EdgespecError):
    """A GGUF file that is missing, unreadable, truncated or not a GGUF at all."""

    exit_code = 2


class IncompatiblePairError(EdgespecError):
    """Target and draft do not share a tokenizer, so speculation between them is impossible."""

    exit_code = 2


class RegistryError(EdgespecError):
    """Unknown pair name or malformed models.toml."""

    exit_code = 2


class DownloadError(EdgespecError):
    """A model could not be fetched or failed its checksum."""

    exit_code = 1


class BackendError(EdgespecError):
    """llama.cpp refused an operation (decode failure, context full)."""

    exit_code = 1


class Aborted(BackendError):
    """A llama_decode stopped by its abort callback (a cancelled prompt): the positions of the
    batch it was computing are not in the cache."""


class ChecksumError(DownloadError):
    """A downloaded file did not match its sha256; nothing of it was kept."""


class ContextLengthError(UsageError):
    """A prompt (and the room asked for its answer) longer than the context holds."""

    def __init__(self, message: str, *, prompt_tokens: int, n_ctx: int, room: int = 1):
        super().__init__(message)
        self.prompt_tokens, self.n_ctx, self.room = prompt_tokens, n_ctx, room


class EngineClosedError(UsageError):
    """A method was called on an Engine after close()."""


class DamagedModelError(BackendError):
    """The weights gave non-finite logits: the file is damaged past its header (bad input)."""

    exit_code = 2


def check_finite(target, logits) -> None:
    """A NaN row means a damaged file: one line naming it (the prefill checks its row, a round the
    rows it reads). `target`: the backend (its `path`), `logits`: a numpy row or rows."""
    if logits.size and not math.isfinite(float(logits.max())):
        raise damaged(target)


def damaged(target) -> DamagedModelError:
    return DamagedModelError(f"{target.path.name} produced non-finite logits (NaN): the file is damaged; "
                             "download it again")
