"""Backends behind the step interface, chosen by name."""

from engine.backend import Backend


def create_backend(name: str) -> Backend:
    if name == "numpy":
        from engine.backends.numpy_backend import NumpyBackend

        return NumpyBackend()
    if name == "cuda":
        from engine.backends.cuda_backend import CudaBackend

        return CudaBackend()
    raise ValueError(f"unknown backend {name!r} (numpy | cuda)")
