"""The DDP communication hook: top-k compression of gradient buckets through colltune.

``ddp_model.register_comm_hook(ColltuneHookState(...), colltune_hook)``
routes every gradient bucket of a ``DistributedDataParallel`` model through
colltune: dense allreduce during a warm-up of ``start_compression_iter``
steps (as PowerSGD does), then top-k compression with error feedback
(``allgather`` = TopkA, or ``oktopk``, or ``auto``), one
:class:`~colltune.algorithms.state.TopkState` per bucket (per compressed part
of a bucket, keyed by its parameters). Parameters a policy pins to
``dense`` (or smaller than ``min_compress_numel``) stay dense inside a
compressed bucket. Routing: :mod:`colltune.train.common`.

Example::

    state = colltune.train.ColltuneHookState(model=ddp_model, density=0.01, start_compression_iter=100)
    ddp_model.register_comm_hook(state, colltune.train.colltune_hook)
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from colltune import api as _api
from colltune.algorithms.errors import ColltuneTypeError
from colltune.algorithms.meta import dtype_name
from colltune.algorithms.state import TopkState
from colltune.model.policy import AUTO, Overrides, Policy
from colltune.train.common import (
    STATE_VERSION,
    Route,
    TensorStats,
    TopkAlgorithm,
    all_reduce_queued,
    backend_name,
    check_choice,
    check_density,
    check_int,
    check_same_plan,
    check_state_dict,
    group_size,
    new_topk_state,
    resolve_policy,
    restore_topk_state,
    ring_bytes,
    route_for,
    topk_algorithms,
    topk_bytes_sent,
)

__all__ = ["ColltuneHookState", "colltune_hook"]

logger = logging.getLogger(__name__)

#: Guards the hook state's counters, which the Futures' callbacks update from colltune's worker thread.
_STATS_LOCK = threading.Lock()


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
            The DDP model itself also tells the hook whether DDP issues a
            collective of its own after the last bucket (it does with
            ``find_unused_parameters=True``, unless ``static_graph``): then,
            or when no DDP model is known, the hook's call for the last
            bucket returns once colltune's worker has issued the step's
            collectives, so that on every rank they come first. With
            ``delay_all_reduce_named_params`` DDP all-reduces those
            parameters from a gradient hook, between any two buckets: given
            that DDP model (not its module), the hook's call for every bucket
            returns once the worker has run its parts.
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

    With ``find_unused_parameters=True`` a parameter no rank used in a
    compressed step still goes through top-k with its part, and DDP keeps
    no result for it (it learns which parameters some rank used only after
    the last bucket). Once DDP has put the results in the gradients, the
    hook gives what its part delivered for such a parameter back to the
    residual, on every rank alike, so no selected entry is lost
    (:func:`_keep_unreached`).

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
        "_unreached",
        "_checked",
        "_ddp_collective_after",
        "_ddp_collective_within",
        "_plans",
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
        self.density = check_density(density)
        self.start_compression_iter = check_int("start_compression_iter", start_compression_iter, 0)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 1)
        self.algorithm = check_choice("algorithm", algorithm, topk_algorithms())
        if model is not None and not isinstance(model, nn.Module):
            raise ColltuneTypeError(
                f"model must be a torch.nn.Module (or DDP model) or None, but got {type(model).__name__}."
            )
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
        #: This step's top-k parts, until DDP has put their results in the gradients (:func:`_keep_unreached`).
        self._unreached: list[_TopkPart] = []
        self._checked: set[str] = set()
        #: Per bucket layout and routing options, what its parameters route to (:class:`_BucketPlan`).
        self._plans: dict[tuple, _BucketPlan] = {}
        #: Whether DDP may issue a collective of its own right after the last bucket (not known: it may).
        self._ddp_collective_after = True
        #: Whether DDP issues one between buckets: its delayed all-reduce (``delay_all_reduce_named_params``).
        self._ddp_collective_within = False
        if model is not None:
            self.bind(model)

    def bind(self, model: nn.Module) -> None:
        """Learn the parameter names of ``model``: the DDP model, its module, or a model holding DDP submodules.

        Names are those of the unwrapped model (DDP's ``module.`` level left out),
        so a policy rule written for ``mlp.0.weight`` matches however DDP wraps it.
        """
        named = _unwrapped_names(model)
        ddps = [m for m in model.modules() if isinstance(m, nn.parallel.DistributedDataParallel)]
        # DDP allreduces its map of used parameters after the last bucket when it finds unused ones each step.
        self._ddp_collective_after = not ddps or any(m.find_unused_parameters and not m.static_graph for m in ddps)
        # DDP all-reduces its delay_all_reduce_named_params from a gradient hook, wherever in backward it fires
        # (a private attribute of DDP, as of torch 2.13; a DDP without it counts as delaying none).
        self._ddp_collective_within = any(getattr(m, "_delay_all_reduce_params", None) for m in ddps)
        self._names = {id(p): n for n, p in named}
        self._order = {id(p): i for i, (_, p) in enumerate(named)}
        self._numels = {n: p.numel() for n, p in named}
        self._plans = {}  # names and order changed

    # -- policy
    def _routing(self) -> tuple[Policy, Overrides, Any]:
        """Return the policy, the overrides and the front door's ``policy=`` argument, resolved on first use."""
        if self._policy is None:
            self._policy, self._overrides, self._policy_arg = resolve_policy(self.policy)
        return self._policy, self._overrides, self._policy_arg  # type: ignore[return-value]

    def _name(self, p: torch.Tensor, bucket_index: int, position: int) -> str:
        """Return the parameter's name in the model, or one made of its bucket, position and shape."""
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
            "version": STATE_VERSION,
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
        check_state_dict(d, "hook")
        self.density = check_density(d["density"])
        self.start_compression_iter = check_int("start_compression_iter", d["start_compression_iter"], 0)
        self.min_compress_numel = check_int("min_compress_numel", d["min_compress_numel"], 1)
        self.algorithm = check_choice("algorithm", d["algorithm"], topk_algorithms())
        self.topk_options = dict(d["topk_options"])
        self.iter = int(d["iter"])
        self.topk_states = {k: restore_topk_state(v) for k, v in d["topk"].items()}
        policy, _, _ = self._routing()
        # Decisions follow the policy: a checkpoint taken under another policy is decided again.
        self.decisions = {k: dict(v) for k, v in d["decisions"].items()} if d["policy_digest"] == policy.digest else {}
        self._used = set()
        self._unreached = []
        self._checked = set()
        self._plans = {}  # each plan is checked with the peers again

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


def _bucket_routes(state: ColltuneHookState, params: list[torch.Tensor], idx: int) -> list[tuple[str, Route]]:
    """Return the name and route of every parameter of bucket ``idx``, in the bucket's order."""
    policy, overrides, _ = state._routing()
    p, backend = group_size(state.process_group), backend_name(state.process_group)
    out = []
    for position, param in enumerate(params):
        name = state._name(param, idx, position)
        decision = policy.match(name, param.numel(), state.density, p, None, dtype_name(param.dtype), backend)
        route = route_for(
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


def _hook_topk_state(state: ColltuneHookState, key: str, names: list[str], numel: int, route: Route) -> TopkState:
    """Return the TopkState of one compressed part, made (and its residual migrated) when new."""
    ts = state.topk_states.get(key)
    if ts is not None and (ts.residual is None or ts.residual.numel() == numel):
        return ts
    ts = state.topk_states[key] = new_topk_state(state.density, {**state.topk_options, **dict(route.state_knobs)})
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
    averaged here (``avg``). Both go through colltune's queue over the
    group's private twin, asynchronously on its worker thread, in the order
    the buckets come (so does the check that ranks route alike, at each new
    bucket layout: inline when nothing is queued). So every collective of a
    compressed step has one order on every rank, as NCCL asks of
    communicators used from several threads. The Future completes when the
    parts do, and DDP hands over the next buckets meanwhile.

    Args:
        state: the hook's :class:`ColltuneHookState`.
        bucket: the bucket DDP hands over.

    Returns:
        A ``torch.futures.Future`` holding a tensor of ``bucket.buffer()``'s
        shape and dtype: the averaged (or top-k averaged) gradients.
    """
    p = group_size(state.process_group)
    if bucket.index() == 0:
        state._unreached = []  # a step whose backward stopped before its last bucket leaves nothing behind
    if not state.compressing or p == 1:
        return _dense_bucket(state, bucket, p)
    parts = _BucketParts(state, bucket)
    out = torch.empty_like(parts.buffer)
    futures: list[torch.futures.Future[Any]] = []
    if parts.dense:
        futures.append(_reduce_dense(state, parts, out, p))
    for (algo, knobs, _), members in parts.topk.items():
        futures.append(_reduce_topk(state, parts, out, members, algo, knobs))
    last = bucket.is_last()
    if last:
        for key in [k for k in state.topk_states if k not in state._used]:
            del state.topk_states[key]  # its parameters moved to other buckets (residuals already taken)
        state._used = set()
        _keep_unreached(state)
    if state._ddp_collective_within or (last and state._ddp_collective_after):
        # DDP all-reduces on the group from this thread next (its map of used parameters right after the last
        # bucket; delayed parameters whenever their hook fires): on every rank that must come after the parts
        # queued so far, which the worker thread issues on the twin.
        _api.drain()
    state.maybe_increase_iter(bucket)

    result = _future_on(out.device)

    def done(all_done: torch.futures.Future[list[torch.futures.Future[Any]]]) -> None:
        for f in all_done.value():
            f.wait()  # raises the error of a part that failed; on CUDA, this thread's stream waits for the part

    # On CUDA, completing is an event on this thread's stream: DDP's wait() makes its own stream wait for it.
    torch.futures.collect_all(futures).add_done_callback(lambda all_done: _settle(result, done, all_done, out))
    return result


def _future_on(device: torch.device) -> torch.futures.Future[Any]:
    """Return a Future that is CUDA-aware for ``device`` when it is a GPU.

    A CUDA-aware Future records an event on the current stream when it
    completes and its ``wait()`` makes the waiter's stream wait for it; a
    plain one (what ``collect_all`` gives) completes on the host alone, so
    DDP would read the bucket before the kernels that write it have run.
    """
    return torch.futures.Future(devices=[device] if device.type == "cuda" else [])


def _settle(fut: torch.futures.Future[Any], work: Any, done: torch.futures.Future[Any], out: torch.Tensor) -> None:
    """Run ``work(done)``, then complete ``fut`` with ``out``, or with the error ``work`` raised: a Future
    DDP waits on must complete either way."""
    try:
        work(done)
        fut.set_result(out)
    except BaseException as exc:  # noqa: BLE001 - DDP hears of it through the Future
        fut.set_exception(exc)


def _dense_bucket(state: ColltuneHookState, bucket: dist.GradBucket, p: int) -> torch.futures.Future[torch.Tensor]:
    """Average the whole bucket with an asynchronous dense allreduce (warm-up, or a single rank)."""
    buffer = bucket.buffer()
    stats = state.stats.setdefault(f"bucket{bucket.index()}", TensorStats("dense", "dense"))
    stats.reason = "warm-up" if not state.compressing else "single rank"
    nbytes = ring_bytes(buffer.numel(), buffer.element_size(), p)
    stats.record("dense", nbytes)
    state.bytes_sent += nbytes
    state.maybe_increase_iter(bucket)
    if p == 1:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    _api.drain()  # on DDP's group from this thread: colltune calls still queued go first on every rank
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0].div_(p))


#: Bucket layouts whose plans a hook state keeps (DDP builds its buckets once, and rebuilds them once).
MAX_PLANS = 64


class _BucketPlan:
    """What one bucket layout routes to: its parameters' routes and slices, the dense ones and the top-k groups.

    Parts are taken in the model's parameter order; top-k parts with the
    same algorithm and knobs travel together. Made once per layout and
    routing options (:func:`_plan_key`); checked to be the same on every
    rank the first time its parameters' names are seen together (a plan
    made again for other options, which every rank sets alike, is not).
    """

    __slots__ = ("routes", "slices", "dense", "topk", "decisions")

    def __init__(self, state: ColltuneHookState, bucket: dist.GradBucket, params: list[torch.Tensor]) -> None:
        try:
            self.routes = _bucket_routes(state, params, bucket.index())
        except Exception as exc:  # noqa: BLE001 - the other ranks wait in the plan's check: they must hear of it
            _check_plan(state, None, bucket, error=exc)
            raise
        self.slices: list[tuple[int, int]] = []
        offset = 0
        for param in params:
            self.slices.append((offset, offset + param.numel()))
            offset += param.numel()
        order = sorted(range(len(params)), key=lambda i: (state._order.get(id(params[i]), len(state._order)), i))
        self.dense = [i for i in order if self.routes[i][1].route == "dense"]
        self.topk: dict[tuple, list[int]] = {}
        for i in order:
            r = self.routes[i][1]
            if r.route == "topk":
                key = (r.algorithm, tuple(sorted(r.knobs.items())), tuple(sorted(r.state_knobs.items())))
                self.topk.setdefault(key, []).append(i)
        plan_key = "|".join(self.routes[i][0] for i in order)
        if plan_key not in state._checked:
            plan = [plan_key, [self.routes[i][1].plan() for i in order]]
            _check_plan(state, plan, bucket)
            state._checked.add(plan_key)
        self.decisions = {name: {"route": r.route, "algorithm": r.algorithm, "reason": r.reason}
                          for name, r in self.routes}


def _plan_key(state: ColltuneHookState, index: int, params: list[torch.Tensor]) -> tuple:
    """What a bucket's routes depend on: its parameters (as the bound model names them, their sizes and dtypes: a
    policy matches on both) and the routing options."""
    return (index, tuple((id(p), p.numel(), p.dtype) for p in params), state.density, state.min_compress_numel,
            state.algorithm, state.process_group)


class _BucketParts:
    """A compressed bucket in this step: its buffer and its layout's :class:`_BucketPlan`."""

    def __init__(self, state: ColltuneHookState, bucket: dist.GradBucket) -> None:
        self.buffer = bucket.buffer()
        self.buffer_index = bucket.index()
        self.params = params = list(bucket.parameters())
        key = _plan_key(state, self.buffer_index, params)
        plan = state._plans.get(key)
        if plan is None:
            plan = _BucketPlan(state, bucket, params)
            if len(state._plans) >= MAX_PLANS:
                state._plans.clear()
            state._plans[key] = plan
        self.routes, self.slices, self.dense, self.topk = plan.routes, plan.slices, plan.dense, plan.topk
        state.decisions.update(plan.decisions)  # state_dict() copies them on the way out

    def gather(self, members: list[int]) -> torch.Tensor:
        """Return the members' gradients as one flat tensor (a view for a single member)."""
        if len(members) == 1:
            a, b = self.slices[members[0]]
            return self.buffer[a:b]
        return torch.cat([self.buffer[self.slices[i][0] : self.slices[i][1]] for i in members])

    def scatter(self, members: list[int], flat: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``flat`` back into the members' slices of ``out``."""
        pos = 0
        for i in members:
            a, b = self.slices[i]
            out[a:b] = flat[pos : pos + b - a]
            pos += b - a


def _check_plan(state: ColltuneHookState, plan: Any, bucket: dist.GradBucket, error: Exception | None = None) -> None:
    """:func:`check_same_plan` for ``bucket`` on the private twin, behind the parts already queued, as every
    collective of a compressed step; ``error`` (this rank could not route the bucket) is raised after it."""
    what = f"colltune_hook (bucket {bucket.index()})"

    def exchange(wire: Any) -> Exception | None:
        try:
            check_same_plan(plan, wire, what, error=error)
        except Exception as exc:
            if exc is error:
                return exc  # returned, not raised: the worker would count it as a rank falling out of step
            raise
        return None

    # On a GPU the worker runs it with the bucket's device current, where the twin's communicator is.
    raised = _api.submit_call(exchange, False, state.process_group, device=bucket.buffer().device)
    if raised is not None:
        raise raised


def _reduce_dense(
    state: ColltuneHookState, parts: _BucketParts, out: torch.Tensor, p: int
) -> torch.futures.Future[Any]:
    """Average the parts kept dense with one allreduce, queued behind the bucket's earlier parts; return its Future.

    It runs on colltune's worker thread and private twin, as the top-k parts
    do, so that every collective of a compressed step goes through one
    communicator, issued from one thread in the same order on every rank.
    """
    flat = parts.gather(parts.dense).clone()
    handle = all_reduce_queued(flat, state.process_group, async_op=True)
    nbytes = ring_bytes(flat.numel(), flat.element_size(), p)
    stats = state.stats.setdefault(f"bucket{parts.buffer_index}/dense", TensorStats("dense", "dense"))
    stats.reason = "kept dense: " + "; ".join(sorted({parts.routes[i][1].reason for i in parts.dense}))
    with _STATS_LOCK:
        stats.record("dense", nbytes)
        state.bytes_sent += nbytes

    def done(fut: torch.futures.Future[Any]) -> None:
        parts.scatter(parts.dense, fut.value().div_(p), out)

    return _part_future(handle, done, out)


def _reduce_topk(
    state: ColltuneHookState, parts: _BucketParts, out: torch.Tensor, members: list[int], algo: str, knobs: tuple
) -> torch.futures.Future[Any]:
    """Average one group of top-k parts through an asynchronous :func:`colltune.topk_allreduce`; return its Future.

    The call runs on colltune's worker thread (on the group's private twin),
    so DDP goes on with the next buckets meanwhile.
    """
    names = [parts.routes[i][0] for i in members]
    key = "|".join(names)
    flat = parts.gather(members)
    ts = _hook_topk_state(state, key, names, flat.numel(), parts.routes[members[0]][1])
    state._used.add(key)
    state._unreached.append(_TopkPart(ts, out, [parts.slices[i] for i in members], [parts.params[i] for i in members]))
    handle: Any = _api.topk_allreduce(
        flat,
        ts,
        op="avg",
        group=state.process_group,
        algorithm=algo,
        async_op=True,
        knobs=dict(knobs) or None,
        name=key if algo == AUTO else None,
        policy=state._routing()[2] if algo == AUTO else None,
    )
    reason = parts.routes[members[0]][1].reason

    def done(fut: torch.futures.Future[Any]) -> None:
        res = fut.value()
        parts.scatter(members, res.to_dense().view(-1), out)
        nbytes = topk_bytes_sent(res)
        with _STATS_LOCK:
            state.stats.setdefault(key, TensorStats("topk", res.algorithm, reason)).record(res.algorithm, nbytes)
            state.bytes_sent += nbytes

    return _part_future(handle, done, out)


class _TopkPart:
    """One top-k part of a compressed step, as its parameters' gradients stood when its bucket came.

    DDP leaves the gradient of a parameter no rank used untouched (``None``,
    or the same tensor at the same version) and writes every other
    parameter's; a gradient that is a view of DDP's bucket
    (``gradient_as_bucket_view``) is written either way, so it reads as
    written, as it is. That is how :meth:`give_back` tells, with no kernel
    and no host sync. Not for gradients that never land in ``.grad``
    (distributed autograd, an optimizer run in backward): there every
    parameter would read as unused.
    """

    __slots__ = ("state", "out", "slices", "params", "before")

    def __init__(self, state: TopkState, out: torch.Tensor, slices: list[tuple[int, int]], params: list[Any]) -> None:
        self.state, self.out, self.slices, self.params = state, out, slices, params
        self.before = [(p.grad, None if p.grad is None else p.grad._version) for p in params]

    def give_back(self) -> None:
        """Add to the residual what this part delivered for each parameter whose gradient DDP left untouched
        (nothing after an overflow: the residual is then the one before the call, which still holds it)."""
        at, ok = 0, None
        for (a, b), param, (grad, version) in zip(self.slices, self.params, self.before):
            now = param.grad
            if self.state.residual is not None and (now is None or (now is grad and now._version == version)):
                # Every rank delivered the same average here and gives it back: their residuals' sum regains
                # P times it, what the ranks' selections sent (to the bucket dtype's rounding of the average).
                ok = self.out.abs().amax() < math.inf if ok is None and self.out.numel() else ok
                part = self.out[a:b].to(self.state.residual.dtype)
                self.state.residual[at : at + b - a] += part if ok is None else torch.where(ok, part, 0.0)
            at += b - a


def _keep_unreached(state: ColltuneHookState) -> None:
    """At the last bucket: once DDP has finalized the step, give back what the step's top-k parts delivered
    to parameters no rank used (:class:`_TopkPart`).

    DDP finalizes in an autograd callback it queues right after this bucket
    (or, in a ``static_graph`` model's first step, in one queued before the
    buckets come), so the hook queues one that queues another: that one
    runs after DDP's. Outside a backward pass (a rank that joined, under
    DDP's ``join``, shadows the step from Python) there is no callback to
    queue: what that rank's selections sent to a parameter the other ranks
    did not use is lost.
    """
    parts, state._unreached = state._unreached, []
    if not parts:
        return

    def after_ddp() -> None:
        for part in parts:
            part.give_back()

    try:
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(after_ddp))
    except RuntimeError:  # not in a backward pass
        pass


def _part_future(handle: Any, done: Any, out: torch.Tensor) -> torch.futures.Future[Any]:
    """Return the Future of one bucket part: completed once ``done`` (its scatter into ``out``) is queued.

    ``done`` runs on whichever thread completes the call's Future (the worker
    thread, or this one if the call is done first: the handle's Future has
    then joined this thread's stream to the call's); the part's Future is
    CUDA-aware, so its event follows the scatter on that thread's stream.
    """
    part = _future_on(out.device)
    handle.get_future().add_done_callback(lambda fut: _settle(part, done, fut, out))
    return part


# DDP checks the hook's annotations against the real classes; postponed evaluation
# (``from __future__ import annotations``) would leave strings there.
colltune_hook.__annotations__.update(state=ColltuneHookState, bucket=dist.GradBucket)
colltune_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
