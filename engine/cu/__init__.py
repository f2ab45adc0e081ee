"""CUDA C kernels for the cuda backend, compiled at load by PyCUDA (``-arch=sm_90``).

Nothing here imports PyCUDA at module import time: ``engine.cu.kernels`` does
that lazily, so the package imports on machines without CUDA.
"""
