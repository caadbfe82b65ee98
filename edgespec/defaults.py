"""Defaults written once: `assemble.Settings`, the CLI's flags (default=Settings.x) and the classes
that take them all read them here. Standard library only (the CLI imports it before numpy)."""

N_CTX = 4096     # the context a model is loaded with unless told (Settings.n_ctx, --ctx)
ALL_LAYERS = -1  # n_gpu_layers: offload every layer (backend.ALL_GPU_LAYERS is what llama.cpp is then given)
GAMMA = 4        # draft length a round of the fixed-length drafters (model, ngram, copy; --gamma)
