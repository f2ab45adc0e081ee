"""The engine's part of the configuration (``model.*`` and ``spec.*`` keys).

The Django side owns the full schema and where values come from (flags,
environment, admin, PATCH /v1/config); the engine only sees this dataclass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

MiB = 1 << 20


@dataclass
class CudaTuning:
    """The CUDA backend's tuning knobs (``cuda.*`` keys); engine/ reads no environment."""

    gemv_u2_below: int = 40 << 20  # cuda.gemv_u2_below: matrices under this many weights use gemv_tc's 2-step variant
    kernel_cache_dir: str = ""  # compiled kernels (PyCUDA's cache); "" = <models dir>/.cache/pycuda


@dataclass
class EngineConfig:
    backend: str = "numpy"  # numpy | cpu | cuda
    decode_lanes: int = 8  # spec.decode_lanes
    prefill_chunk: int = 1024  # model.prefill_chunk
    decode_share: float = 0.25  # model.decode_share (fraction of time the lanes keep)
    default_max_tokens: int = 1024  # model.default_max_tokens
    max_context: int = 8192  # model.max_context (clamped to the model's own)
    block_size: int = 16  # model.kv_block_size
    kv_ram_budget: int = 768 * MiB  # numpy backend: RAM for the device-tier KV pool
    host_kv_budget: int = 2048 * MiB  # the host-RAM tier for swapped pages
    retry_after_floor: float = 1.0  # seconds; the least Retry-After an engine_full gets
    blas_threads: int = 1  # model.blas_threads: numpy backend's BLAS threads (0 = leave BLAS as it is)
    cpu_threads: int = 0  # model.cpu_threads: cpu backend's threads (0 = every core this process may use)
    cpu_kernel_cache_dir: str = ""  # cpu backend's compiled kernels; "" = <repo>/models/.cache/cpu-kernels
    cuda: CudaTuning = field(default_factory=CudaTuning)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        values = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if isinstance(values.get("cuda"), dict):
            values["cuda"] = CudaTuning(**values["cuda"])
        return cls(**values)
