"""colltune: autotuned sparse gradient collectives on ``torch.distributed``.

The front door:

>>> import colltune
>>> res = colltune.sparse_allreduce(indices, values, size, op="sum")   # doctest: +SKIP
>>> state = colltune.TopkState(density=0.01)                             # doctest: +SKIP
>>> res = colltune.topk_allreduce(grad, state, op="avg")                 # doctest: +SKIP

``algorithm="auto"`` (the default) asks the selector (:mod:`colltune.select.selector`);
:func:`configure` sets its policy and profile for the whole process:

>>> colltune.configure(policy="my-policy.yaml", profile="my-cluster.yaml")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from colltune.algorithms.base import SparseResult
    from colltune.algorithms.comm import Traffic
    from colltune.algorithms.errors import (
        AbandonedCallError,
        CollectiveError,
        ColltuneError,
        ColltuneTypeError,
        ColltuneValueError,
        RankMismatchError,
        RemoteInputError,
    )
    from colltune.algorithms.state import TopkState
    from colltune.api import AsyncHandle, TopkResult, sparse_allreduce, topk_allreduce
    from colltune.fused import sparse_allreduce_many
    from colltune.select.selector import Selector

__version__ = "0.1.0"

#: Where each public name lives. Names are imported on first use, so that
#: ``import colltune.model`` (the pure layer) never loads torch.
_EXPORTS: dict[str, str] = {
    "AsyncHandle": "colltune.api",
    "TopkResult": "colltune.api",
    "sparse_allreduce": "colltune.api",
    "sparse_allreduce_many": "colltune.fused",
    "topk_allreduce": "colltune.api",
    "SparseResult": "colltune.algorithms.base",
    "Traffic": "colltune.algorithms.comm",
    "TopkState": "colltune.algorithms.state",
    "ColltuneError": "colltune.algorithms.errors",
    "ColltuneTypeError": "colltune.algorithms.errors",
    "ColltuneValueError": "colltune.algorithms.errors",
    "RankMismatchError": "colltune.algorithms.errors",
    "RemoteInputError": "colltune.algorithms.errors",
    "CollectiveError": "colltune.algorithms.errors",
    "AbandonedCallError": "colltune.algorithms.errors",
    "Selector": "colltune.select.selector",
}

__all__ = [
    "AbandonedCallError",
    "AsyncHandle",
    "CollectiveError",
    "ColltuneError",
    "ColltuneTypeError",
    "ColltuneValueError",
    "RankMismatchError",
    "RemoteInputError",
    "Selector",
    "SparseResult",
    "TopkResult",
    "TopkState",
    "Traffic",
    "algorithm_names",
    "configure",
    "get_selector",
    "sparse_allreduce",
    "sparse_allreduce_many",
    "topk_allreduce",
]


def configure(
    policy: Any = None,
    profile: Any = None,
    *,
    selector: "Selector | None" = None,
    **settings: Any,
) -> "Selector":
    """Set the policy and profile every ``algorithm="auto"`` call of this process uses; return the selector.

    Call it identically on every rank. Without arguments it rebuilds the
    default selector from the environment (``COLLTUNE_POLICY``,
    ``COLLTUNE_ALGO``...) and forgets every cached decision. See
    :func:`colltune.select.selector.configure` for the arguments.
    """
    from colltune.select import selector as _selector

    return _selector.configure(policy, profile, selector=selector, **settings)


def get_selector() -> "Selector":
    """Return the selector ``auto`` calls use (built from the environment on first use)."""
    from colltune.select import selector as _selector

    return _selector.get_selector()


def algorithm_names() -> tuple[str, ...]:
    """Return the names of the registered algorithms (``algorithm=`` takes these or ``"auto"``)."""
    from colltune.algorithms import names

    return names()


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in ("algorithms", "api", "model", "select", "train", "offline", "cli"):
        return importlib.import_module(f"colltune.{name}")
    raise AttributeError(f"module 'colltune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
