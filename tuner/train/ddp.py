"""Training integration: a DDP communication hook and a sparse-gradient synchronizer.

Two ways to put colltune under a training loop without changing the loop:

``ddp_model.register_comm_hook(ColltuneHookState(...), colltune_hook)``
    Routes every gradient bucket of a ``DistributedDataParallel`` model
    through colltune: dense allreduce during a warm-up of
    ``start_compression_iter`` steps (as PowerSGD does), then top-k
    compression with error feedback (``allgather`` = TopkA, or ``oktopk``,
    or ``auto``), one :class:`~colltune.algorithms.state.TopkState` per bucket (per
    compressed part of a bucket, keyed by its parameters).
    Parameters a policy pins to ``dense`` (or smaller than
    ``min_compress_numel``) stay dense inside a compressed bucket.

``sync = SparseGradSync(model); sync.attach(optimizer)``
    For models with sparse gradients (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``), which DDP cannot reduce on NCCL at
    all (on gloo it falls back to an allgather of every rank's rows). Before every ``optimizer.step()`` (or when
    :meth:`SparseGradSync.synchronize` is called after backward), each
    sparse gradient goes through :func:`colltune.sparse_allreduce` (``avg``,
    ``auto`` by default) and comes back as a coalesced sparse gradient, so
    ``torch.optim.SGD`` and ``torch.optim.SparseAdam`` work unchanged. Dense
    gradients are averaged by one bucketed allreduce, compressed with top-k
    (``dense="topk"``), or left alone (``dense="skip"``). Parameters inside a
    ``DistributedDataParallel`` submodule are always left to DDP, so the
    common layout, DDP over the dense tower and the embedding outside it,
    needs no option.

Both keep their state (residuals, thresholds, the routing decisions) apart
from the process group, in PowerSGD's style, and round-trip it through
``state_dict()`` / ``load_state_dict()`` for checkpoints.

Routing, per parameter, the same on every rank (checked once with one small
collective; ranks that disagree raise :class:`~colltune.algorithms.errors.RankMismatchError`):

1. ``COLLTUNE_ALGO`` (the environment) overrides everything below.
2. A policy rule (or a policy ``default``) that names an algorithm: ``dense``
   keeps the parameter dense; ``allgather`` / ``oktopk`` compress a dense
   gradient with top-k, or run that exact algorithm on a sparse gradient.
3. Otherwise (``auto``): sparse gradients use the ``algorithm`` argument
   (``auto`` asks the selector); dense gradients follow the ``dense`` mode
   (hook: compress) and compress only from ``min_compress_numel`` elements.

Example (sparse embedding beside DDP over the dense tower)::

    from colltune.train import ddp

    model.mlp = DistributedDataParallel(model.mlp)       # DDP: dense part only
    sync = colltune.train.ddp.SparseGradSync(model)                # the embedding: colltune
    sync.attach(optimizer)                                # before every step()
    for batch in loader:                                  # the loop is unchanged
        loss = model(batch).mean(); loss.backward()
        optimizer.step(); optimizer.zero_grad()

Example (top-k compression of a DDP model)::

    state = colltune.train.ddp.ColltuneHookState(model=ddp_model, density=0.01, start_compression_iter=100)
    ddp_model.register_comm_hook(state, colltune.train.ddp.colltune_hook)
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from colltune import algorithms as _algorithms
from colltune.algorithms.sparse import on_host
from colltune.algorithms.errors import ColltuneTypeError, ColltuneValueError, RankMismatchError
from colltune.algorithms.state import TopkState
from colltune import api as _api
from colltune.model.policy import AUTO, DEFAULT_POLICY, Decision, Overrides, Policy, load_policy, policy_from_env

__all__ = [
    "ColltuneHookState",
    "colltune_hook",
    "SparseGradSync",
    "TensorStats",
    "sparse_parameters",
]

logger = logging.getLogger(__name__)

DenseMode = Literal["allreduce", "topk", "skip"]
TopkAlgorithm = Literal["auto", "allgather", "oktopk"]

_STATE_VERSION = 1
_TOPK_ALGORITHMS: tuple[str, ...] = ("auto", "allgather", "oktopk")
_SPARSE_ALGORITHMS: tuple[str, ...] = ("auto", "dense", "allgather", "oktopk")
_DENSE_MODES: tuple[str, ...] = ("allreduce", "topk", "skip")
# Policy knobs that live in the TopkState rather than in the algorithm.
_STATE_KNOBS: tuple[str, ...] = ("local_refresh", "global_refresh", "boundary_refresh", "peers_in_flight")


# --------------------------------------------------------------------------- shared helpers


def _api_accepts(fn: Callable[..., Any], keyword: str) -> bool:
    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


_SPARSE_KW = {k: _api_accepts(_api.sparse_allreduce, k) for k in ("name", "policy")}
_TOPK_KW = {k: _api_accepts(_api.topk_allreduce, k) for k in ("name", "policy")}


def _call_kwargs(supported: Mapping[str, bool], name: str | None, policy: Any) -> dict[str, Any]:
    """Return the ``name=`` / ``policy=`` keywords the front door of this version accepts."""
    kw: dict[str, Any] = {}
    if supported.get("name") and name is not None:
        kw["name"] = name
    if supported.get("policy") and policy is not None:
        kw["policy"] = policy
    return kw


def _check_int(label: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ColltuneTypeError(f"{label} must be an int >= {minimum}, but got {value!r}.")
    if value < minimum:
        raise ColltuneValueError(f"{label} must be an int >= {minimum}, but got {value}.")
    return value


def _check_density(density: Any) -> float:
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise ColltuneTypeError(f"density must be a float in (0, 1], but got {density!r}.")
    if not 0.0 < float(density) <= 1.0:
        raise ColltuneValueError(f"density must be in (0, 1], e.g. 0.01 for 1% of the entries, but got {density}.")
    return float(density)


def _check_choice(label: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ColltuneValueError(f"{label} must be one of {', '.join(allowed)}, but got {value!r}.")
    return value


def _resolve_policy(policy: Any) -> tuple[Policy, Overrides, Any]:
    """Return ``(policy, overrides, what to pass as policy= to the front door)``.

    ``None`` means what ``auto`` calls use anyway: the process-wide selector's
    policy when the selector exists, else ``COLLTUNE_POLICY`` or no rules.
    """
    try:
        from colltune.select import selector as _selector
    except ImportError:  # an older tree without the selector: read the policy ourselves
        _selector = None  # type: ignore[assignment]
    if _selector is not None and (policy is None or isinstance(policy, (Policy, str, os.PathLike, _selector.Selector))):
        sel = _selector.selector_for(policy)
        return sel.policy, sel.overrides, policy
    env_policy, overrides = policy_from_env()
    if policy is None:
        return env_policy or DEFAULT_POLICY, overrides, None
    if isinstance(policy, Policy):
        return env_policy or policy, overrides, policy
    if isinstance(policy, (str, os.PathLike)):
        return env_policy or load_policy(policy), overrides, policy
    raise ColltuneTypeError(
        f"policy must be a colltune.model.policy.Policy, a path to a policy YAML file, a colltune.Selector or None, "
        f"but got {type(policy).__name__}."
    )


def _unwrapped_names(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Return ``model.named_parameters()`` with the ``module.`` level of every DDP wrapper left out."""
    wrappers = [n for n, m in model.named_modules() if isinstance(m, nn.parallel.DistributedDataParallel)]
    out = []
    for name, param in model.named_parameters():
        for w in sorted(wrappers, key=len, reverse=True):
            prefix = f"{w}.module." if w else "module."
            if name.startswith(prefix):
                name = (f"{w}." if w else "") + name[len(prefix):]
        out.append((name, param))
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.is_available() and dist.is_initialized() and str(dist.get_backend(group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world_size(group: dist.ProcessGroup | None) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def _digest(data: Any) -> int:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big", signed=True)


def _check_same_plan(plan: Any, group: dist.ProcessGroup | None, what: str) -> None:
    """Raise on every rank when ranks routed their tensors differently (they would deadlock otherwise)."""
    if _world_size(group) == 1:
        return
    d = _digest(plan)
    buf = torch.tensor([d, -d], dtype=torch.int64, device=_group_device(group))
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    if int(buf[0]) != -int(buf[1]):
        raise RankMismatchError(
            f"{what}: ranks routed their gradients differently (different policies, COLLTUNE_ALGO, options "
            f"or models); this rank's plan is {json.dumps(plan)[:500]}. Give every rank the same model, "
            "options, policy file and environment."
        )


def _ring_bytes(numel: int, itemsize: int, world_size: int) -> int:
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
class _Route:
    route: str  # "sparse" | "topk" | "dense"
    algorithm: str  # the algorithm passed to the front door (or "dense")
    knobs: Mapping[str, Any] = field(default_factory=dict)
    state_knobs: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""

    def plan(self) -> list[Any]:
        return [self.route, self.algorithm, sorted(self.knobs.items()), sorted(self.state_knobs.items())]


def _split_knobs(decision: Decision, algorithm: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a decision's knobs for ``algorithm`` into algorithm knobs and TopkState knobs."""
    if algorithm in (AUTO, "dense"):
        return {}, {}
    given = decision.knobs_for(algorithm)
    accepted = getattr(_algorithms.get(algorithm), "knobs", {})
    algo = {k: v for k, v in given.items() if k in accepted}
    state = {k: v for k, v in given.items() if k in _STATE_KNOBS and k not in accepted}
    return algo, state


def _route_for(
    decision: Decision,
    overrides: Overrides,
    *,
    sparse: bool,
    numel: int,
    default_sparse: str,
    dense_mode: str,
    topk_algorithm: str,
    min_compress_numel: int,
) -> _Route:
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
        return _Route("sparse", algo, knobs, state_knobs, why)
    # Dense gradient: dense allreduce or top-k compression.
    if dense_mode == "skip":
        return _Route("skip", "none", reason="dense='skip': left to DDP or the caller")
    if pinned == "dense" or (forced is not None and forced.algorithm == "dense"):
        return _Route("dense", "dense", reason=(forced or decision).reason)
    if pinned is not None:
        compress, algo, why = True, pinned, decision.reason
    elif dense_mode == "topk" and numel >= min_compress_numel:
        compress, algo, why = True, topk_algorithm, f"dense='topk', numel {numel} >= min_compress_numel"
    elif dense_mode == "topk":
        compress, algo, why = False, "dense", f"numel {numel} < min_compress_numel {min_compress_numel}"
    else:
        compress, algo, why = False, "dense", "dense='allreduce'"
    if not compress:
        return _Route("dense", "dense", reason=why)
    if forced is not None and forced.algorithm != AUTO:
        algo, why = forced.algorithm, forced.reason
    knobs, state_knobs = _split_knobs(decision, algo)
    return _Route("topk", algo, knobs, state_knobs, why)


def _new_topk_state(density: float, state_knobs: Mapping[str, Any]) -> TopkState:
    return TopkState(density=density, **dict(state_knobs))


def _restore_topk(d: Mapping[str, Any]) -> TopkState:
    st = TopkState(d["k"], d["density"])
    st.load_state_dict(dict(d))
    return st


def _topk_traffic(res: Any) -> int:
    traffic = getattr(res, "traffic", None)
    return int(getattr(traffic, "bytes_sent", 0) or 0)


# --------------------------------------------------------------------------- DDP communication hook


class ColltuneHookState:
    """State of :func:`colltune_hook`: options, per-bucket residuals and thresholds, decisions.

    Kept apart from the hook, as ``PowerSGDState`` is: ``__slots__``, options
    validated here, and ``__getstate__`` without the process group (a state
    unpickled elsewhere uses the default group; call :meth:`bind` to give it
    the model's parameter names again).

    The compressed part of a bucket is keyed by the names of its parameters
    (the bucket's identity, whatever ``bucket.index()`` it has) and laid out
    in the model's parameter order, so that the same parameters give the same
    state and the same bits whichever layout DDP uses. DDP rebuilds its
    buckets after the first iteration (and again in a run resumed from a
    checkpoint): a bucket whose parameters changed gets a fresh state whose
    residual is assembled, parameter by parameter, from the states that held
    them (nothing already accumulated is lost); states no bucket used in a
    compressing step are dropped at its end.

    Args:
        process_group: the group DDP reduces over; ``None`` for the default group.
        model: the DDP model (or its module), for parameter names: policy
            rules match them and checkpoints key states by them. Without it,
            parameters are named by bucket and shape (``bucket0.3[512x256]``),
            and a bucket that DDP rebuilds starts with a fresh residual.
        density: fraction of each compressed bucket part every rank sends.
        start_compression_iter: plain dense allreduce for this many steps
            first (residuals would otherwise start from noisy early gradients).
        min_compress_numel: parameters with fewer elements stay dense.
        algorithm: top-k algorithm where the policy says ``auto``:
            ``auto`` (the selector decides), ``allgather`` (TopkA) or ``oktopk``.
        policy: a :class:`~colltune.model.policy.Policy`, a policy file path, a
            :class:`colltune.Selector`, or ``None`` for the process-wide one.
        topk_options: extra :class:`~colltune.algorithms.state.TopkState` options
            (``local_refresh``, ``band``, ...), applied to every bucket.

    Raises:
        ColltuneTypeError, ColltuneValueError: an option is invalid.

    Example:
        >>> state = ColltuneHookState(model=ddp_model, density=0.01, start_compression_iter=100)  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, colltune_hook)  # doctest: +SKIP
    """

    __slots__ = (
        "process_group",
        "density",
        "start_compression_iter",
        "min_compress_numel",
        "algorithm",
        "policy",
        "topk_options",
        "iter",
        "topk_states",
        "decisions",
        "stats",
        "bytes_sent",
        "_names",
        "_order",
        "_numels",
        "_policy",
        "_overrides",
        "_policy_arg",
        "_used",
        "_checked",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        model: nn.Module | None = None,
        density: float = 0.01,
        start_compression_iter: int = 10,
        min_compress_numel: int = 1024,
        algorithm: TopkAlgorithm = "auto",
        policy: Any = None,
        topk_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.process_group = process_group
        self.density = _check_density(density)
        self.start_compression_iter = _check_int("start_compression_iter", start_compression_iter, 0)
        self.min_compress_numel = _check_int("min_compress_numel", min_compress_numel, 1)
        self.algorithm = _check_choice("algorithm", algorithm, _TOPK_ALGORITHMS)
        if model is not None and not isinstance(model, nn.Module):
            raise ColltuneTypeError(f"model must be a torch.nn.Module (or DDP model) or None, but got {type(model).__name__}.")
        self.topk_options = dict(topk_options or {})
        TopkState(density=self.density, **self.topk_options)  # validate the options now, not in the hook
        self.policy = policy
        self._policy: Policy | None = None
        self._overrides: Overrides | None = None
        self._policy_arg: Any = None
        self.iter = 0
        self.topk_states: dict[str, TopkState] = {}
        self.decisions: dict[str, dict[str, Any]] = {}
        self.stats: dict[str, TensorStats] = {}
        self.bytes_sent = 0
        self._names: dict[int, str] = {}
        self._order: dict[int, int] = {}
        self._numels: dict[str, int] = {}
        self._used: set[str] = set()
        self._checked: set[str] = set()
        if model is not None:
            self.bind(model)

    def bind(self, model: nn.Module) -> None:
        """Learn the parameter names of ``model``: the DDP model, its module, or a model holding DDP submodules.

        Names are those of the unwrapped model (DDP's ``module.`` level left out),
        so a policy rule written for ``mlp.0.weight`` matches however DDP wraps it.
        """
        named = _unwrapped_names(model)
        self._names = {id(p): n for n, p in named}
        self._order = {id(p): i for i, (_, p) in enumerate(named)}
        self._numels = {n: p.numel() for n, p in named}

    # -- policy
    def _routing(self) -> tuple[Policy, Overrides, Any]:
        if self._policy is None:
            self._policy, self._overrides, self._policy_arg = _resolve_policy(self.policy)
        return self._policy, self._overrides, self._policy_arg  # type: ignore[return-value]

    def _name(self, p: torch.Tensor, bucket_index: int, position: int) -> str:
        name = self._names.get(id(p))
        if name is not None:
            return name
        # Without the model: unique within the bucket; such states do not follow a rebuilt bucket.
        return f"bucket{bucket_index}.{position}[" + "x".join(str(s) for s in p.shape) + "]"

    # -- iteration
    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count one step once the last bucket of the step has been handled."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_compression_iter and self.start_compression_iter > 0:
                logger.info("colltune hook: warm-up of %d dense steps done; compression starts", self.iter)

    @property
    def compressing(self) -> bool:
        """Whether the warm-up is over."""
        return self.iter >= self.start_compression_iter

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return options, step, residuals, thresholds and decisions as plain data and tensors (no process group)."""
        policy, _, _ = self._routing()
        return {
            "version": _STATE_VERSION,
            "kind": "hook",
            "density": self.density,
            "start_compression_iter": self.start_compression_iter,
            "min_compress_numel": self.min_compress_numel,
            "algorithm": self.algorithm,
            "topk_options": dict(self.topk_options),
            "iter": self.iter,
            "topk": {k: st.state_dict() for k, st in self.topk_states.items()},
            "decisions": {k: dict(v) for k, v in self.decisions.items()},
            "policy_digest": policy.digest,
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (options included).

        Raises:
            ColltuneValueError: ``d`` is not a hook state of a known version.
        """
        _check_state_dict(d, "hook")
        self.density = _check_density(d["density"])
        self.start_compression_iter = _check_int("start_compression_iter", d["start_compression_iter"], 0)
        self.min_compress_numel = _check_int("min_compress_numel", d["min_compress_numel"], 1)
        self.algorithm = _check_choice("algorithm", d["algorithm"], _TOPK_ALGORITHMS)
        self.topk_options = dict(d["topk_options"])
        self.iter = int(d["iter"])
        self.topk_states = {k: _restore_topk(v) for k, v in d["topk"].items()}
        policy, _, _ = self._routing()
        # Decisions follow the policy: a checkpoint taken under another policy is decided again.
        self.decisions = {k: dict(v) for k, v in d["decisions"].items()} if d["policy_digest"] == policy.digest else {}
        self._used = set()
        self._checked = set()

    def __getstate__(self) -> dict[str, Any]:
        out = self.state_dict()
        out["policy_arg"] = self.policy if isinstance(self.policy, (str, os.PathLike, Policy)) else None
        return out

    def __setstate__(self, d: dict[str, Any]) -> None:
        ColltuneHookState.__init__(self, None, policy=d.get("policy_arg"))
        self.load_state_dict(d)

    def __repr__(self) -> str:
        return (
            f"ColltuneHookState(density={self.density}, start_compression_iter={self.start_compression_iter}, "
            f"algorithm={self.algorithm!r}, iter={self.iter}, buckets={len(self.topk_states)})"
        )


def _check_state_dict(d: Any, kind: str) -> None:
    if not isinstance(d, Mapping) or d.get("kind") != kind:
        got = d.get("kind") if isinstance(d, Mapping) else type(d).__name__
        raise ColltuneValueError(
            f"state_dict must be a dict made by the {kind} state's state_dict(), but got {got!r}."
        )
    if d.get("version") != _STATE_VERSION:
        raise ColltuneValueError(
            f"state_dict has version {d.get('version')!r}, but this colltune reads version {_STATE_VERSION}."
        )


def _bucket_routes(state: ColltuneHookState, params: list[torch.Tensor], idx: int) -> list[tuple[str, _Route]]:
    policy, overrides, _ = state._routing()
    p = _world_size(state.process_group)
    out = []
    for position, param in enumerate(params):
        name = state._name(param, idx, position)
        decision = policy.match(name, param.numel(), state.density, p, None, _dtype_name(param.dtype))
        route = _route_for(
            decision,
            overrides,
            sparse=False,
            numel=param.numel(),
            default_sparse=AUTO,
            dense_mode="topk",
            topk_algorithm=state.algorithm,
            min_compress_numel=state.min_compress_numel,
        )
        out.append((name, route))
    return out


def _hook_topk_state(state: ColltuneHookState, key: str, names: list[str], numel: int, route: _Route) -> TopkState:
    """Return the TopkState of one compressed part, made (and its residual migrated) when new."""
    ts = state.topk_states.get(key)
    if ts is not None and (ts.residual is None or ts.residual.numel() == numel):
        return ts
    ts = state.topk_states[key] = _new_topk_state(state.density, {**state.topk_options, **dict(route.state_knobs)})
    # The bucket layout changed (DDP rebuilt its buckets): take each parameter's residual from the state that held it.
    wanted = set(names)
    pieces: dict[str, torch.Tensor] = {}
    for other_key, other in state.topk_states.items():
        if other is ts or other.residual is None:
            continue
        other_names = other_key.split("|")
        if not wanted.intersection(other_names) or any(n not in state._numels for n in other_names):
            continue
        sizes = [state._numels[n] for n in other_names]
        if sum(sizes) != other.residual.numel():
            continue
        for n, piece in zip(other_names, torch.split(other.residual, sizes)):
            if n in wanted:
                pieces[n] = piece
    if pieces and all(n in state._numels for n in names):
        ref = next(iter(pieces.values()))
        ts.residual = torch.cat([pieces[n] if n in pieces else ref.new_zeros(state._numels[n]) for n in names])
        logger.debug("colltune hook: bucket part %s assembled its residual from %d parameters", key, len(pieces))
    return ts


def colltune_hook(state: ColltuneHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP gradient bucket through colltune; return a Future of a tensor shaped like the bucket.

    During the warm-up (``state.iter < state.start_compression_iter``) the
    bucket is averaged by an asynchronous dense allreduce, as DDP's default
    hook does. Afterwards each parameter of the bucket is routed (policy,
    size): the dense parts are averaged together in one allreduce, and the
    compressed parts, concatenated in the model's parameter order, go
    through :func:`colltune.topk_allreduce` with their
    :class:`~colltune.algorithms.state.TopkState` (what is not sent stays in its
    residual). DDP hands over gradients that are not pre-divided: they are
    averaged here (``avg``).

    Args:
        state: the hook's :class:`ColltuneHookState`.
        bucket: the bucket DDP hands over.

    Returns:
        A ``torch.futures.Future`` holding a tensor of ``bucket.buffer()``'s
        shape and dtype: the averaged (or top-k averaged) gradients.
    """
    buffer = bucket.buffer()
    group = state.process_group
    p = _world_size(group)
    idx = bucket.index()

    if not state.compressing or p == 1:
        stats = state.stats.setdefault(f"bucket{idx}", TensorStats("dense", "dense"))
        stats.reason = "warm-up" if not state.compressing else "single rank"
        nbytes = _ring_bytes(buffer.numel(), buffer.element_size(), p)
        stats.record("dense", nbytes)
        state.bytes_sent += nbytes
        state.maybe_increase_iter(bucket)
        if p == 1:
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(buffer)
            return fut
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda f: f.value()[0].div_(p))

    params = list(bucket.parameters())
    routes = _bucket_routes(state, params, idx)
    # Slices of the flat bucket, in bucket order; parts are processed in the model's order.
    slices: list[tuple[int, int]] = []
    offset = 0
    for param in params:
        slices.append((offset, offset + param.numel()))
        offset += param.numel()
    order = sorted(range(len(params)), key=lambda i: (state._order.get(id(params[i]), len(state._order)), i))
    dense_parts = [i for i in order if routes[i][1].route == "dense"]
    groups: dict[tuple, list[int]] = {}
    for i in order:
        r = routes[i][1]
        if r.route == "topk":
            groups.setdefault((r.algorithm, tuple(sorted(r.knobs.items())), tuple(sorted(r.state_knobs.items()))), []).append(i)
    plan_key = "|".join(routes[i][0] for i in order)
    if plan_key not in state._checked:
        _check_same_plan([plan_key, [routes[i][1].plan() for i in order]], group, f"colltune_hook (bucket {idx})")
        state._checked.add(plan_key)
    for name, r in routes:
        state.decisions[name] = {"route": r.route, "algorithm": r.algorithm, "reason": r.reason}

    def gather(members: list[int]) -> torch.Tensor:
        if len(members) == 1:
            a, b = slices[members[0]]
            return buffer[a:b]
        return torch.cat([buffer[slices[i][0] : slices[i][1]] for i in members])

    def scatter(members: list[int], flat: torch.Tensor) -> None:
        pos = 0
        for i in members:
            a, b = slices[i]
            out[a:b] = flat[pos : pos + b - a]
            pos += b - a

    out = torch.empty_like(buffer)
    if dense_parts:
        flat = gather(dense_parts).clone()
        dist.all_reduce(flat, group=group)
        scatter(dense_parts, flat.div_(p))
        nbytes = _ring_bytes(flat.numel(), flat.element_size(), p)
        stats = state.stats.setdefault(f"bucket{idx}/dense", TensorStats("dense", "dense"))
        stats.reason = "kept dense: " + "; ".join(sorted({routes[i][1].reason for i in dense_parts}))
        stats.record("dense", nbytes)
        state.bytes_sent += nbytes

    policy_arg = state._routing()[2]
    for (algo, knobs, _), members in groups.items():
        names = [routes[i][0] for i in members]
        key = "|".join(names)
        flat = gather(members)
        ts = _hook_topk_state(state, key, names, flat.numel(), routes[members[0]][1])
        state._used.add(key)
        res: Any = _api.topk_allreduce(
            flat,
            ts,
            op="avg",
            group=group,
            algorithm=algo,
            knobs=dict(knobs) or None,
            **_call_kwargs(_TOPK_KW, key if algo == AUTO else None, policy_arg if algo == AUTO else None),
        )
        scatter(members, res.to_dense().view(-1))
        nbytes = _topk_traffic(res)
        stats = state.stats.setdefault(key, TensorStats("topk", res.algorithm, routes[members[0]][1].reason))
        stats.record(res.algorithm, nbytes)
        state.bytes_sent += nbytes

    if bucket.is_last():
        for key in [k for k in state.topk_states if k not in state._used]:
            del state.topk_states[key]  # its parameters moved to other buckets (residuals already taken)
        state._used = set()
    state.maybe_increase_iter(bucket)
    fut = torch.futures.Future()
    fut.set_result(out)
    return fut


# DDP checks the hook's annotations against the real classes; postponed evaluation
# (``from __future__ import annotations``) would leave strings there.
colltune_hook.__annotations__.update(state=ColltuneHookState, bucket=dist.GradBucket)
colltune_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


# --------------------------------------------------------------------------- sparse-gradient synchronizer


def sparse_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Return the parameters of ``model`` whose gradients are sparse (``Embedding``/``EmbeddingBag`` with ``sparse=True``)."""
    out: dict[str, nn.Parameter] = {}
    for mname, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            weight: nn.Parameter = module.weight  # type: ignore[assignment]
            out[f"{mname}.weight" if mname else "weight"] = weight
    return out


def _coalesce_rows(idx: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the rows of duplicate indices (an embedding's gradient has one row per lookup).

    On the device path the front door's coalesce permutes the values before
    summing; this way skips that (one ``index_add_`` in lookup order, the
    same sums as a stable sort), which matters when lookups outnumber
    distinct rows several times over. On the host path
    (:func:`~colltune.algorithms.sparse.on_host`) the front door already sums in
    lookup order without permuting, so the rows are left to it, as 16-bit
    values are (summed in fp32 there).
    """
    if vals.dtype not in (torch.float32, torch.float64) or idx.numel() < 2 or on_host(idx):
        return idx, vals
    uniq, inverse = torch.unique(idx, sorted=True, return_inverse=True)
    if uniq.numel() == idx.numel():
        return idx, vals  # no duplicates: the front door only sorts
    out = torch.zeros((uniq.numel(), *vals.shape[1:]), dtype=vals.dtype, device=vals.device)
    out.index_add_(0, inverse, vals)
    return uniq, out


def _ddp_owned(model: nn.Module) -> set[int]:
    owned: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.parallel.DistributedDataParallel):
            owned.update(id(p) for p in module.parameters())
    return owned


class SparseGradSync:
    """Average the gradients of a model after backward, sparse ones through colltune's sparse allreduce.

    One call turns it on: :meth:`attach` (before every ``optimizer.step()``)
    or :meth:`attach_to_backward` (at the end of every backward); or call
    :meth:`synchronize` yourself after backward.

    What each gradient goes through (see the module docstring for the precedence):

    * sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``):
      :func:`colltune.sparse_allreduce` with ``op="avg"``, exact; the result
      is put back as a coalesced sparse gradient. Works on gloo and NCCL.
    * dense gradients: ``dense="allreduce"`` averages them in one bucketed
      allreduce; ``dense="topk"`` compresses those with at least
      ``min_compress_numel`` elements with top-k and error feedback (after
      ``start_compression_iter`` dense steps); ``dense="skip"`` leaves them
      alone (DDP or the caller reduces them).
    * parameters of a ``DistributedDataParallel`` submodule: left to DDP.

    A gradient that is ``None`` on some ranks counts as zero there; if it is
    ``None`` on every rank it stays ``None`` (and so does a sparse gradient
    whose reduced result is empty), identically on every rank.

    Args:
        model: the model (not wrapped in DDP as a whole).
        group: the process group; ``None`` for the default group.
        algorithm: for sparse gradients where the policy says ``auto``:
            ``auto`` (the selector decides), ``dense``, ``allgather`` or ``oktopk``.
        dense: ``allreduce``, ``topk`` or ``skip`` (see above).
        density: for top-k: fraction of entries each rank sends per step.
        start_compression_iter: for top-k: dense steps before compression starts.
        min_compress_numel: for top-k: smaller parameters stay dense.
        topk_algorithm: for top-k where the policy says ``auto``:
            ``auto``, ``allgather`` (TopkA) or ``oktopk``.
        policy: a :class:`~colltune.model.policy.Policy`, a policy file path, a
            :class:`colltune.Selector`, or ``None`` for the process-wide one.
        bucket_cap_mb: dense gradients are allreduced in buckets of about this size.
        topk_options: extra :class:`~colltune.algorithms.state.TopkState` options.

    Raises:
        ColltuneTypeError, ColltuneValueError: an option is invalid, or
            ``model`` is wrapped in DDP as a whole.

    Example:
        >>> sync = SparseGradSync(model)             # doctest: +SKIP
        >>> sync.attach(optimizer)                   # doctest: +SKIP
        >>> loss.backward(); optimizer.step()        # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        algorithm: str = "auto",
        dense: DenseMode = "allreduce",
        density: float = 0.01,
        start_compression_iter: int = 10,
        min_compress_numel: int = 1024,
        topk_algorithm: TopkAlgorithm = "auto",
        policy: Any = None,
        bucket_cap_mb: float = 25.0,
        topk_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ColltuneTypeError(f"model must be a torch.nn.Module, but got {type(model).__name__}.")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ColltuneValueError(
                "model is wrapped in DistributedDataParallel as a whole, so DDP already reduces every gradient "
                "(and cannot reduce sparse ones on NCCL); pass the unwrapped model, or wrap only the dense "
                "part in DDP (e.g. model.mlp = DistributedDataParallel(model.mlp)) and pass the whole model."
            )
        self.model = model
        self.group = group
        self.algorithm = _check_choice("algorithm", algorithm, _SPARSE_ALGORITHMS)
        self.dense = _check_choice("dense", dense, _DENSE_MODES)
        self.density = _check_density(density)
        self.start_compression_iter = _check_int("start_compression_iter", start_compression_iter, 0)
        self.min_compress_numel = _check_int("min_compress_numel", min_compress_numel, 1)
        self.topk_algorithm = _check_choice("topk_algorithm", topk_algorithm, _TOPK_ALGORITHMS)
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ColltuneValueError(f"bucket_cap_mb must be a number > 0, but got {bucket_cap_mb!r}.")
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.topk_options = dict(topk_options or {})
        TopkState(density=self.density, **self.topk_options)  # validate now
        self.policy = policy
        self.step = 0
        self.topk_states: dict[str, TopkState] = {}
        self.decisions: dict[str, dict[str, Any]] = {}
        self.stats: dict[str, TensorStats] = {}
        self.bytes_sent = 0
        self.last_bytes = 0
        owned = _ddp_owned(model)
        sparse_ids = {id(p) for p in sparse_parameters(model).values()}
        seen: set[int] = set()
        self._params: list[tuple[str, nn.Parameter, bool]] = []
        for name, param in model.named_parameters():
            if id(param) in seen or id(param) in owned or not param.requires_grad:
                continue
            seen.add(id(param))
            self._params.append((name, param, id(param) in sparse_ids))
        self._routes: dict[str, _Route] | None = None
        self._routes_compressing: bool | None = None
        self._routes_checked = False
        self._policy_arg: Any = None
        self._synced = False
        self._handles: list[Any] = []
        self._queued = False

    # -- routing
    @property
    def compressing(self) -> bool:
        """Whether top-k compression is on (the warm-up is over)."""
        return self.step >= self.start_compression_iter

    def _compute_routes(self) -> dict[str, _Route]:
        """Route every tracked parameter for the current step (local: no communication)."""
        compressing = self.compressing
        if self._routes is not None and self._routes_compressing == compressing:
            return self._routes
        policy, overrides, self._policy_arg = _resolve_policy(self.policy)
        p = _world_size(self.group)
        routes: dict[str, _Route] = {}
        for name, param, sparse in self._params:
            density = None if sparse else self.density
            decision = policy.match(name, param.numel(), density, p, None, _dtype_name(param.dtype))
            route = _route_for(
                decision,
                overrides,
                sparse=sparse,
                numel=param.numel(),
                default_sparse=self.algorithm,
                dense_mode=self.dense,
                topk_algorithm=self.topk_algorithm,
                min_compress_numel=self.min_compress_numel,
            )
            if route.route == "topk" and not compressing:
                route = _Route("dense", "dense", reason=f"warm-up ({self.step} of {self.start_compression_iter} dense steps)")
            routes[name] = route
        self.decisions = {
            n: {"route": r.route, "algorithm": r.algorithm, "reason": r.reason, "policy_digest": policy.digest}
            for n, r in routes.items()
        }
        for n, r in routes.items():
            logger.debug("SparseGradSync: %s -> %s %s (%s)", n, r.route, r.algorithm, r.reason)
        self._routes, self._routes_compressing, self._routes_checked = routes, compressing, False
        return routes

    def _plan(self) -> dict[str, _Route]:
        routes = self._compute_routes()
        if not self._routes_checked:
            _check_same_plan([[n, r.plan()] for n, r in routes.items()], self.group, "SparseGradSync")
            self._routes_checked = True
        return routes

    def routes(self) -> dict[str, tuple[str, str]]:
        """Return ``{parameter name: (route, algorithm)}`` for the current step (no communication)."""
        return {n: (r.route, r.algorithm) for n, r in self._compute_routes().items()}

    # -- the synchronization
    @torch.no_grad()
    def synchronize(self) -> None:
        """Average every tracked gradient over the group, in place; call after backward on every rank.

        Raises:
            RankMismatchError: ranks routed their gradients differently.
            ColltuneValueError: a sparse gradient is not COO over its first dimension.
        """
        routes = self._plan()
        p = _world_size(self.group)
        step_bytes = 0
        dense_items: list[tuple[str, nn.Parameter]] = []
        for name, param, sparse in self._params:
            route = routes[name]
            if route.route == "skip":
                continue
            if route.route == "dense":
                dense_items.append((name, param))
            elif route.route == "sparse":
                step_bytes += self._sync_sparse(name, param, route)
            else:
                step_bytes += self._sync_topk(name, param, route)
        step_bytes += self._sync_dense(dense_items, p)
        self.step += 1
        self.last_bytes = step_bytes
        self.bytes_sent += step_bytes
        self._synced = True

    def _sync_sparse(self, name: str, param: nn.Parameter, route: _Route) -> int:
        grad = param.grad
        row_shape = tuple(param.shape[1:])
        if grad is None:
            idx = torch.empty(0, dtype=torch.int64, device=param.device)
            vals = torch.empty((0, *row_shape), dtype=param.dtype, device=param.device)
        elif grad.is_sparse:
            if grad.sparse_dim() != 1:
                raise ColltuneValueError(
                    f"the sparse gradient of {name} has {grad.sparse_dim()} sparse dimensions, but colltune "
                    "reduces COO tensors over the first dimension only (as nn.Embedding produces)."
                )
            if grad.is_coalesced():
                idx, vals = grad.indices()[0], grad.values()
            else:
                idx, vals = _coalesce_rows(grad._indices()[0], grad._values())
        else:  # a dense gradient on an embedding (e.g. sparse switched off): send its nonzero rows
            rows = grad.reshape(grad.shape[0], -1).ne(0).any(dim=1).nonzero().view(-1)
            idx, vals = rows, grad.index_select(0, rows)
        res: Any = _api.sparse_allreduce(
            idx,
            vals,
            tuple(param.shape),
            op="avg",
            group=self.group,
            algorithm=route.algorithm,
            knobs=dict(route.knobs) or None,
            **_call_kwargs(_SPARSE_KW, name, self._policy_arg if route.algorithm == AUTO else None),
        )
        if grad is not None and not grad.is_sparse:
            grad.copy_(res.to_dense())  # the caller keeps a dense gradient dense
        elif res.indices.numel() == 0:
            param.grad = None
        else:
            param.grad = res.to_sparse_coo()
        nbytes = _topk_traffic(res)
        self.stats.setdefault(name, TensorStats("sparse", res.algorithm, route.reason)).record(res.algorithm, nbytes)
        return nbytes

    def _sync_topk(self, name: str, param: nn.Parameter, route: _Route) -> int:
        grad = param.grad
        if grad is None:
            grad = param.grad = torch.zeros_like(param)
        if grad.is_sparse:
            grad = param.grad = grad.to_dense()
        st = self.topk_states.get(name)
        if st is None or (st.residual is not None and st.residual.numel() != grad.numel()):
            st = self.topk_states[name] = _new_topk_state(self.density, {**self.topk_options, **dict(route.state_knobs)})
        res: Any = _api.topk_allreduce(
            grad,
            st,
            op="avg",
            group=self.group,
            algorithm=route.algorithm,
            knobs=dict(route.knobs) or None,
            **_call_kwargs(_TOPK_KW, name, self._policy_arg if route.algorithm == AUTO else None),
        )
        grad.copy_(res.to_dense())
        nbytes = _topk_traffic(res)
        self.stats.setdefault(name, TensorStats("topk", res.algorithm, route.reason)).record(res.algorithm, nbytes)
        return nbytes

    def _sync_dense(self, items: list[tuple[str, nn.Parameter]], p: int) -> int:
        if not items or p == 1:
            for name, _ in items:
                self.stats.setdefault(name, TensorStats("dense", "dense", "allreduce")).record("dense", 0)
            return 0
        total = 0
        # Buckets of one dtype and device, about bucket_cap_mb each; one flag per parameter
        # rides along, so a gradient that is None on every rank stays None everywhere.
        cap = int(self.bucket_cap_mb * 2**20)
        buckets: list[list[tuple[str, nn.Parameter]]] = []
        size = 0
        for item in items:
            param = item[1]
            nbytes = param.numel() * param.element_size()
            last = buckets[-1] if buckets else None
            if last is None or size + nbytes > cap or last[0][1].dtype != param.dtype or last[0][1].device != param.device:
                buckets.append([item])
                size = nbytes
            else:
                last.append(item)
                size += nbytes
        for bucket in buckets:
            ref = bucket[0][1]
            numel = sum(param.numel() for _, param in bucket)
            flat = torch.zeros(numel + len(bucket), dtype=ref.dtype, device=ref.device)
            pos = 0
            for i, (_, param) in enumerate(bucket):
                g = param.grad
                if g is not None:
                    flat[pos : pos + param.numel()] = (g.to_dense() if g.is_sparse else g).reshape(-1)
                    flat[numel + i] = 1
                pos += param.numel()
            dist.all_reduce(flat, group=self.group)
            flat[:numel].div_(p)
            nbytes = _ring_bytes(flat.numel(), flat.element_size(), p)
            total += nbytes
            pos = 0
            for i, (name, param) in enumerate(bucket):
                n = param.numel()
                if flat[numel + i] > 0:
                    view = flat[pos : pos + n].view_as(param)
                    if param.grad is None or param.grad.is_sparse:
                        param.grad = view.clone()
                    else:
                        param.grad.copy_(view)
                pos += n
                share = nbytes * n // max(1, numel)
                self.stats.setdefault(name, TensorStats("dense", "dense", "allreduce")).record("dense", share)
        return total

    # -- turning it on
    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Synchronize before every ``optimizer.step()`` (unless :meth:`synchronize` already ran since the last step).

        Returns:
            A handle whose ``remove()`` detaches the synchronizer again.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ColltuneTypeError(f"optimizer must be a torch.optim.Optimizer, but got {type(optimizer).__name__}.")

        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            if not self._synced:
                self.synchronize()

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            self._synced = False

        handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
        self._handles.extend(handles)
        return _Handles(handles)

    def attach_to_backward(self) -> Any:
        """Synchronize at the end of every backward pass (no gradient accumulation across backwards).

        Every rank must produce a gradient for at least one tracked parameter
        in each backward, or the ranks that did would wait for the others.

        Returns:
            A handle whose ``remove()`` detaches the synchronizer again.
        """
        from torch.autograd import Variable

        def done() -> None:
            self._queued = False
            self.synchronize()

        def hook(param: torch.Tensor) -> None:
            if not self._queued:
                self._queued = True
                Variable._execution_engine.queue_callback(done)

        handles = [param.register_post_accumulate_grad_hook(hook) for _, param, _ in self._params]
        self._handles.extend(handles)
        return _Handles(handles)

    def detach(self) -> None:
        """Remove every hook :meth:`attach` and :meth:`attach_to_backward` installed."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return options, step, residuals, thresholds and decisions as plain data and tensors (no process group)."""
        return {
            "version": _STATE_VERSION,
            "kind": "sync",
            "step": self.step,
            "algorithm": self.algorithm,
            "dense": self.dense,
            "density": self.density,
            "start_compression_iter": self.start_compression_iter,
            "min_compress_numel": self.min_compress_numel,
            "topk_algorithm": self.topk_algorithm,
            "topk_options": dict(self.topk_options),
            "topk": {k: st.state_dict() for k, st in self.topk_states.items()},
            "decisions": {k: dict(v) for k, v in self.decisions.items()},
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (options included); routing is decided again on the next step.

        Raises:
            ColltuneValueError: ``d`` is not a synchronizer state of a known
                version, or names a compressed parameter this model lacks.
        """
        _check_state_dict(d, "sync")
        names = {n for n, _, _ in self._params}
        unknown = sorted(set(d["topk"]) - names)
        if unknown:
            raise ColltuneValueError(
                f"state_dict holds top-k state for parameters {unknown[:5]} that this synchronizer does not "
                "track; load it into a synchronizer built on the same model."
            )
        self.step = int(d["step"])
        self.algorithm = _check_choice("algorithm", d["algorithm"], _SPARSE_ALGORITHMS)
        self.dense = _check_choice("dense", d["dense"], _DENSE_MODES)
        self.density = _check_density(d["density"])
        self.start_compression_iter = _check_int("start_compression_iter", d["start_compression_iter"], 0)
        self.min_compress_numel = _check_int("min_compress_numel", d["min_compress_numel"], 1)
        self.topk_algorithm = _check_choice("topk_algorithm", d["topk_algorithm"], _TOPK_ALGORITHMS)
        self.topk_options = dict(d["topk_options"])
        self.topk_states = {k: _restore_topk(v) for k, v in d["topk"].items()}
        self.decisions = {k: dict(v) for k, v in d["decisions"].items()}
        self._routes = None
        self._synced = False

    def summary(self) -> list[dict[str, Any]]:
        """Return one row per tensor: name, route, algorithm, last and total bytes sent, and why."""
        return [
            {
                "tensor": name,
                "route": s.route,
                "algorithm": s.algorithm,
                "last_bytes": s.last_bytes,
                "bytes_sent": s.bytes_sent,
                "reason": s.reason,
            }
            for name, s in self.stats.items()
        ]

    def __repr__(self) -> str:
        sparse = sum(1 for _, _, s in self._params if s)
        return (
            f"SparseGradSync(sparse={sparse}, dense={len(self._params) - sparse} ({self.dense}), "
            f"algorithm={self.algorithm!r}, step={self.step})"
        )


class _Handles:
    """Removes a group of hooks at once."""

    __slots__ = ("_handles",)

    def __init__(self, handles: Iterable[Any]) -> None:
        self._handles = list(handles)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
