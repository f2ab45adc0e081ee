"""The CUDA backend: bf16 weights on one GPU, kernels from engine/cu, decode rounds
replayed from one CUDA graph per exact width 1..8 (docs/CUDA.md).

* ``weights``: upload and the device layouts (q|k|v and gate|up fused and interleaved);
* ``forward``: decode rounds and prefill chunks built from the model definition;
* ``graphs``: the decode graphs and their named static staging buffers;
* ``sampling``: device sampling, host-sampled constrained rows, logprobs;
* ``kv``: the paged KV pool and the host tier it swaps to;
* ``backend``: ``CudaBackend``, the step interface over them.

Nothing here imports PyCUDA at module import time.
"""

from engine.backends.cuda.backend import CudaBackend

__all__ = ["CudaBackend"]
