"""Shared helpers for the GPU tests: skip without PyCUDA / a CUDA device."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def cuda_available() -> bool:
    try:
        import pycuda.driver as cuda

        cuda.init()
        return cuda.Device.count() > 0
    except Exception:
        return False


requires_cuda = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs PyCUDA and a CUDA device"),
]


def gpu(test):
    """``requires_cuda`` as one decorator, for a module whose other tests run anywhere."""
    for mark in requires_cuda:
        test = mark(test)
    return test


class Dev:
    """Device copies of host arrays, kept alive for the test (bf16: rounded to bf16 on the way)."""

    def __init__(self) -> None:
        self.live: list = []

    def put(self, a, bf16: bool = False):
        import numpy as np
        import pycuda.gpuarray as ga

        from engine.backends.cuda.weights import to_bf16

        g = ga.to_gpu(to_bf16(a) if bf16 else np.ascontiguousarray(a))
        self.live.append(g)
        return g
