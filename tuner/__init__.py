"""colltune: autotuned sparse gradient collectives on ``torch.distributed``.

The front door:

>>> import tuner
>>> res = tuner.sparse_allreduce(indices, values, size, op="sum")   # doctest: +SKIP
>>> state = tuner.TopkState(density=0.01)                             # doctest: +SKIP
>>> res = tuner.topk_allreduce(grad, state, op="avg")                 # doctest: +SKIP
"""

from __future__ import annotations

from algorithms import (
    ColltuneError,
    ColltuneTypeError,
    ColltuneValueError,
    RankMismatchError,
    RemoteInputError,
    SparseResult,
    TopkState,
    Traffic,
)
from algorithms import names as algorithm_names
from tuner.api import AsyncHandle, TopkResult, sparse_allreduce, topk_allreduce

__version__ = "0.1.0"

__all__ = [
    "AsyncHandle",
    "ColltuneError",
    "ColltuneTypeError",
    "ColltuneValueError",
    "RankMismatchError",
    "RemoteInputError",
    "SparseResult",
    "TopkResult",
    "TopkState",
    "Traffic",
    "algorithm_names",
    "sparse_allreduce",
    "topk_allreduce",
]
