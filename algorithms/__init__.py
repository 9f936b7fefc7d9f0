"""Sparse allreduce algorithms on ``torch.distributed``, registered by name.

Public names are re-exported from their modules (``base``: the contract;
``comm``: the counting comm layer; ``meta``: the metadata record;
``sparse``: COO helpers; ``state``: thresholds and boundaries; ``registry``:
the table of algorithms) and imported on first use, so that the errors and
the registry can be read without loading torch.

The algorithms are the registry's (:func:`names`, built-ins first), each
described in its module's docstring; the list lives nowhere else.

Example:
    >>> from colltune import algorithms
    >>> algorithms.names()[:3]
    ('dense', 'allgather', 'oktopk')
    >>> algorithms.get("oktopk").name
    'oktopk'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from colltune.algorithms.errors import (
    AbandonedCallError,
    CollectiveError,
    ColltuneError,
    ColltuneTypeError,
    ColltuneValueError,
    RankMismatchError,
    RemoteInputError,
)
from colltune.algorithms.registry import get, names, register, unregister

if TYPE_CHECKING:
    from colltune.algorithms.allgather import Allgather
    from colltune.algorithms.base import Algorithm, SparseInput, SparseResult, TopkOutput
    from colltune.algorithms.comm import Comm, Traffic
    from colltune.algorithms.dense import Dense
    from colltune.algorithms.oktopk import OkTopk
    from colltune.algorithms.state import BoundaryState, TopkState

_LAZY: dict[str, str] = {
    "Algorithm": "base",
    "SparseInput": "base",
    "SparseResult": "base",
    "TopkOutput": "base",
    "Comm": "comm",
    "Traffic": "comm",
    "Dense": "dense",
    "Allgather": "allgather",
    "OkTopk": "oktopk",
    "BoundaryState": "state",
    "TopkState": "state",
}

__all__ = [
    "AbandonedCallError",
    "Algorithm",
    "Allgather",
    "BoundaryState",
    "CollectiveError",
    "ColltuneError",
    "ColltuneTypeError",
    "ColltuneValueError",
    "Comm",
    "Dense",
    "OkTopk",
    "RankMismatchError",
    "RemoteInputError",
    "SparseInput",
    "SparseResult",
    "TopkOutput",
    "TopkState",
    "Traffic",
    "get",
    "names",
    "register",
    "unregister",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"colltune.algorithms.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'colltune.algorithms' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
