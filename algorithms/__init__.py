"""Sparse allreduce algorithms on ``torch.distributed``, registered by name.

Public names are re-exported from their modules (``base``: the contract;
``comm``: the counting comm layer; ``meta``: the metadata record;
``sparse``: COO helpers; ``state``: thresholds and boundaries; ``registry``:
the table of algorithms) and imported on first use, so that the errors and
the registry can be read without loading torch.

The algorithms are the registry's (:func:`names`, built-ins first), each
described in its module's docstring; the list lives nowhere else. A
registered algorithm's class is an attribute here too, found through the
registry (``colltune.algorithms.Dense``, a plugin's by its class name).

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
    from colltune.algorithms.base import Algorithm, SparseInput, SparseResult, TopkOutput
    from colltune.algorithms.comm import Comm, Traffic
    from colltune.algorithms.state import BoundaryState, TopkState

_LAZY: dict[str, str] = {
    "Algorithm": "base",
    "SparseInput": "base",
    "SparseResult": "base",
    "TopkOutput": "base",
    "Comm": "comm",
    "Traffic": "comm",
    "BoundaryState": "state",
    "TopkState": "state",
}

__all__ = [
    "AbandonedCallError",
    "Algorithm",
    "BoundaryState",
    "CollectiveError",
    "ColltuneError",
    "ColltuneTypeError",
    "ColltuneValueError",
    "Comm",
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
    else:  # a registered algorithm's class (Dense, OkTopk...): the registry lists them, not this module
        try:
            value = next((type(a) for a in map(get, names()) if type(a).__name__ == name), None) \
                if name[:1].isupper() else None
        except ColltuneError as exc:  # a plugin that cannot load: hasattr() says no, a call says why
            raise AttributeError(f"module 'colltune.algorithms' has no attribute {name!r} ({exc})") from exc
        if value is None:
            raise AttributeError(f"module 'colltune.algorithms' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
