"""edgespec: exact speculative decoding for GGUF models on llama.cpp."""
from .errors import (BackendError, ConstraintError, ContextLengthError, DownloadError, EdgespecError,
                     EngineClosedError, IncompatiblePairError, ModelFileError, RegistryError, UsageError)
from .progress import Progress

__all__ = ["Engine", "Settings", "Stream", "GenerationResult", "GenerationStats", "StreamEvent", "SamplingParams",
           "Progress", "EdgespecError", "UsageError", "ModelFileError", "IncompatiblePairError", "RegistryError",
           "DownloadError", "BackendError", "EngineClosedError", "ContextLengthError", "ConstraintError", "Request"]


def _version() -> str:
    # one place for the version: pyproject.toml, read back from the installed metadata
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("edgespec")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


__version__ = _version()

_LAZY = {"Engine": "engine", "Stream": "engine", "GenerationResult": "engine", "GenerationStats": "engine",
         "StreamEvent": "engine", "SamplingParams": "sampling", "Settings": "assemble", "Request": "request"}


def __getattr__(name):
    # the engine pulls in llama.cpp and numpy; keep `import edgespec.errors` (used by the
    # standard-library-only model fetcher) free of both
    if name in _LAZY:
        from importlib import import_module
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(name)
