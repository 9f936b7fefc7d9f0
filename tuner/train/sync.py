"""The sparse-gradient synchronizer: sparse gradients through colltune, beside or without DDP.

``sync = SparseGradSync(model); sync.attach(optimizer)`` serves models with
sparse gradients (``nn.Embedding(sparse=True)``,
``nn.EmbeddingBag(sparse=True)``), which DDP cannot reduce on NCCL at all
(on gloo it falls back to an allgather of every rank's rows). Before every
``optimizer.step()`` (or when :meth:`SparseGradSync.synchronize` is called
after backward), each sparse gradient goes through
:func:`colltune.sparse_allreduce` (``avg``, ``auto`` by default) and comes
back as a coalesced sparse gradient, so ``torch.optim.SGD`` and
``torch.optim.SparseAdam`` work unchanged. Dense gradients are averaged by
one bucketed allreduce, compressed with top-k (``dense="topk"``), or left
alone (``dense="skip"``). Parameters inside a ``DistributedDataParallel``
submodule are always left to DDP, so the common layout, DDP over the dense
tower and the embedding outside it, needs no option. Routing:
:mod:`colltune.train.common`.

Example (sparse embedding beside DDP over the dense tower)::

    model.mlp = DistributedDataParallel(model.mlp)       # DDP: dense part only
    sync = colltune.train.SparseGradSync(model)           # the embedding: colltune
    sync.attach(optimizer)                                # before every step()
    for batch in loader:                                  # the loop is unchanged
        loss = model(batch).mean(); loss.backward()
        optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Callable, Iterable, Literal, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from colltune import api as _api
from colltune import fused as _fused
from colltune.algorithms import meta as _meta
from colltune.algorithms.errors import ColltuneError, ColltuneTypeError, ColltuneValueError
from colltune.algorithms.meta import dtype_name
from colltune.algorithms.sparse import upload
from colltune.algorithms.state import TopkState
from colltune.api import CallerCheck
from colltune.model.policy import AUTO
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
    sparse_algorithms,
    topk_algorithms,
    topk_bytes_sent,
)

__all__ = ["SparseGradSync", "sparse_parameters"]

logger = logging.getLogger(__name__)


DenseMode = Literal["allreduce", "topk", "skip"]

_DENSE_MODES: tuple[str, ...] = ("allreduce", "topk", "skip")


def sparse_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Return the parameters of ``model`` whose gradients are sparse.

    They are the weights of ``nn.Embedding`` and ``nn.EmbeddingBag`` modules built with ``sparse=True``.
    """
    out: dict[str, nn.Parameter] = {}
    for mname, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            weight: nn.Parameter = module.weight  # type: ignore[assignment]
            out[f"{mname}.weight" if mname else "weight"] = weight
    return out


def _gradient_rows(name: str, param: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the row indices and value rows of a parameter's gradient, for a sparse allreduce.

    A missing gradient gives no rows; a dense one (e.g. an embedding with
    ``sparse=False``) gives its nonzero rows.

    Raises:
        ColltuneValueError: the gradient is sparse over more than its first dimension.
    """
    grad = param.grad
    if grad is None:
        row_shape = tuple(param.shape[1:])
        return (torch.empty(0, dtype=torch.int64, device=param.device),
                torch.empty((0, *row_shape), dtype=param.dtype, device=param.device))
    if grad.is_sparse:
        if grad.sparse_dim() != 1:
            raise ColltuneValueError(
                f"the sparse gradient of {name} has {grad.sparse_dim()} sparse dimensions, but colltune "
                "reduces COO tensors over the first dimension only (as nn.Embedding produces); make it one "
                "with grad.to_dense().to_sparse(1), or leave the parameter to DDP or dense='allreduce'.",
                argument="gradients",
            )
        if grad.is_coalesced():
            return grad.indices()[0], grad.values()
        return grad._indices()[0], grad._values()
    rows = grad.reshape(grad.shape[0], -1).ne(0).any(dim=1).nonzero().view(-1)
    return rows, grad.index_select(0, rows)


def _check_buckets(bucket_cap_mb: Any, fuse: Any) -> tuple[float, bool]:
    """Return ``bucket_cap_mb`` and ``fuse``, checked."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ColltuneValueError(f"bucket_cap_mb must be a number > 0, but got {bucket_cap_mb!r}.")
    return float(bucket_cap_mb), _check_flag("fuse", fuse)


def _check_flag(label: str, value: Any) -> bool:
    """Return ``value``, a bool, or raise naming ``label``."""
    if not isinstance(value, bool):
        raise ColltuneTypeError(f"{label} must be True or False, but got {type(value).__name__} {value!r:.40}.")
    return value


#: A sparse gradient of a step: its parameter's name, the parameter, its route, and its rows.
_SparseItem = tuple[str, nn.Parameter, Route, tuple[torch.Tensor, torch.Tensor]]


class _Step:
    """What one synchronization reduces, by route, in the tracked parameters' order."""

    __slots__ = ("sparse", "topk", "dense")

    def __init__(self) -> None:
        self.sparse: list[_SparseItem] = []
        self.topk: list[tuple[str, nn.Parameter, Route]] = []
        self.dense: list[tuple[str, nn.Parameter]] = []


def _rows_for(name: str, param: nn.Parameter, async_op: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_gradient_rows`, copied for an asynchronous call: the caller may change the gradient meanwhile."""
    idx, vals = _gradient_rows(name, param)
    return (idx.clone(), vals.clone()) if async_op else (idx, vals)


def _ddp_modules(model: nn.Module) -> list[nn.parallel.DistributedDataParallel]:
    """Return the ``DistributedDataParallel`` submodules of ``model``."""
    return [m for m in model.modules() if isinstance(m, nn.parallel.DistributedDataParallel)]


def _ddp_owned(model: nn.Module) -> set[int]:
    """Return the ids of the parameters inside a ``DistributedDataParallel`` submodule (DDP reduces them)."""
    return {id(p) for module in _ddp_modules(model) for p in module.parameters()}


def _tracked_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter, bool]]:
    """Return ``(name, parameter, sparse)`` of every trainable parameter that DDP does not reduce, once each."""
    owned = _ddp_owned(model)
    sparse_ids = {id(p) for p in sparse_parameters(model).values()}
    seen: set[int] = set()
    out: list[tuple[str, nn.Parameter, bool]] = []
    for name, param in model.named_parameters():
        if id(param) in seen or id(param) in owned or not param.requires_grad:
            continue
        seen.add(id(param))
        out.append((name, param, id(param) in sparse_ids))
    return out


class SparseGradSync(Joinable):
    """Average the gradients of a model after backward, sparse ones through colltune's sparse allreduce.

    One call turns it on: :meth:`attach` (before every ``optimizer.step()``)
    or :meth:`attach_to_backward` (at the end of every backward); or call
    :meth:`synchronize` yourself after backward.

    What each gradient goes through (see the module docstring for the precedence):

    * sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``):
      all of a step's in one :func:`colltune.sparse_allreduce_many` (``fuse``,
      the default) or one :func:`colltune.sparse_allreduce` each, with
      ``op="avg"``, exact; each result is put back as a coalesced sparse
      gradient. Works on gloo and NCCL.
    * dense gradients: ``dense="allreduce"`` averages them in one bucketed
      allreduce; ``dense="topk"`` compresses those with at least
      ``min_compress_numel`` elements with top-k and error feedback (after
      ``start_compression_iter`` dense steps); ``dense="skip"`` leaves them
      alone (DDP or the caller reduces them).
    * parameters of a ``DistributedDataParallel`` submodule: left to DDP.

    A gradient that is ``None`` on some ranks counts as zero there; if it is
    ``None`` on every rank it stays ``None`` (and so does a sparse gradient
    whose reduced result is empty), identically on every rank.

    Uneven inputs: it is a :class:`~torch.distributed.algorithms.join.Joinable`,
    so ``with Join([sync]):`` (or ``Join([ddp_tower, sync])`` beside DDP,
    DDP listed first) lets ranks run out of batches at different steps. A
    rank that has joined shadows each later synchronization with no
    gradients of its own (zero, as a ``None`` gradient counts; top-k still
    sends what its residual selects; the rank's gradients are left as they
    were), in the mode its last one ran (``async_op``), or that
    :meth:`attach_to_backward` set; the average still divides by the
    group's size, as DDP's ``divide_by_initial_world_size=True`` does.
    Beside DDP the join context counts DDP's forwards, so the synchronizer
    shadows those after which DDP reduces gradients: accumulate micro-batches
    under ``ddp.no_sync()``. When every rank has joined, the parameters
    and buffers (``broadcast_buffers``) of the last rank to join, frozen
    ones too, are copied to every rank, as DDP copies its own module's (a
    DDP submodule's are DDP's to copy, as its own options say).

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
        init_sync: broadcast the parameters and buffers of the group's rank 0
            to every rank now, as DDP does, so that ranks seeded differently
            start from the same model; ``False`` leaves them as they are.
            A DDP submodule's are left to DDP, which copied them when it was made.
        broadcast_buffers: copy the buffers with the parameters (at
            ``init_sync`` and when every rank has joined), as DDP's option of
            that name does; ``False`` leaves each rank's buffers its own.
        fuse: reduce the step's sparse gradients together, in one
            :func:`colltune.sparse_allreduce_many` per route (algorithm and
            knobs): one metadata exchange for all tables, buckets of up to
            ``bucket_cap_mb`` each run one algorithm chosen from the bucket's
            features. Each gradient gets the bits its own call would give
            with the same algorithm.
            ``False``: one :func:`colltune.sparse_allreduce` per gradient, each
            named after its parameter (policy rules on measured density
            then match per parameter; fused calls are named :attr:`fused_name`).

    Raises:
        ColltuneTypeError, ColltuneValueError: an option is invalid, or
            ``model`` is wrapped in DDP as a whole.

    Example:
        >>> sync = SparseGradSync(model)             # doctest: +SKIP
        >>> sync.attach(optimizer)                   # doctest: +SKIP
        >>> loss.backward(); optimizer.step()        # doctest: +SKIP
    """

    #: The ``name`` of the fused calls (policy rules and decision caches see it).
    fused_name = "SparseGradSync"

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
        init_sync: bool = True,
        fuse: bool = True,
        broadcast_buffers: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ColltuneTypeError(f"model must be a torch.nn.Module, but got {type(model).__name__}.")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ColltuneValueError(
                "model is wrapped in DistributedDataParallel as a whole, so DDP already reduces every gradient "
                "(and cannot reduce sparse ones on NCCL); pass the unwrapped model, or wrap only the dense "
                "part in DDP (e.g. model.mlp = DistributedDataParallel(model.mlp)) and pass the whole model."
            )
        super().__init__()  # Joinable: the join context's settings (off outside one)
        self.model = model
        self.group = group
        self.algorithm = check_choice("algorithm", algorithm, sparse_algorithms())
        self.dense = check_choice("dense", dense, _DENSE_MODES)
        self.density = check_density(density)
        self.start_compression_iter = check_int("start_compression_iter", start_compression_iter, 0)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 1)
        self.topk_algorithm = check_choice("topk_algorithm", topk_algorithm, topk_algorithms())
        self.bucket_cap_mb, self.fuse = _check_buckets(bucket_cap_mb, fuse)
        self.topk_options = dict(topk_options or {})
        TopkState(density=self.density, **self.topk_options)  # validate now
        self.policy = policy
        self.step = 0
        self.topk_states: dict[str, TopkState] = {}
        self.decisions: dict[str, dict[str, Any]] = {}
        self.stats: dict[str, TensorStats] = {}
        self.bytes_sent = self.last_bytes = 0
        self.broadcast_buffers = _check_flag("broadcast_buffers", broadcast_buffers)
        self._params, self._ddps = _tracked_parameters(model), _ddp_modules(model)
        self._start_bookkeeping()
        if init_sync and group_size(group) > 1:
            _broadcast_tensors(self._states(), group, 0, "SparseGradSync(init_sync=True)")

    def _start_bookkeeping(self) -> None:
        """The synchronizer's record of routes, hooks, optimizers and pending calls, empty."""
        self._routes: dict[str, Route] | None = None
        self._routes_for: tuple | None = None  # whether compressing, and the options the routes depend on
        self._routes_code = 0  # a code of the routes, for the step's check
        self._policy_arg: Any = None
        self._synced = self._queued = False
        self._handles: list[Any] = []  # every hook this synchronizer installed (the same list for its lifetime)
        weakref.finalize(self, _remove_hooks, self._handles)
        self._attached: list[Any] = []  # the optimizers of attach()
        self._stepped: set[int] = set()  # of those, the ones that stepped since the last synchronization
        self._dirty: set[int] = set()  # parameters whose gradient grew in a backward since the last synchronization
        self._grad_hooks: list[Any] = []
        self._guard: Any = None
        self._pending: tuple | None = None  # an asynchronous synchronize()'s calls, until wait()
        self._async_op = False  # the last synchronization's mode: a rank that joined shadows the next ones so
        self._misused: ColltuneValueError | None = None  # found by the optimizer guard: the next check carries it

    # -- routing
    @property
    def compressing(self) -> bool:
        """Whether top-k compression is on (the warm-up is over)."""
        return self.step >= self.start_compression_iter

    def _compute_routes(self) -> dict[str, Route]:
        """Route every tracked parameter for the current step (local: no communication)."""
        compressing = self.compressing
        made_for = (compressing, self.algorithm, id(self.policy), *self._options())
        if self._routes is not None and self._routes_for == made_for:
            return self._routes
        policy, overrides, self._policy_arg = resolve_policy(self.policy)
        p, backend = group_size(self.group), backend_name(self.group)
        routes: dict[str, Route] = {}
        for name, param, sparse in self._params:
            density = None if sparse else self.density
            decision = policy.match(name, param.numel(), density, p, None, dtype_name(param.dtype), backend)
            route = route_for(
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
                warm_up = f"warm-up ({self.step} of {self.start_compression_iter} dense steps)"
                route = Route("dense", "dense", reason=warm_up)
            routes[name] = route
        self.decisions = {
            n: {"route": r.route, "algorithm": r.algorithm, "reason": r.reason, "policy_digest": policy.digest}
            for n, r in routes.items()
        }
        for n, r in routes.items():
            logger.debug("SparseGradSync: %s -> %s %s (%s)", n, r.route, r.algorithm, r.reason)
        self._routes, self._routes_for = routes, made_for
        shapes = {name: (tuple(param.shape), dtype_name(param.dtype)) for name, param, _ in self._params}
        self._routes_code = _meta.digest([[n, r.plan(), shapes[n]] for n, r in routes.items()])
        return routes

    def _prepare(self, async_op: bool) -> tuple[_Step | None, CallerCheck]:
        """Route this step's gradients and read the sparse ones (local: no communication); return them and the check.

        Nothing here raises: a failure (a policy or ``COLLTUNE_ALGO`` that
        does not load, a gradient of the wrong layout) travels in the step's
        check, so every rank raises together and none waits for this one.
        """
        if self._misused is not None:  # every rank hears of it in this step's check, and raises
            misused, self._misused = self._misused, None
            return None, CallerCheck(self.step, -1, misused)
        try:
            routes = self._compute_routes()
            step = _Step()
            for name, param, _ in self._params:
                route = routes[name]
                if route.route == "sparse":
                    step.sparse.append((name, param, route, _rows_for(name, param, async_op)))
                elif route.route == "topk":
                    step.topk.append((name, param, route))
                elif route.route == "dense":
                    step.dense.append((name, param))
        except Exception as exc:  # noqa: BLE001 - whatever it is, the other ranks must hear of it
            if isinstance(exc, ColltuneError) and exc.argument is None:
                exc.argument = "policy"
            return None, CallerCheck(self.step, -1, exc)
        # The mode orders the step's collectives only where sparse gradients go beside others (see _synchronize):
        # elsewhere ranks may differ in it (a rank with no batch under Join shadows synchronously).
        ordered = async_op and bool(step.sparse) and bool(step.topk or step.dense)
        return step, CallerCheck(self.step, _meta.digest(self._routes_code, ordered, self._options()))

    def _options(self) -> tuple:
        """The options that shape a step's collectives (buckets, top-k), which every rank must share."""
        return (self.fuse, self.bucket_cap_mb, self.dense, self.density, self.start_compression_iter,
                self.min_compress_numel, self.topk_algorithm, sorted(self.topk_options.items()))

    def routes(self) -> dict[str, tuple[str, str]]:
        """Return ``{parameter name: (route, algorithm)}`` for the current step (no communication)."""
        return {n: (r.route, r.algorithm) for n, r in self._compute_routes().items()}

    # -- the synchronization
    @torch.no_grad()
    def synchronize(self, async_op: bool = False) -> None:
        """Average every tracked gradient over the group, in place; call after backward on every rank.

        Args:
            async_op: start the sparse gradients' reduction on colltune's
                worker thread and return; :meth:`wait` (or any optimizer's
                ``step()``, which waits first) puts the results on the
                gradients. Dense and top-k gradients are averaged before it
                returns. Until then the sparse gradients are still this
                rank's own: call :meth:`wait` before anything reads or
                changes them (``GradScaler.unscale_``, ``clip_grad_norm_``),
                or the result overwrites the change and ranks clip apart;
                on NCCL, :meth:`wait` too before a collective of your own
                (see :meth:`attach_to_backward`).

        Every rank checks, in the step's first metadata exchange, that all
        ranks are at the same step and route alike, and hears of any rank's
        failure to prepare: then every rank raises, nothing is reduced, the
        step is not counted, and the next synchronization is exact.

        Raises:
            ColltuneValueError: a sparse gradient is not COO over its first
                dimension, or the policy or the environment is invalid.
            RemoteInputError: another rank's gradients, policy or environment were invalid.
            RankMismatchError: ranks routed their gradients differently, or are
                at different steps (one skipped or repeated a synchronization).
        """
        self.wait()
        if self._join_config.enable and self._join_config.is_first_joinable:
            _api.drain()  # the join context's all-reduce goes on this thread: colltune's queued calls first
            Join.notify_join_context(self)
        self._synchronize(async_op)

    @torch.no_grad()
    def _synchronize(self, async_op: bool) -> None:
        """One step's synchronization (:meth:`synchronize` once it has told a join context)."""
        self._async_op = async_op
        step, check = self._prepare(async_op)
        p = group_size(self.group)
        # The check rides in the step's first fused call when nothing runs before that call completes;
        # otherwise (and always on a rank that failed to prepare) it is an exchange of its own.
        carried = (step is not None and self.fuse and bool(step.sparse)
                   and not (async_op and (step.topk or step.dense)))
        if p > 1 and not carried:
            _api.check_with_peers(self.group, self._hint(), check)
        elif check.error is not None:
            raise check.error
        assert step is not None
        # Asynchronous, the dense and top-k gradients go first, on this thread, and the sparse calls are queued
        # after them: every rank issues the step's collectives in one order (NCCL asks it of communicators used
        # from several threads). Synchronous, the sparse calls go first: the step's check may ride in them.
        carry = check if p > 1 else None
        if not async_op:
            launched = self._launch_sparse(step.sparse, False, carry)
        step_bytes = sum(self._sync_topk(*item) for item in step.topk)
        step_bytes += self._sync_dense(step.dense, p)
        if async_op:
            launched = self._launch_sparse(step.sparse, True, carry)
        self.step += 1
        self._pending = (launched, step_bytes)
        if not async_op:
            self.wait()
        self._synced = True
        self._dirty.clear()

    # -- uneven inputs (torch.distributed.algorithms.join)
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Return the hook a rank that has joined runs: it shadows each synchronization the others make.

        Raises:
            ColltuneValueError: ``divide_by_initial_world_size=False`` was given to ``Join``: the sparse
                average divides by the group's size.
        """
        if kwargs.get("divide_by_initial_world_size", True) is False:
            raise ColltuneValueError(
                "Join(..., divide_by_initial_world_size=False) asks to average over the ranks that have not "
                "joined, but SparseGradSync averages over the group's size (a joined rank adds zero); leave "
                "divide_by_initial_world_size at True.", argument="divide_by_initial_world_size")
        return _JoinShadow(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the join context's all-reduces: where the synchronizer's calls run."""
        hint = self._hint()
        return hint.device if hint is not None else torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        """The synchronizer's group (the default group when none was given).

        The join context reads it once it has told every joinable its place,
        so a DDP submodule missing from the context, or listed after the
        synchronizer, or a second one, is refused here (every rank alike):
        each would have the ranks that joined shadow the collectives in
        another order.
        """
        if self._join_config.enable:
            if len(self._ddps) > 1:
                raise ColltuneValueError(
                    f"the model has {len(self._ddps)} DistributedDataParallel submodules, but a join context "
                    "shadows each DDP's collectives one module after another, while training interleaves them "
                    "(forwards in order, backwards in reverse), so the ranks' collectives would mismatch: wrap the "
                    "dense layers in one DDP, over a module whose forward runs them all (for DLRM, one "
                    "forward(dense_x, embedded) over the bottom and top MLPs).",
                    argument="joinables")
            for ddp in self._ddps:
                if not ddp._join_config.enable or self._join_config.is_first_joinable:
                    raise ColltuneValueError(
                        "a DistributedDataParallel submodule of the model must be in the same Join, before the "
                        "synchronizer: Join([model.mlp, sync]) (its forward tells the join context of each step).",
                        argument="joinables")
        return self.group if self.group is not None else dist.group.WORLD

    def _shadow(self) -> None:
        """On a rank that has joined: one synchronization with no gradients of its own; the rank's gradients
        and its record of what backward and the optimizers did are kept."""
        self.wait()  # an asynchronous one the loop left pending lands first
        if self._ddps and not self._join_config.is_first_joinable and not any(
                ddp.require_forward_param_sync for ddp in self._ddps):
            return  # DDP's join hook, just before, found no rank reducing gradients after this forward
        saved = [(param, param.grad) for _, param, _ in self._params]
        flags = (self._synced, set(self._dirty), set(self._stepped))
        for param, _ in saved:
            param.grad = None
        try:
            self._synchronize(self._async_op)
            self.wait()
        finally:
            for param, grad in saved:
                param.grad = grad
            self._synced, self._dirty, self._stepped = flags

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """When every rank has joined: copy the model's parameters and buffers (trained, frozen, and those the
        loop changed by hand) of the last rank to join to every rank; a DDP submodule copies its own."""
        self.wait()
        self._join_config = type(self._join_config).construct_disabled_join_config()  # out of the context now
        if group_size(self.group) == 1:
            return
        _api.drain()  # on the group from this thread: colltune's queued calls go first on every rank
        last = upload([dist.get_rank(self.group) if is_last_joiner else -1], self.join_device)
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=self.group)
        _broadcast_tensors(self._states(), self.group, int(last.item()), "SparseGradSync's final model (join)")

    def _states(self) -> list[tuple[str, torch.Tensor]]:
        """The model's parameters and (with ``broadcast_buffers``) buffers by name, each once, less those of its
        DDP submodules: DDP copies those as its own options say."""
        ddps = {id(t) for ddp in self._ddps for t in (*ddp.parameters(), *ddp.buffers())}
        seen: set[int] = set()
        out: list[tuple[str, torch.Tensor]] = []
        buffers = list(self.model.named_buffers()) if self.broadcast_buffers else []
        for name, t in list(self.model.named_parameters()) + buffers:
            if id(t) not in seen and id(t) not in ddps:
                seen.add(id(t))
                out.append((name, t))
        return out

    def _hint(self) -> torch.Tensor | None:
        """A tensor on the device the synchronizer's calls run on (its first sparse parameter's), or ``None``."""
        first = next((param for _, param, sparse in self._params if sparse), None)
        return first if first is not None else next((param for _, param, _ in self._params), None)

    def wait(self) -> None:
        """Put the results of an asynchronous :meth:`synchronize` on the gradients (nothing to do without one).

        Raises what the reduction raised (e.g. :class:`~colltune.CollectiveError`).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        launched, step_bytes = pending
        try:
            step_bytes += self._finish_sparse(launched)
        except BaseException:
            self.step -= 1  # every rank's call failed alike: the step does not count on any of them
            raise
        self.last_bytes = step_bytes
        self.bytes_sent += step_bytes

    def _launch_sparse(self, items: list[_SparseItem], async_op: bool, check: CallerCheck | None) -> list[tuple]:
        """Start the sparse gradients' reduction; return ``(members, result or handle)`` per call.

        Fused (``fuse``): one :func:`colltune.sparse_allreduce_many` per route
        (algorithm and knobs), each with the step's ``check`` in its record.
        Otherwise one :func:`colltune.sparse_allreduce` per gradient.
        """
        if not self.fuse:
            return [([item[:3]], self._call_one(*item, async_op)) for item in items]
        groups: dict[tuple, list[_SparseItem]] = {}
        for item in items:
            route = item[2]
            groups.setdefault((route.algorithm, tuple(sorted(route.knobs.items()))), []).append(item)
        launched: list[tuple] = []
        for (algorithm, knobs), members in groups.items():
            tensors = [(*rows, tuple(param.shape)) for _, param, _, rows in members]
            launched.append(([m[:3] for m in members], _fused.submit_many(
                tensors, "avg", self.group, algorithm, async_op, knobs=dict(knobs) or None,
                name=self.fused_name, policy=self._policy_arg if algorithm == AUTO else None,
                bucket_cap_mb=self.bucket_cap_mb, check=check,
            )))
        return launched

    def _call_one(self, name: str, param: nn.Parameter, route: Route, rows: tuple[torch.Tensor, torch.Tensor],
                  async_op: bool) -> Any:
        """Start one :func:`colltune.sparse_allreduce` of one sparse gradient."""
        idx, vals = rows
        return _api.sparse_allreduce(
            idx, vals, tuple(param.shape), op="avg", group=self.group, algorithm=route.algorithm,
            knobs=dict(route.knobs) or None, name=name,
            policy=self._policy_arg if route.algorithm == AUTO else None, async_op=async_op,
        )

    def _finish_sparse(self, launched: list[tuple]) -> int:
        """Wait for each call, put its results on the gradients; return the bytes this rank sent.

        A fused call's bytes are shared out among its gradients in
        proportion to their entries, for the per-tensor stats.
        """
        total = 0
        for members, got in launched:
            got = got.wait() if isinstance(got, _api.AsyncHandle) else got
            results = got if isinstance(got, list) else [got]
            nbytes = topk_bytes_sent(results[0]) if results else 0
            entries = [int(res.indices.numel()) for res in results]
            whole = max(1, sum(entries))
            for (name, param, route), res, k in zip(members, results, entries):
                self._put_sparse(name, param, route, res, nbytes * k // whole)
            total += nbytes
        return total

    def _put_sparse(self, name: str, param: nn.Parameter, route: Route, res: Any, nbytes: int) -> int:
        """Put a reduced sparse gradient back on ``param`` and count it; return ``nbytes``."""
        grad = param.grad
        if grad is not None and not grad.is_sparse:
            grad.copy_(res.to_dense())  # the caller keeps a dense gradient dense
        elif res.indices.numel() == 0:
            param.grad = None
        else:
            param.grad = res.to_sparse_coo()
        self.stats.setdefault(name, TensorStats("sparse", res.algorithm, route.reason)).record(res.algorithm, nbytes)
        return nbytes

    def _sync_topk(self, name: str, param: nn.Parameter, route: Route) -> int:
        """Average one dense gradient through :func:`colltune.topk_allreduce`; return the bytes this rank sent."""
        grad = param.grad
        if grad is None:
            grad = param.grad = torch.zeros_like(param)
        if grad.is_sparse:
            grad = param.grad = grad.to_dense()
        st = self.topk_states.get(name)
        if st is None or (st.residual is not None and st.residual.numel() != grad.numel()):
            knobs = {**self.topk_options, **dict(route.state_knobs)}
            st = self.topk_states[name] = new_topk_state(self.density, knobs)
        res: Any = _api.topk_allreduce(
            grad,
            st,
            op="avg",
            group=self.group,
            algorithm=route.algorithm,
            knobs=dict(route.knobs) or None,
            name=name,
            policy=self._policy_arg if route.algorithm == AUTO else None,
        )
        grad.copy_(res.to_dense())
        nbytes = topk_bytes_sent(res)
        self.stats.setdefault(name, TensorStats("topk", res.algorithm, route.reason)).record(res.algorithm, nbytes)
        return nbytes

    def _sync_dense(self, items: list[tuple[str, nn.Parameter]], p: int) -> int:
        """Average the dense gradients in buckets of one allreduce each; return the bytes this rank sent."""
        if not items or p == 1:
            for name, _ in items:
                self.stats.setdefault(name, TensorStats("dense", "dense", "allreduce")).record("dense", 0)
            return 0
        return sum(self._reduce_dense_bucket(bucket, p) for bucket in self._dense_buckets(items))

    def _dense_buckets(self, items: list[tuple[str, nn.Parameter]]) -> list[list[tuple[str, nn.Parameter]]]:
        """Group consecutive parameters of one dtype and device into buckets of about ``bucket_cap_mb``."""
        cap = int(self.bucket_cap_mb * 2**20)
        buckets: list[list[tuple[str, nn.Parameter]]] = []
        size = 0
        for item in items:
            param = item[1]
            nbytes = param.numel() * param.element_size()
            last = buckets[-1] if buckets else None
            if (last is None or size + nbytes > cap or last[0][1].dtype != param.dtype
                    or last[0][1].device != param.device):
                buckets.append([item])
                size = nbytes
            else:
                last.append(item)
                size += nbytes
        return buckets

    def _reduce_dense_bucket(self, bucket: list[tuple[str, nn.Parameter]], p: int) -> int:
        """Average one bucket's gradients in one allreduce and put them back; return the bytes this rank sent.

        One flag per parameter rides along, so a gradient that is ``None``
        on every rank stays ``None`` everywhere.
        """
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
        all_reduce_queued(flat, self.group, async_op=False)
        flat[:numel].div_(p)
        nbytes = ring_bytes(flat.numel(), flat.element_size(), p)
        present = flat[numel:].tolist()  # one host read for the bucket's flags
        pos = 0
        for i, (name, param) in enumerate(bucket):
            n = param.numel()
            if present[i] > 0:
                view = flat[pos : pos + n].view_as(param)
                if param.grad is None or param.grad.is_sparse:
                    param.grad = view.clone()
                else:
                    param.grad.copy_(view)
            pos += n
            share = nbytes * n // max(1, numel)
            self.stats.setdefault(name, TensorStats("dense", "dense", "allreduce")).record("dense", share)
        return nbytes

    # -- turning it on
    def attach(self, *optimizers: torch.optim.Optimizer) -> Any:
        """Synchronize once per step, before the first of ``optimizers`` steps (SparseAdam + Adam: pass both).

        A step's synchronization runs at the first ``step()`` of any of the
        optimizers after backward (unless :meth:`synchronize` already ran),
        and not again until the next backward or until every attached
        optimizer has stepped. An optimizer that was *not* passed and steps a
        tracked parameter whose gradient is not synchronized yet raises
        :class:`ColltuneValueError` before it changes anything, instead of
        letting the ranks drift apart.

        Not under ``torch.amp.GradScaler``: it unscales and checks the
        gradients for infs before it steps, so a step it makes with the
        gradients not yet averaged raises :class:`ColltuneValueError`, with
        no collective, on every rank that steps (a rank that overflows alone
        skips its step and its synchronization, and raises at its next).
        Average first: :meth:`attach_to_backward`, or :meth:`synchronize`
        right after backward.

        Returns:
            A handle whose ``remove()`` detaches the synchronizer from these optimizers.
        """
        if not optimizers:
            raise ColltuneTypeError("attach() needs at least one optimizer, e.g. sync.attach(optimizer).")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise ColltuneTypeError(f"optimizers must be torch.optim.Optimizer objects, but got {type(opt).__name__}.")
        handles: list[Any] = []
        for opt in optimizers:
            if opt in self._attached:
                continue
            self._attached.append(opt)
            handles += [opt.register_step_pre_hook(_weakly(self._before_step)),
                        opt.register_step_post_hook(_weakly(self._after_step))]
        if not self._grad_hooks:
            self._grad_hooks = [param.register_post_accumulate_grad_hook(_weakly(self._on_gradient))
                                for _, param, _ in self._params]
            self._handles.extend(self._grad_hooks)
        if self._guard is None:
            self._guard = _install_guard(self)
            self._handles.append(self._guard)
        self._handles.extend(handles)
        return _Handles(handles, on_remove=lambda: self._forget(optimizers))

    def _before_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if not self._synced:
            if _under_grad_scaler():  # raised here, with no collective: a rank whose gradients overflowed
                # skipped this step and is not here to exchange a check (it raises at its next step)
                raise ColltuneValueError(_SCALED_FIRST, argument="optimizers")
            self.synchronize()
        self.wait()

    def _after_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._stepped.add(id(opt))
        if all(id(o) in self._stepped for o in self._attached):
            self._synced = False  # every attached optimizer has stepped: the next step synchronizes again
            self._stepped.clear()

    def _on_gradient(self, param: torch.Tensor) -> None:
        self._dirty.add(id(param))
        if self._synced:  # a new backward: its gradients are not synchronized yet
            self._synced = False
            self._stepped.clear()

    def _steps_tracked(self, opt: Any) -> bool:
        """Whether ``opt`` steps one of the synchronizer's parameters."""
        tracked = {id(param) for _, param, _ in self._params}
        return any(id(p) in tracked for group in opt.param_groups for p in group["params"])

    def _forget(self, optimizers: tuple[Any, ...]) -> None:
        self._attached = [o for o in self._attached if all(o is not x for x in optimizers)]
        if not self._attached:
            for h in self._grad_hooks + ([self._guard] if self._guard is not None else []):
                h.remove()
            self._grad_hooks, self._guard = [], None

    def _check_unattached(self, opt: Any) -> None:
        """Raise when ``opt`` (not attached) would step a tracked parameter whose gradient is not synchronized."""
        if not self._dirty or any(opt is o for o in self._attached):
            return
        mine = {id(p): n for n, p, sparse in self._params if sparse or self.dense != "skip"}
        stale = [mine[id(p)] for g in opt.param_groups for p in g["params"] if id(p) in mine and id(p) in self._dirty]
        if stale:
            raise ColltuneValueError(
                f"{type(opt).__name__}.step() would update {', '.join(stale[:5])} with gradients that are not "
                f"synchronized across ranks: SparseGradSync is attached to "
                f"{', '.join(type(o).__name__ for o in self._attached)}, which steps later, so the ranks would "
                "drift apart. Pass every optimizer that steps the model: sync.attach(opt1, opt2), or call "
                "sync.synchronize() before the first step."
            )

    def attach_to_backward(self, async_op: bool = False) -> Any:
        """Synchronize at the end of every backward pass (no gradient accumulation across backwards).

        Every rank must produce a gradient for at least one tracked parameter
        in each backward, or the ranks that did would wait for the others.

        Args:
            async_op: start the sparse gradients' reduction at the end of
                backward and return at once (:meth:`synchronize` with
                ``async_op``): it runs on colltune's own group and thread,
                beside DDP's last buckets and whatever the loop does before
                ``optimizer.step()``, which waits for it (so does :meth:`wait`).
                On NCCL, a collective the loop issues meanwhile (a loss
                all-reduced for logging) may reach the GPU before colltune's
                on one rank and after them on another, which NCCL does not
                promise to complete: :meth:`wait` before it.

        Returns:
            A handle whose ``remove()`` detaches the synchronizer again.
        """
        from torch.autograd import Variable

        if async_op and self._guard is None:
            self._guard = _install_guard(self)
            self._handles.append(self._guard)
        self._async_op = async_op  # the mode a rank that joins before its first backward shadows in

        ref = weakref.ref(self)  # the parameters' hooks must not keep the synchronizer (and its model) alive

        def done() -> None:
            target = ref()
            if target is not None:
                target._queued = False
                target.synchronize(async_op=async_op)

        def hook(param: torch.Tensor) -> None:
            target = ref()
            if target is not None and not target._queued:
                target._queued = True
                Variable._execution_engine.queue_callback(done)

        handles = [param.register_post_accumulate_grad_hook(hook) for _, param, _ in self._params]
        self._handles.extend(handles)
        return _Handles(handles, on_remove=lambda: self._forget(()))  # the handle keeps the synchronizer alive

    def detach(self) -> None:
        """Remove every hook :meth:`attach` and :meth:`attach_to_backward` installed."""
        self.wait()  # a pending asynchronous synchronization lands first
        _remove_hooks(self._handles)
        self._grad_hooks, self._guard, self._attached, self._misused = [], None, [], None

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return options, step, residuals, thresholds and decisions as plain data and tensors (no process group)."""
        self.wait()
        return {
            "version": STATE_VERSION,
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
        check_state_dict(d, "sync")
        names = {n for n, _, _ in self._params}
        unknown = sorted(set(d["topk"]) - names)
        if unknown:
            raise ColltuneValueError(
                f"state_dict holds top-k state for parameters {unknown[:5]} that this synchronizer does not "
                "track; load it into a synchronizer built on the same model."
            )
        self.step = int(d["step"])
        self.algorithm = check_choice("algorithm", d["algorithm"], sparse_algorithms())
        self.dense = check_choice("dense", d["dense"], _DENSE_MODES)
        self.density = check_density(d["density"])
        self.start_compression_iter = check_int("start_compression_iter", d["start_compression_iter"], 0)
        self.min_compress_numel = check_int("min_compress_numel", d["min_compress_numel"], 1)
        self.topk_algorithm = check_choice("topk_algorithm", d["topk_algorithm"], topk_algorithms())
        self.topk_options = dict(d["topk_options"])
        self.topk_states = {k: restore_topk_state(v) for k, v in d["topk"].items()}
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
    """Removes a group of hooks at once (then calls ``on_remove``, if given)."""

    __slots__ = ("_handles", "_on_remove")

    def __init__(self, handles: Iterable[Any], on_remove: Callable[[], None] | None = None) -> None:
        self._handles = list(handles)
        self._on_remove = on_remove

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._on_remove is not None:
            self._on_remove()
            self._on_remove = None


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """Return a hook that calls ``method`` while its object lives, without keeping the object alive.

    A parameter's or optimizer's hooks live as long as the parameter or the
    optimizer; a hook holding the synchronizer would hold its model too (the
    parameters hold the hooks in C++, where the cycle collector cannot see
    the loop), so a synchronizer dropped without :meth:`SparseGradSync.detach`
    would never be freed. A freed synchronizer removes its hooks
    (:func:`_remove_hooks`, by ``weakref.finalize``), as a dropped DDP stops reducing.
    """
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call


#: Why a step under ``GradScaler`` is refused when the synchronizer averages at the optimizer's step (``attach``).
_SCALED_FIRST = (
    "optimizer.step() was called by GradScaler.step(), which had unscaled this rank's own gradients and checked "
    "them for infs before SparseGradSync averaged them: a rank whose gradients overflow skips its step (and its "
    "synchronization) while the others step, and the ranks go apart. Average first: sync.attach_to_backward() "
    "in place of sync.attach(optimizer), or sync.synchronize() right after backward, before scaler.unscale_() "
    "and scaler.step().")
#: ... and when an asynchronous synchronization was still reducing them.
_SCALED_IN_FLIGHT = (
    "GradScaler.step() unscaled and checked the gradients while an asynchronous synchronization "
    "(async_op=True) was still reducing them, so it read this rank's own, and the averaged gradients it "
    "stepped on were never unscaled. Call sync.wait() before scaler.unscale_() and scaler.step(), or "
    "synchronize with async_op=False.")


def _under_grad_scaler(depth: int = 16) -> bool:
    """Whether an enabled ``torch.amp.GradScaler`` (or a subclass) is stepping the optimizer: its ``step`` (or
    ``_maybe_opt_step``) is among the callers of the optimizer's step hooks.

    Not FSDP's ``ShardedGradScaler``: it all-reduces its inf checks, so every rank skips alike. Not a
    scaler built with ``enabled=False`` (or for CUDA where there is none): it steps as if absent.
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name in ("step", "_maybe_opt_step"):
            scaler = frame.f_locals.get("self")
            if isinstance(scaler, torch.amp.GradScaler):
                return scaler.is_enabled() and type(scaler).__name__ != "ShardedGradScaler"
        frame = frame.f_back
    return False


def _remove_hooks(handles: list[Any]) -> None:
    """Remove every hook in ``handles`` and empty it (removing a removed hook does nothing)."""
    for h in handles:
        h.remove()
    handles.clear()


def _install_guard(sync: SparseGradSync) -> Any:
    """Check every optimizer step of the process against ``sync`` (held weakly); return the hook's handle."""
    ref = weakref.ref(sync)

    def guard(opt: Any, args: Any, kwargs: Any) -> None:
        target = ref()
        if target is not None:
            if target._pending is not None and target._steps_tracked(opt) and _under_grad_scaler():
                # It read them in flight: every rank raises at the next step, in its check (a rank that
                # overflowed skipped this optimizer step, but not the next synchronization).
                target._misused = ColltuneValueError(_SCALED_IN_FLIGHT, argument="optimizers")
            target.wait()  # an asynchronous synchronization lands before any optimizer reads the gradients
            target._check_unattached(opt)

    return register_optimizer_step_pre_hook(guard)


class _JoinShadow(JoinHook):
    """What a rank that has joined runs for a :class:`SparseGradSync` (``torch.distributed.algorithms.join``)."""

    def __init__(self, sync: SparseGradSync) -> None:
        self.sync = sync

    def main_hook(self) -> None:
        """Shadow one synchronization of the ranks still training."""
        self.sync._shadow()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: make the replicas equal."""
        self.sync._sync_final_model(is_last_joiner)


def _broadcast_tensors(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None, root: int, what: str,
                       bucket_bytes: int = 250 * 2**20) -> None:
    """Copy ``named`` tensors (sparse and empty ones skipped) of the group's rank ``root`` to every rank, in buckets.

    Raises:
        RankMismatchError: on every rank, when ranks hold tensors of different names, shapes, dtypes or kinds
            of device (``what`` names the copy).
    """
    tensors = [(n, t) for n, t in named if t.numel() and not t.is_sparse]
    plan = [[n, list(t.shape), dtype_name(t.dtype) if t.is_floating_point() else str(t.dtype), t.device.type]
            for n, t in tensors]
    _api.drain()  # on the group from this thread: colltune's queued calls go first on every rank
    check_same_plan(["broadcast", root, plan], group, what)
    src = root if group is None else dist.get_global_rank(group, root)
    buckets: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.dtype, torch.device], int] = {}  # bytes in each kind's last bucket
    for _, t in tensors:
        kind, nbytes = (t.dtype, t.device), t.numel() * t.element_size()
        runs = buckets.setdefault(kind, [[]])
        if runs[-1] and filled[kind] + nbytes > bucket_bytes:
            runs.append([])
            filled[kind] = 0
        runs[-1].append(t)
        filled[kind] = filled.get(kind, 0) + nbytes
    with torch.no_grad():
        for runs in buckets.values():
            for run in runs:
                flat = torch.cat([t.detach().reshape(-1) for t in run])
                dist.broadcast(flat, src=src, group=group)
                for t, piece in zip(run, torch.split(flat, [t.numel() for t in run])):
                    t.copy_(piece.view_as(t))
