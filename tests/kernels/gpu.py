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
