"""What the DDP hook and the sparse-gradient synchronizer share: routing, checks, state records.

Routing, per parameter, the same on every rank (checked once with one small
collective; ranks that disagree raise :class:`~colltune.algorithms.errors.RankMismatchError`):

1. ``COLLTUNE_ALGO`` (the environment) overrides everything below.
2. A policy rule (or a policy ``default``) that names an algorithm: ``dense``
   keeps the parameter dense; ``allgather`` / ``oktopk`` compress a dense
   gradient with top-k, or run that exact algorithm on a sparse gradient.
3. Otherwise (``auto``): sparse gradients use the ``algorithm`` argument
   (``auto`` asks the selector); dense gradients follow the ``dense`` mode
   (hook: compress) and compress only from ``min_compress_numel`` elements.

Both products keep their state (residuals, thresholds, the routing
decisions) apart from the process group, in PowerSGD's style, and
round-trip it through ``state_dict()`` / ``load_state_dict()``.

The names in ``__all__`` are public inside the training layer, for
:mod:`colltune.train.hook` and :mod:`colltune.train.sync`; the package
``colltune.train`` exports only :class:`TensorStats` of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist

from colltune import algorithms as _algorithms
from colltune import api as _api
from colltune.algorithms.comm import group_device
from colltune.algorithms.errors import ColltuneTypeError, ColltuneValueError, RankMismatchError, RemoteInputError
from colltune.algorithms.sparse import upload
from colltune.algorithms.state import TopkState
from colltune.model.policy import AUTO, Decision, Overrides, Policy, policy_from_env

__all__ = [
    "STATE_VERSION",
    "Route",
    "TensorStats",
    "TopkAlgorithm",
    "backend_name",
    "check_choice",
    "check_density",
    "check_int",
    "check_same_plan",
    "check_state_dict",
    "group_size",
    "new_topk_state",
    "resolve_policy",
    "restore_topk_state",
    "ring_bytes",
    "route_for",
    "sparse_algorithms",
    "topk_algorithms",
    "topk_bytes_sent",
]

logger = logging.getLogger(__name__)

#: A top-k algorithm's name: ``auto`` or one of :func:`topk_algorithms`, checked against the registry when called.
TopkAlgorithm = str

#: The version of the ``state_dict()`` the hook and the synchronizer write and read.
STATE_VERSION = 1


def topk_algorithms() -> tuple[str, ...]:
    """The algorithms that compress a dense gradient: ``auto`` and every registered one that moves the
    selection (not the whole tensor, as ``dense`` does)."""
    return (AUTO, *(n for n in _algorithms.names() if _algorithms.get(n).topk_priced_on != "tensor"))


def sparse_algorithms() -> tuple[str, ...]:
    """The algorithms a sparse gradient may take: ``auto`` and every registered one."""
    return (AUTO, *_algorithms.names())


def check_int(label: str, value: Any, minimum: int) -> int:
    """Return ``value`` if it is an int of at least ``minimum``; raise naming ``label`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ColltuneTypeError(f"{label} must be an int >= {minimum}, but got {value!r}.")
    if value < minimum:
        raise ColltuneValueError(f"{label} must be an int >= {minimum}, but got {value}.")
    return value


def check_density(density: Any) -> float:
    """Return ``density`` as a float if it is in (0, 1]; raise naming it otherwise."""
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise ColltuneTypeError(f"density must be a float in (0, 1], but got {density!r}.")
    if not 0.0 < float(density) <= 1.0:
        raise ColltuneValueError(f"density must be in (0, 1], e.g. 0.01 for 1% of the entries, but got {density}.")
    return float(density)


def check_choice(label: str, value: Any, allowed: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``allowed``; raise naming ``label`` otherwise."""
    if value not in allowed:
        raise ColltuneValueError(f"{label} must be one of {', '.join(allowed)}, but got {value!r}.")
    return value


def resolve_policy(policy: Any) -> tuple[Policy, Overrides, Any]:
    """Return ``(policy, overrides, what to pass as policy= to the front door)``.

    The process-wide selector resolves the policy, as it does for ``auto``
    calls: ``None`` means its policy (:func:`colltune.configure`, else
    ``COLLTUNE_POLICY`` or no rules).

    Raises:
        ColltuneTypeError: ``policy`` is of none of the accepted types.
        PolicyError: the environment or the policy file is invalid.
    """
    # Imported on first use, as the front door does: building a hook or a synchronizer loads no selector.
    from colltune.select import selector

    if policy is None or isinstance(policy, (Policy, str, os.PathLike, selector.Selector)):
        sel = selector.selector_for(policy)
        return sel.policy, sel.overrides, policy
    policy_from_env()  # an invalid environment is reported first, as for a policy of an accepted type
    raise ColltuneTypeError(
        "policy must be a colltune.model.policy.Policy, a path to a policy YAML file, a colltune.Selector "
        f"or None, but got {type(policy).__name__}."
    )


def group_size(group: dist.ProcessGroup | None) -> int:
    """Return the group's world size, or 1 without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def backend_name(group: dist.ProcessGroup | None) -> str:
    """Return the group's backend in lower case (what policy rules match), or ``local`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend(group)).lower()
    return "local"


def _digest(data: Any) -> int:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big", signed=True)


def check_same_plan(plan: Any, group: dist.ProcessGroup | None, what: str, error: Exception | None = None) -> None:
    """Raise on every rank when ranks routed their tensors differently (they would deadlock otherwise).

    A rank that could not route them (``error``: a policy that does not
    load) joins the check and raises ``error``; the others raise
    :class:`~colltune.algorithms.errors.RemoteInputError` naming it.
    """
    if group_size(group) == 1:
        if error is not None:
            raise error
        return
    d = _digest(plan)
    failed = dist.get_rank(group) + 1 if error is not None else 0
    buf = upload([d, -d, failed], group_device(group))
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if int(buf[2]):
        raise RemoteInputError(
            f"{what}: rank {int(buf[2]) - 1} could not route its gradients (its policy, COLLTUNE_ALGO or "
            "COLLTUNE_POLICY is invalid), so this rank abandoned the step too; the error raised there says what to fix."
        )
    if int(buf[0]) != -int(buf[1]):
        raise RankMismatchError(
            f"{what}: ranks routed their gradients differently (different policies, COLLTUNE_ALGO, options "
            f"or models); this rank's plan is {json.dumps(plan)[:500]}. Give every rank the same model, "
            "options, policy file and environment."
        )


def all_reduce_queued(flat: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool) -> Any:
    """Sum ``flat`` over ``group`` in place, on colltune's queue over the group's private twin.

    Behind the calls still queued there (inline when none is), so that it
    keeps one order with colltune's calls on every rank, as NCCL asks of
    communicators used from several threads. Returns ``flat``, or with
    ``async_op`` a handle whose result it is.
    """
    return _api.submit_call(lambda wire: _sum_into(flat, wire), async_op, group, flat.device, (flat,))


def _sum_into(flat: torch.Tensor, wire: Any) -> torch.Tensor:
    dist.all_reduce(flat, group=wire)
    return flat


def ring_bytes(numel: int, itemsize: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``numel`` elements (textbook schedule)."""
    return 0 if world_size <= 1 else (2 * numel * itemsize * (world_size - 1)) // world_size


@dataclass
class TensorStats:
    """What one tensor (a parameter, or a bucket's part) went through.

    Attributes:
        route: ``sparse`` (exact sparse allreduce), ``topk`` (compressed) or
            ``dense`` (allreduce).
        algorithm: the algorithm of the last call (``dense`` for allreduce).
        reason: why it was routed so (the policy rule, the mode, the warm-up).
        calls: calls so far.
        bytes_sent: bytes this rank sent for it, in total.
        last_bytes: bytes this rank sent for it in the last call.
    """

    route: str
    algorithm: str
    reason: str = ""
    calls: int = 0
    bytes_sent: int = 0
    last_bytes: int = 0

    def record(self, algorithm: str, nbytes: int) -> None:
        self.algorithm = algorithm
        self.calls += 1
        self.bytes_sent += nbytes
        self.last_bytes = nbytes


@dataclass(frozen=True)
class Route:
    """How one parameter's gradient travels, and why (:func:`route_for` decides it)."""

    route: str  # "sparse" | "topk" | "dense"
    algorithm: str  # the algorithm passed to the front door (or "dense")
    knobs: Mapping[str, Any] = field(default_factory=dict)
    state_knobs: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""

    def plan(self) -> list[Any]:
        """Return the route as plain data: the wrappers check that every rank routed alike by comparing digests of it."""
        return [self.route, self.algorithm, sorted(self.knobs.items()), sorted(self.state_knobs.items())]


def _split_knobs(decision: Decision, algorithm: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a decision's knobs for ``algorithm`` into algorithm knobs and TopkState knobs."""
    if algorithm in (AUTO, "dense"):
        return {}, {}
    given = decision.knobs_for(algorithm)
    specs = _algorithms.get(algorithm)
    accepted = specs.knobs
    in_state = {k.name for k in specs.knob_specs if k.state}
    algo = {k: v for k, v in given.items() if k in accepted}
    state = {k: v for k, v in given.items() if k in in_state}
    return algo, state


def route_for(
    decision: Decision,
    overrides: Overrides,
    *,
    sparse: bool,
    numel: int,
    default_sparse: str,
    dense_mode: str,
    topk_algorithm: str,
    min_compress_numel: int,
) -> Route:
    """Decide how one parameter's gradient travels (see the module docstring for the precedence)."""
    forced = overrides.apply(decision) if overrides.algorithm is not None else None
    # COLLTUNE_ALGO=auto lets the selector decide even where a rule pins an algorithm.
    unpinned = forced is not None and forced.algorithm == AUTO
    pinned = decision.algorithm if decision.algorithm != AUTO and not unpinned else None
    if sparse:
        if forced is not None and forced.algorithm != AUTO:
            algo, why = forced.algorithm, forced.reason
        elif pinned is not None:
            algo, why = pinned, decision.reason
        else:
            algo, why = default_sparse, ("the algorithm argument" if default_sparse != AUTO else "auto: the selector")
        knobs, state_knobs = _split_knobs(decision, algo)
        return Route("sparse", algo, knobs, state_knobs, why)
    # Dense gradient: dense allreduce or top-k compression.
    if dense_mode == "skip":
        return Route("skip", "none", reason="dense='skip': left to DDP or the caller")
    if pinned == "dense" or (forced is not None and forced.algorithm == "dense"):
        return Route("dense", "dense", reason=(forced or decision).reason)
    if pinned is not None:
        compress, algo, why = True, pinned, decision.reason
    elif dense_mode == "topk" and numel >= min_compress_numel:
        compress, algo, why = True, topk_algorithm, f"dense='topk', numel {numel} >= min_compress_numel"
    elif dense_mode == "topk":
        compress, algo, why = False, "dense", f"numel {numel} < min_compress_numel {min_compress_numel}"
    else:
        compress, algo, why = False, "dense", "dense='allreduce'"
    if not compress:
        return Route("dense", "dense", reason=why)
    if forced is not None and forced.algorithm != AUTO:
        algo, why = forced.algorithm, forced.reason
    knobs, state_knobs = _split_knobs(decision, algo)
    return Route("topk", algo, knobs, state_knobs, why)


def new_topk_state(density: float, state_knobs: Mapping[str, Any]) -> TopkState:
    """Return a fresh top-k state at ``density`` with the route's state knobs."""
    return TopkState(density=density, **dict(state_knobs))


def restore_topk_state(d: Mapping[str, Any]) -> TopkState:
    """Return the top-k state ``d`` holds (one entry of a saved state's ``topk``)."""
    st = TopkState(d["k"], d["density"])
    st.load_state_dict(dict(d))
    return st


def topk_bytes_sent(res: Any) -> int:
    """Return the bytes this rank sent in the call that returned ``res`` (0 when it does not say)."""
    traffic = getattr(res, "traffic", None)
    return int(getattr(traffic, "bytes_sent", 0) or 0)


def check_state_dict(d: Any, kind: str) -> None:
    """Raise unless ``d`` is a ``state_dict()`` of the ``kind`` state (``hook`` or ``sync``) of this version."""
    if not isinstance(d, Mapping) or d.get("kind") != kind:
        got = d.get("kind") if isinstance(d, Mapping) else type(d).__name__
        raise ColltuneValueError(
            f"state_dict must be a dict made by the {kind} state's state_dict(), but got {got!r}."
        )
    if d.get("version") != STATE_VERSION:
        raise ColltuneValueError(
            f"state_dict has version {d.get('version')!r}, but this colltune reads version {STATE_VERSION}."
        )
