"""Drafters propose tokens for the target to verify.

Lifecycle per request: begin(prompt tokens) once, then each round propose(...) and, after
verification, accept(committed tokens). A drafter returns q rows (the distribution each draft
was sampled from) or None for point-mass drafts.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..sampling import SamplingParams


class Drafter(Protocol):
    name: str

    def begin(self, tokens: list[int]) -> None: ...

    def propose(self, tokens: list[int], gamma: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]: ...

    def accept(self, tokens: list[int]) -> None: ...

    def close(self) -> None: ...
