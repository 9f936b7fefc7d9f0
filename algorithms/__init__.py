"""Sparse allreduce algorithms on ``torch.distributed``, registered by name.

==============  =============================================================
name            what it does
==============  =============================================================
``dense``       densify, ``all_reduce``, extract the union
``allgather``   gather every rank's packed entries, merge in rank order
``oktopk``      Ok-Topk: split-reduce over balanced regions, then allgatherv
==============  =============================================================

Example:
    >>> import algorithms
    >>> colltune.algorithms.names()
    ('dense', 'allgather', 'oktopk')
    >>> colltune.algorithms.get("oktopk").name
    'oktopk'
"""

from __future__ import annotations

from colltune.algorithms._comm import Comm, Traffic
from colltune.algorithms.allgather import Allgather
from colltune.algorithms.base import Algorithm, SparseInput, SparseResult, TopkOutput
from colltune.algorithms.dense import Dense
from colltune.algorithms.errors import (
    ColltuneError,
    ColltuneTypeError,
    ColltuneValueError,
    RankMismatchError,
    RemoteInputError,
    CollectiveError,
    AbandonedCallError,
)
from colltune.algorithms.oktopk import OkTopk
from colltune.algorithms.state import BoundaryState, TopkState

__all__ = [
    "Algorithm",
    "Allgather",
    "BoundaryState",
    "ColltuneError",
    "ColltuneTypeError",
    "ColltuneValueError",
    "Comm",
    "Dense",
    "OkTopk",
    "RankMismatchError",
    "RemoteInputError",
    "CollectiveError",
    "AbandonedCallError",
    "SparseInput",
    "SparseResult",
    "TopkOutput",
    "TopkState",
    "Traffic",
    "get",
    "names",
]

_REGISTRY: dict[str, Algorithm] = {a.name: a for a in (Dense(), Allgather(), OkTopk())}


def names() -> tuple[str, ...]:
    """Return the names of the registered algorithms."""
    return tuple(_REGISTRY)


def get(name: str) -> Algorithm:
    """Return the algorithm registered as ``name``.

    Raises:
        ColltuneValueError: ``name`` is not registered; the message lists the known names.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ColltuneValueError(
            f"algorithm must be one of {', '.join(_REGISTRY)} (or 'auto'), but got {name!r}."
        ) from None
