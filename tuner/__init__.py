"""colltune: autotuned sparse gradient collectives on ``torch.distributed``.

The front door:

>>> import tuner
>>> res = colltune.sparse_allreduce(indices, values, size, op="sum")   # doctest: +SKIP
>>> state = colltune.TopkState(density=0.01)                             # doctest: +SKIP
>>> res = colltune.topk_allreduce(grad, state, op="avg")                 # doctest: +SKIP

``algorithm="auto"`` (the default) asks the selector (:mod:`colltune.selector`);
:func:`configure` sets its policy and profile for the whole process:

>>> colltune.configure(policy="my-policy.yaml", profile="my-cluster.yaml")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from colltune.algorithms import (
    ColltuneError,
    ColltuneTypeError,
    ColltuneValueError,
    RankMismatchError,
    RemoteInputError,
    CollectiveError,
    AbandonedCallError,
    SparseResult,
    TopkState,
    Traffic,
)
from colltune.algorithms import names as algorithm_names
from colltune.api import AsyncHandle, TopkResult, sparse_allreduce, topk_allreduce

if TYPE_CHECKING:
    from colltune.selector import Selector

__version__ = "0.1.0"

__all__ = [
    "AsyncHandle",
    "ColltuneError",
    "ColltuneTypeError",
    "ColltuneValueError",
    "RankMismatchError",
    "RemoteInputError",
    "CollectiveError",
    "AbandonedCallError",
    "SparseResult",
    "TopkResult",
    "TopkState",
    "Traffic",
    "Selector",
    "algorithm_names",
    "configure",
    "get_selector",
    "sparse_allreduce",
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
    :func:`colltune.selector.configure` for the arguments.
    """
    from colltune import selector as _selector

    return _selector.configure(policy, profile, selector=selector, **settings)


def get_selector() -> "Selector":
    """Return the selector ``auto`` calls use (built from the environment on first use)."""
    from colltune import selector as _selector

    return _selector.get_selector()


def __getattr__(name: str) -> Any:
    # The selector module loads policies and profiles: imported when first asked for.
    if name == "Selector":
        from colltune.selector import Selector

        return Selector
    raise AttributeError(f"module 'colltune' has no attribute {name!r}")
