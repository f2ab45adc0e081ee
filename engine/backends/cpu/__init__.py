"""The cpu backend: C kernels (compiled through cffi) over GGUF-quantized weights."""

from .backend import CpuBackend

__all__ = ["CpuBackend"]
