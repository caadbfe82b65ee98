"""Defaults written once: `assemble.Settings`, the CLI's flags (default=Settings.x) and the classes
that take them all read them here. Standard library only (the CLI imports it before numpy)."""

N_CTX = 4096     # the context a model is loaded with unless told (Settings.n_ctx, --ctx)
ALL_LAYERS = -1  # n_gpu_layers: offload every layer (backend.ALL_GPU_LAYERS is what llama.cpp is then given)
GAMMA = 4        # draft length a round of the fixed-length drafters (model, ngram, copy; --gamma)


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, where the OS has one): the most threads
    --threads or $EDGESPEC_THREADS may ask for."""
    import os
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1
