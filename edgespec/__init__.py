"""edgespec: exact speculative decoding for GGUF models on llama.cpp."""
from .errors import (BackendError, DownloadError, EdgespecError, IncompatiblePairError,
                     ModelFileError, RegistryError, UsageError)

__all__ = ["Engine", "GenerationResult", "GenerationStats", "StreamEvent", "EdgespecError",
           "UsageError", "ModelFileError", "IncompatiblePairError", "RegistryError",
           "DownloadError", "BackendError"]
__version__ = "0.1.0"


def __getattr__(name):
    # The engine pulls in llama.cpp and numpy; keep `import edgespec.errors` (used by the
    # stdlib-only model fetcher) free of both.
    if name in ("Engine", "GenerationResult", "GenerationStats", "StreamEvent"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(name)
