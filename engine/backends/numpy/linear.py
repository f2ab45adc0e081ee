"""Column-block products: ``x @ w.T`` for the numpy backend's weights at any row count.

At decode widths a product runs as a stack of column blocks (:class:`Linear`):
OpenBLAS then takes its unpacked small-matrix kernel for each block instead of
a GEMM that copies (packs) every weight panel first, so 8 rows read the
weights about as fast as 1 row does (docs/PERFORMANCE.md, numpy backend).
"""

from __future__ import annotations

import numpy as np

# OpenBLAS (SMALL_MATRIX_OPT builds, e.g. numpy's SkylakeX kernels) runs an sgemm
# with M*N*K <= 100**3 through an unpacked small-matrix kernel; for the operand
# order numpy gives ``x @ w_block.T`` it also wants M*N <= 1200 (M = block
# columns, N = rows). Anything larger goes through the packed GEMM, which copies
# every weight panel before use: at 2-8 rows that costs 2-3x the 1-row GEMV.
_SMALL_MNK = 1_000_000
_SMALL_MN = 1200
_MIN_BLOCK = 32  # narrower than this (prefill chunks past ~40 rows), the packed GEMM is as fast


def block_width(rows: int, n_out: int, k_in: int) -> int | None:
    """Columns per block for ``rows`` x [k_in] @ [k_in, n_out], or None for one plain GEMM."""
    if rows == 1:
        return None  # GEMV already reads the weights once
    cap = min(_SMALL_MN // rows, _SMALL_MNK // (rows * k_in))
    cap -= cap % 16
    if cap < _MIN_BLOCK:
        return None
    if n_out <= cap:
        return n_out
    # The widest block (a multiple of 16) that divides n_out; else the widest, plus a tail product.
    return next((b for b in range(cap, _MIN_BLOCK - 1, -16) if n_out % b == 0), cap)


def plain_gemm(rows: int) -> bool:
    """Whether every product of ``rows`` rows, whatever the matrix, runs as one plain GEMM (no column
    blocks, no GEMV): then a row's result does not depend on how many rows share the product."""
    return rows > 1 and _SMALL_MN // rows < _MIN_BLOCK


def gemm_rows_independent(k_in: int, n_outs: tuple[int, ...]) -> bool:
    """Whether this process's BLAS gives a row of a plain GEMM the same bits whatever the rows beside
    it, for [rows, k_in] @ [k_in, n] at each of ``n_outs``: probed once per shape on fixed random
    operands at prefill-like row counts. OpenBLAS's SkylakeX kernels do; its Haswell kernels (seen on
    an AMD EPYC) round a row differently as the row count changes, so there a prefill group cannot
    share one forward and keep each span's bits (NumpyBackend.prefill_group). The probe keeps the
    reduction length ``k_in`` (what a row's rounding runs along) and each width's remainder by 16
    (the kernels' column tail), with at most _PROBE_COLS columns: the products at the model's full
    widths cost an 8B-shaped load seconds (x 160 rows of its 49k-token head alone: 64 GFLOP)."""
    key = (k_in, tuple(n % 16 + min(n - n % 16, _PROBE_COLS) for n in n_outs))
    if key not in _PROBED:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((160, k_in), dtype=np.float32)
        same = True
        for n in key[1]:
            w = rng.standard_normal((n, k_in), dtype=np.float32)
            full = x @ w.T
            same = same and all(np.array_equal(x[:m] @ w.T, full[:m]) for m in (40, 41, 63, 100, 127))
        _PROBED[key] = same
    return _PROBED[key]


_PROBED: dict[tuple, bool] = {}
_PROBE_COLS = 256  # most columns of a probe product (plus the width's remainder by 16)


class Linear:
    """``y = x @ w.T`` for ``w`` [out, in] (the checkpoint's layout, C-contiguous).

    At decode widths the product is one stacked matmul over column blocks
    ``w[j*b:(j+1)*b]`` -- views of ``w``, no copy -- written straight into the
    columns of the output, so each block is one small BLAS call (see
    :func:`block_width`). Prefill chunks (many rows) run one plain GEMM.
    """

    __slots__ = ("w", "_plans")

    def __init__(self, w: np.ndarray, *, share: bool = False):
        # A view into the loader's buffers (or a mapped file) is copied once, as the old
        # transposed layout was; ``share`` keeps the array itself (the tied embedding).
        w = np.asarray(w, dtype=np.float32)
        if not (share and w.flags.c_contiguous):
            w = np.array(w, order="C", copy=True if w.base is not None else None)
        self.w = w
        self._plans: dict[int, tuple | None] = {}

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def _plan(self, rows: int) -> tuple | None:
        n_out, k_in = self.w.shape
        b = block_width(rows, n_out, k_in)
        if b is None:
            return None
        nb = n_out // b
        main = self.w[: nb * b].reshape(nb, b, k_in).transpose(0, 2, 1)  # [nb, in, b]
        tail = self.w[nb * b :].T if nb * b < n_out else None
        return b, nb, main, tail

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        rows = x.shape[0]
        try:
            plan = self._plans[rows]
        except KeyError:
            plan = self._plans[rows] = self._plan(rows)
        if plan is None:
            return np.matmul(x, self.w.T, out=out)
        b, nb, main, tail = plan
        if out is None:
            out = np.empty((rows, self.w.shape[0]), dtype=np.float32)
        # out[:, j*b:(j+1)*b] as [nb, rows, b]; BLAS writes each block in place (ldc = out columns).
        if tail is None:
            np.matmul(x, main, out=out.reshape(rows, nb, b).transpose(1, 0, 2))
        else:
            np.matmul(x, main, out=np.lib.stride_tricks.as_strided(out, (nb, rows, b), (b * 4, out.strides[0], 4)))
            np.matmul(x, tail, out=out[:, nb * b :])
        return out
