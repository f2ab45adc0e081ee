"""The numpy reference backend: ``ops`` (every operation's reference), ``linear`` (the
column-block products), ``forward`` (the layer loop from a model definition),
``backend`` (``NumpyBackend``: load, KV pool, swaps, the step interface)."""

from engine.backends.numpy.backend import NumpyBackend, limit_blas_threads

__all__ = ["NumpyBackend", "limit_blas_threads"]
