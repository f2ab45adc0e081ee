"""Backends behind the step interface, chosen by name."""

from __future__ import annotations

from engine.backend import Backend
from engine.config import EngineConfig


def create_backend(name: str, config: EngineConfig | None = None) -> Backend:
    """The backend called ``name``, with its knobs from ``config`` (defaults when None)."""
    config = config or EngineConfig()
    if name == "numpy":
        from engine.backends.numpy import NumpyBackend

        return NumpyBackend(blas_threads=config.blas_threads)
    if name == "cuda":
        from engine.backends.cuda import CudaBackend

        return CudaBackend(config.cuda)
    raise ValueError(f"unknown backend {name!r} (numpy | cuda)")
