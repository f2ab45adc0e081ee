"""Backends behind the step interface, chosen by name."""

from engine.backend import Backend
from engine.config import CudaTuning


def create_backend(name: str, *, cuda: CudaTuning | None = None) -> Backend:
    if name == "numpy":
        from engine.backends.numpy_backend import NumpyBackend

        return NumpyBackend()
    if name == "cuda":
        from engine.backends.cuda import CudaBackend

        return CudaBackend(cuda)
    raise ValueError(f"unknown backend {name!r} (numpy | cuda)")
