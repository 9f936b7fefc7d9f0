"""The front door: ``sparse_allreduce`` and ``topk_allreduce``.

Both are collective: every rank of ``group`` calls them, in the same order,
with the same size, dtype, op and algorithm. Each call

1. validates the arguments locally (a clear error naming the argument),
2. exchanges one small metadata record per rank, so that every rank knows
   every rank's entry count and a rank whose arguments disagree, or whose
   input was invalid, makes *every* rank raise instead of hanging,
3. resolves ``algorithm="auto"`` from data every rank shares, so all ranks
   run the same algorithm,
4. runs the algorithm and returns a result that is bitwise identical on
   every rank.

Example:
    >>> import torch, tuner
    >>> res = tuner.sparse_allreduce(torch.tensor([3, 1, 3]), torch.ones(3), size=8)
    >>> res.indices.tolist(), res.values.tolist()
    ([1, 3], [1.0, 2.0])
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

import algorithms
from algorithms import _meta
from algorithms._comm import Comm, Traffic
from algorithms._sparse import INDEX_DTYPES, VALUE_DTYPES, accum_dtype, coalesce
from algorithms.allgather import eager_slot, slot_need
from algorithms.base import SparseInput, SparseResult
from algorithms.errors import ColltuneTypeError, ColltuneValueError
from algorithms.state import TopkState
from tuner.features import sketch_hashes

__all__ = ["sparse_allreduce", "topk_allreduce", "SparseResult", "TopkResult", "AsyncHandle", "OPS"]

logger = logging.getLogger(__name__)

#: Supported reduction ops.
OPS: tuple[str, ...] = ("sum", "avg")

_KIND_SPARSE, _KIND_TOPK = "sparse", "topk"
#: Bytes of the eager slot an overlap sketch takes on the first auto call at a site (256 hashes).
_SKETCH_BYTES = 1024

# Register every name a metadata record may carry, so that a rank can name
# what another rank sent in an error message, even values it never used.
for _name in (_KIND_SPARSE, _KIND_TOPK, "auto", *OPS, *algorithms.names()):
    _meta.name_code(_name)
for _dtype in VALUE_DTYPES:
    _meta.name_code(str(_dtype).replace("torch.", ""))


# --------------------------------------------------------------------------- async


class AsyncHandle:
    """The pending result of a call made with ``async_op=True``.

    Calls run in submission order on one worker thread per process, so ranks
    issue their collectives in the same order; a synchronous call made while
    asynchronous ones are pending waits its turn behind them.
    """

    __slots__ = ("_future", "_torch_future")

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future
        self._torch_future: torch.futures.Future = torch.futures.Future()

        def _done(f: concurrent.futures.Future) -> None:
            exc = f.exception()
            if exc is not None:
                self._torch_future.set_exception(exc)
            else:
                self._torch_future.set_result(f.result())

        future.add_done_callback(_done)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the call finished; return its result or raise its error."""
        return self._future.result(timeout)

    def is_completed(self) -> bool:
        """Return whether the call has finished."""
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        """Return a ``torch.futures.Future`` completed with the result (for DDP hooks)."""
        return self._torch_future


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_pending = 0
_lock = threading.Lock()


def _submit(fn: Callable[[], Any], async_op: bool) -> Any:
    global _executor, _pending
    with _lock:
        if not async_op and _pending == 0:
            run_inline = True
        else:
            run_inline = False
            if _executor is None:
                _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="colltune")
            _pending += 1
    if run_inline:
        return fn()

    def _task() -> Any:
        global _pending
        try:
            return fn()
        finally:
            with _lock:
                _pending -= 1

    future = _executor.submit(_task)  # type: ignore[union-attr]
    return AsyncHandle(future) if async_op else future.result()


# --------------------------------------------------------------------------- validation


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


_VALUE_NAMES = ", ".join(_dtype_name(d) for d in VALUE_DTYPES)


def _check_common(op: Any, algorithm: Any) -> None:
    if op not in OPS:
        raise ColltuneValueError(f"op must be one of {', '.join(OPS)}, but got {op!r}.")
    if algorithm != "auto":
        algorithms.get(algorithm)


def _comm_device(group: dist.ProcessGroup | None, hint: Any) -> torch.device:
    if isinstance(hint, torch.Tensor):
        return hint.device
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_backend_device(group: dist.ProcessGroup | None, device: torch.device, argument: str) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl" and device.type != "cuda":
        raise ColltuneValueError(
            f"{argument} is on {device}, but the group's backend is NCCL, which moves CUDA tensors only; "
            f"move it with {argument}.cuda()."
        )


def _validate_sparse(
    indices: Any, values: Any, size: Any, op: Any, algorithm: Any, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, ...]]:
    """Check the arguments of ``sparse_allreduce``; return indices, values as ``[k, r]``, n and the row shape."""
    _check_common(op, algorithm)
    if not isinstance(indices, torch.Tensor):
        raise ColltuneTypeError(f"indices must be a torch.Tensor of int32 or int64, but got {type(indices).__name__}.")
    if not isinstance(values, torch.Tensor):
        raise ColltuneTypeError(f"values must be a torch.Tensor, but got {type(values).__name__}.")
    if indices.dtype not in INDEX_DTYPES:
        hint = " (indices must be whole row numbers)" if indices.is_floating_point() else ""
        raise ColltuneTypeError(
            f"indices must have dtype int32 or int64, but got {_dtype_name(indices.dtype)}{hint}; "
            "convert them with indices.long()."
        )
    if indices.dim() != 1:
        raise ColltuneValueError(
            f"indices must be 1-D (one row index per entry), but got shape {tuple(indices.shape)}; "
            "for a COO tensor pass its row indices, e.g. t.indices()[0]."
        )
    if values.dtype not in VALUE_DTYPES:
        raise ColltuneTypeError(
            f"values must have one of the dtypes {_VALUE_NAMES}, but got {_dtype_name(values.dtype)}; "
            "convert them with values.float()."
        )
    if values.dim() == 0:
        raise ColltuneValueError(
            "values must have shape [k] or [k, *row_shape], one row per index, but got a 0-d tensor."
        )
    if values.shape[0] != indices.shape[0]:
        raise ColltuneValueError(
            f"indices and values must have the same length (one value row per index), but got "
            f"{indices.shape[0]} indices and {values.shape[0]} value rows."
        )
    if indices.device != values.device:
        raise ColltuneValueError(
            f"indices and values must be on the same device, but got {indices.device} and {values.device}."
        )
    _check_backend_device(group, values.device, "values")
    row_shape = tuple(values.shape[1:])
    if isinstance(size, (tuple, list, torch.Size)):
        shape = tuple(size)
        if not shape or any(isinstance(s, bool) or not isinstance(s, int) for s in shape):
            raise ColltuneTypeError(f"size must be an int or a shape (n, *row_shape) of ints, but got {size!r}.")
        if shape[1:] != row_shape:
            raise ColltuneValueError(
                f"values rows have shape {row_shape}, but size {shape} says rows of shape {shape[1:]}; "
                f"pass size=({shape[0]}, *values.shape[1:]) or reshape values."
            )
        n = shape[0]
    elif isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        raise ColltuneTypeError(f"size must be an int (the number of dense rows), but got {size!r}.")
    if n < 1:
        raise ColltuneValueError(f"size must be >= 1, but got {n}.")
    if indices.numel():
        lo, hi = torch.aminmax(indices)
        lo, hi = int(lo), int(hi)
        if lo < 0:
            raise ColltuneValueError(
                f"indices must be in [0, size) = [0, {n}), but got a negative index {lo}; "
                "wrap negative indices with indices % size if they count from the end."
            )
        if hi >= n:
            raise ColltuneValueError(
                f"indices must be in [0, size) = [0, {n}), but got index {hi}; pass a larger size or fix the indices."
            )
    return indices, values.reshape(values.shape[0], int(torch.Size(row_shape).numel())), n, row_shape


# --------------------------------------------------------------------------- auto


def _selector_module() -> Any:
    # Imported on the first auto call: explicit algorithms never load policies or profiles.
    from tuner import selector

    return selector


def _backend_name(group: dist.ProcessGroup | None) -> str:
    """Return the group's backend (``gloo``, ``nccl``...), or ``local`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return "local"
    return str(dist.get_backend(group)).lower()


def _check_name(name: Any) -> None:
    if name is not None and not isinstance(name, str):
        raise ColltuneTypeError(
            f"name must be a str (the tensor's name, for policy rules and decision caching) or None, "
            f"but got {type(name).__name__}."
        )


def _policy_code(sel: Any, backend: str, name: str | None) -> int:
    """Return what the metadata record's ``policy`` field carries for an auto call.

    The selector's digest (policy, ``COLLTUNE_ALGO``, profile, settings) with
    the tensor name folded in: ranks that would decide differently disagree
    on this number, so every rank raises instead of hanging.
    """
    code = sel.digest(backend)
    if name is not None:
        code ^= _meta.name_code(name) << 20
    code &= (1 << 64) - 1
    return code - (1 << 64) if code >= (1 << 63) else code


#: Per registered algorithm object: its default knobs, checked, and their code in the record.
_DEFAULT_KNOBS: dict[Any, tuple[dict[str, Any], int]] = {}


def _resolve(
    algorithm: str, knobs: dict[str, Any] | None, policy: Any, group: dist.ProcessGroup | None, name: Any
) -> tuple[dict[str, Any] | None, Any, str | None, int]:
    """Check ``name`` and resolve the request before the metadata exchange.

    Returns ``(knobs, selector, backend, code)``: the checked knobs of an
    explicit algorithm (``None`` for ``auto``, decided after the exchange),
    the selector and backend for ``auto`` (else ``None``), and the code the
    record's ``policy`` field carries (for an explicit algorithm, a digest
    of its knobs).
    """
    _check_name(name)
    if algorithm != "auto":
        algo = algorithms.get(algorithm)
        if not knobs:
            # The defaults' code, made once per algorithm (the common case; a few us per call otherwise).
            default = _DEFAULT_KNOBS.get(algo)
            if default is None:
                checked = algo.check_knobs(None)
                default = _DEFAULT_KNOBS[algo] = (checked, _meta.name_code(repr(sorted(checked.items()))))
            return dict(default[0]), None, None, default[1]
        checked = algo.check_knobs(knobs)
        # Knobs change the schedule (which messages, which refreshes): ranks
        # that pass different ones disagree on this code and raise.
        return checked, None, None, _meta.name_code(repr(sorted(checked.items())))
    sel = _selector_module().selector_for(policy)
    backend = _backend_name(group)
    return None, sel, backend, _policy_code(sel, backend, name)


def _decided_knobs(decision: Any, knobs: dict[str, Any] | None) -> dict[str, Any]:
    """Return the knobs of the selector's choice: the policy's, overridden by the caller's."""
    return algorithms.get(decision.algorithm).check_knobs({**decision.knobs, **knobs} if knobs else decision.knobs)


def _group_key(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else id(group)


# --------------------------------------------------------------------------- sparse_allreduce


def sparse_allreduce(
    indices: torch.Tensor,
    values: torch.Tensor,
    size: int | Sequence[int],
    op: str = "sum",
    group: dist.ProcessGroup | None = None,
    algorithm: str = "auto",
    async_op: bool = False,
    *,
    knobs: dict[str, Any] | None = None,
    name: str | None = None,
    policy: Any = None,
) -> SparseResult | AsyncHandle:
    """Sum a sparse tensor over the ranks of ``group``; every rank gets the same result.

    Args:
        indices: 1-D int32 or int64 row indices, any order, duplicates allowed
            (they are summed).
        values: ``[k]`` or ``[k, *row_shape]``, one row per index; float32,
            float64, float16 or bfloat16 (16-bit types are summed in fp32).
        size: the number of dense rows ``n``, or the dense shape ``(n, *row_shape)``.
        op: ``sum`` or ``avg`` (the sum divided by the world size).
        group: the process group; ``None`` for the default group. Without an
            initialized process group the call is local (world size 1).
        algorithm: ``auto``, ``dense``, ``allgather`` or ``oktopk``.
        async_op: return an :class:`AsyncHandle` instead of waiting.
        knobs: options of the chosen algorithm, e.g. ``{"mode": "alltoall"}``
            for ``allgather``; unknown names are rejected. With ``auto`` they
            are applied on top of the policy's knobs for the algorithm chosen.
        name: the tensor's name: policy rules match it (globs), and
            decisions are cached per name (calls without one share a cache
            per size, row shape and dtype). Must be the same on every rank.
        policy: for ``auto``: a :class:`tuner.policy.Policy`, a policy file
            path or a :class:`tuner.Selector`; ``None`` uses the process-wide
            selector (:func:`tuner.configure`, else the environment and the
            profile shipped for the backend).

    Returns:
        A :class:`SparseResult`: int64 indices (sorted, unique: the union of
        all ranks' indices) and their summed values, bitwise identical on
        every rank; or an :class:`AsyncHandle` whose ``wait()`` returns it.

    Raises:
        ColltuneTypeError, ColltuneValueError: this rank's arguments are invalid.
        RemoteInputError: another rank's arguments are invalid.
        RankMismatchError: ranks disagree on size, row shape, dtype, op or
            algorithm, or (``auto``) on the policy, profile or name.

    Example:
        >>> res = tuner.sparse_allreduce(idx, vals, size=1_000_000, op="avg")  # doctest: +SKIP
        >>> grad = res.to_dense()  # doctest: +SKIP
    """
    return _submit(
        lambda: _sparse_allreduce(indices, values, size, op, group, algorithm, knobs, name, policy), async_op
    )


def _sparse_allreduce(
    indices: Any,
    values: Any,
    size: Any,
    op: Any,
    group: Any,
    algorithm: Any,
    knobs: dict[str, Any] | None,
    name: Any = None,
    policy: Any = None,
) -> SparseResult:
    comm = Comm(group, _comm_device(group, values))
    error: BaseException | None = None
    record: dict[str, int] = {"kind": _meta.name_code(_KIND_SPARSE)}
    sel: Any = None
    likely: str | None = None  # the algorithm whose payload the record carries
    try:
        idx, vals, n, row_shape = _validate_sparse(indices, values, size, op, algorithm, group)
        knobs_checked, sel, backend, code = _resolve(algorithm, knobs, policy, group, name)
        idx, vals = coalesce(idx, vals, accum_dtype(values.dtype))
        record.update(
            size=n,
            row_numel=vals.shape[1],
            **_meta.shape_fields(row_shape),
            dtype=_meta.name_code(_dtype_name(values.dtype)),
            op=_meta.name_code(op),
            algorithm=_meta.name_code(algorithm),
            policy=code,
            count=idx.numel(),
        )
        site = (_KIND_SPARSE, name, n, vals.shape[1], values.dtype, comm.world_size, _group_key(group))
        # The eager slot of the metadata record carries, in order: the
        # payload of the algorithm likeliest to run (its own metadata, e.g.
        # Ok-Topk's counts per region), on the first auto call at a site a
        # sketch of the indices (the selector estimates the overlap from it
        # without a collective of its own), and this rank's first entries
        # (allgather then needs no second collective).
        slot, eager, sketch_bytes, payload_bytes = None, _meta.EAGER_NONE, 0, 0
        if comm.world_size > 1:
            cap = _meta.slot_bytes(comm)
            likely = sel.last_choice(site) if sel is not None else algorithm
            parts: list[np.ndarray] = []
            if likely is not None and likely != "allgather":
                own = algorithms.get(likely).eager_payload(
                    idx, n, comm, None if sel is not None else knobs_checked, cap
                )
                if own is not None:
                    parts.append(own)
                    payload_bytes = int(own.size)
            if algorithm in ("auto", "allgather"):
                room = cap - payload_bytes
                if sel is not None and sel.wants_sketch(site, backend):
                    # The sketch (1 KiB: 256 hashes), then as many entries as still fit.
                    sketch_bytes, eager = min(room, _SKETCH_BYTES), _meta.EAGER_SKETCH
                    sketch = np.zeros(sketch_bytes, dtype=np.uint8)
                    hashes = sketch_hashes(idx, sketch_bytes, sel.bitmap_seed).view(np.uint8)
                    sketch[: hashes.size] = hashes
                    parts.append(sketch)
                else:
                    eager = _meta.EAGER_ENTRIES
                entries = eager_slot(idx.to(comm.device), vals.to(comm.device), n, values.dtype,
                                     room - sketch_bytes)
                parts.append(entries if isinstance(entries, np.ndarray) else entries.cpu().numpy())
            if parts:
                slot = parts[0] if len(parts) == 1 else np.concatenate(parts)
        record["eager"], record["payload"] = eager, payload_bytes
    except (TypeError, ValueError) as exc:
        error, slot, eager, sketch_bytes, payload_bytes = exc, None, _meta.EAGER_NONE, 0, 0
    records, slots = _meta.exchange(comm, record, error, slot)
    counts = tuple(rec["count"] for rec in records)
    entries_at = payload_bytes + sketch_bytes
    has_entries = eager in (_meta.EAGER_ENTRIES, _meta.EAGER_SKETCH)
    if sel is None:
        decision: Any = None
    else:
        sketches = None
        if eager == _meta.EAGER_SKETCH:
            table = slots[:, payload_bytes:entries_at].cpu().contiguous().numpy().view(np.uint32)  # type: ignore[index]
            sketches = [table[r, : min(c, table.shape[1])] for r, c in enumerate(counts)]
        decision = sel.decide_sparse(
            site, comm=comm, backend=backend, name=name, size=n, row_numel=vals.shape[1],
            dtype=values.dtype, counts=counts, indices=idx, sketches=sketches,
        )
        algorithm = decision.algorithm
        knobs_checked = _decided_knobs(decision, knobs)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("sparse_allreduce: n=%d k_max=%d k_sum=%d P=%d -> %s", n, max(counts), sum(counts),
                         comm.world_size, algorithm)
    eager_entries = slots[:, entries_at:] if has_entries else None  # type: ignore[index]
    # The payload belongs to the algorithm that made it: another one chosen meanwhile does not get it.
    payload = slots[:, :payload_bytes] if payload_bytes and algorithm == likely else None  # type: ignore[index]
    inp = SparseInput(idx, vals, n, row_shape, values.dtype, counts, eager_entries, op, payload)
    # Size the next call's eager slot from this one: the same records and
    # decision on every rank, so every rank sizes it alike.
    _meta.note_slot_use(
        comm,
        slot_need(counts, inp.row_numel, n, values.dtype) + payload_bytes if algorithm == "allgather" and has_entries
        else 0,
    )
    acc = inp.acc_dtype
    if inp.k_sum == 0:
        out_idx = torch.empty(0, dtype=torch.int64, device=comm.device)
        out_vals = torch.empty((0, inp.row_numel), dtype=acc, device=comm.device)
    else:
        algo = algorithms.get(algorithm)
        out_idx, out_vals = algo.sparse_allreduce(inp, comm, knobs_checked)
        if op == "avg" and not algo.applies_avg and comm.world_size > 1:
            # In place: an algorithm's result shares no memory with its input (checked, for registered ones).
            shared = out_vals.untyped_storage().data_ptr() in (
                vals.untyped_storage().data_ptr(), values.untyped_storage().data_ptr()
            )
            out_vals = out_vals / comm.world_size if shared else out_vals.div_(comm.world_size)
    if sel is not None:
        sel.observe_sparse(site, counts, out_idx.numel())
    out_vals = out_vals.to(values.dtype).reshape((out_idx.numel(),) + row_shape)
    return SparseResult(out_idx, out_vals, n, algorithm, comm.traffic, decision)


# --------------------------------------------------------------------------- topk_allreduce


@dataclass
class TopkResult:
    """The reduced top-k selection, identical on every rank.

    Attributes:
        indices: flat int64 indices of the reduced entries (sorted, unique),
            or ``None`` when the algorithm sent the tensor dense.
        values: the reduced values at ``indices`` (``avg`` already applied),
            or the whole reduced tensor, flat, when ``indices`` is ``None``.
        shape: the shape of the input tensor.
        algorithm: the algorithm that ran.
        local_count: entries this rank selected.
        global_count: entries in the result.
        sent_indices: flat indices of this rank whose accumulated values were
            delivered (and so left the residual); ``None`` means all.
        traffic: bytes and messages this rank sent.
    """

    indices: torch.Tensor | None
    values: torch.Tensor
    shape: tuple[int, ...]
    algorithm: str
    local_count: int
    global_count: int
    sent_indices: torch.Tensor | None
    traffic: Traffic = field(default_factory=Traffic)
    decision: Any = None

    def to_dense(self) -> torch.Tensor:
        """Return the result as a dense tensor shaped like the input."""
        if self.indices is None:
            return self.values.view(self.shape)
        numel = 1
        for s in self.shape:
            numel *= s
        out = torch.zeros(numel, dtype=self.values.dtype, device=self.values.device)
        out[self.indices] = self.values
        return out.view(self.shape)


def topk_allreduce(
    tensor: torch.Tensor,
    state: TopkState,
    op: str = "avg",
    group: dist.ProcessGroup | None = None,
    algorithm: str = "auto",
    async_op: bool = False,
    *,
    knobs: dict[str, Any] | None = None,
    name: str | None = None,
    policy: Any = None,
) -> TopkResult | AsyncHandle:
    """Sparsify a dense tensor to about k entries per rank and sum the selection over ranks.

    The selection is taken from ``state.residual + tensor``; what is not
    delivered stays in ``state.residual`` for the next call (error feedback),
    so nothing is lost, only delayed.

    Args:
        tensor: a dense floating tensor (e.g. a gradient), same shape on every rank.
        state: this tensor's :class:`TopkState` (one per tensor).
        op: ``avg`` (default, as for gradients) or ``sum``.
        group: the process group; ``None`` for the default group.
        algorithm: ``auto``, ``dense`` (no compression), ``allgather`` (TopkA)
            or ``oktopk``.
        async_op: return an :class:`AsyncHandle` instead of waiting.
        knobs: options of the chosen algorithm (on top of the policy's with ``auto``).
        name: the tensor's name, for policy rules and the decision cache;
            the same on every rank.
        policy: for ``auto``: a policy, a policy file path or a
            :class:`tuner.Selector`; ``None`` for the process-wide selector.

    Returns:
        A :class:`TopkResult` (or a handle to one), identical on every rank.

    Example:
        >>> state = tuner.TopkState(density=0.01)  # doctest: +SKIP
        >>> grad.copy_(tuner.topk_allreduce(grad, state).to_dense())  # doctest: +SKIP
    """
    return _submit(lambda: _topk_allreduce(tensor, state, op, group, algorithm, knobs, name, policy), async_op)


def _validate_topk(tensor: Any, state: Any, op: Any, algorithm: Any, group: Any) -> None:
    _check_common(op, algorithm)
    if not isinstance(tensor, torch.Tensor):
        raise ColltuneTypeError(f"tensor must be a torch.Tensor, but got {type(tensor).__name__}.")
    if tensor.dtype not in VALUE_DTYPES:
        raise ColltuneTypeError(
            f"tensor must have one of the dtypes {_VALUE_NAMES}, but got {_dtype_name(tensor.dtype)}."
        )
    if tensor.numel() == 0:
        raise ColltuneValueError("tensor must have at least one element, but got an empty tensor.")
    if not isinstance(state, TopkState):
        raise ColltuneTypeError(
            f"state must be a tuner.TopkState, but got {type(state).__name__}; create one with "
            "tuner.TopkState(density=0.01) and keep it for this tensor."
        )
    if state.residual is not None and state.residual.numel() != tensor.numel():
        raise ColltuneValueError(
            f"state holds a residual of {state.residual.numel()} elements, but tensor has {tensor.numel()}; "
            "use one TopkState per tensor."
        )
    _check_backend_device(group, tensor.device, "tensor")


def _topk_allreduce(
    tensor: Any,
    state: Any,
    op: Any,
    group: Any,
    algorithm: Any,
    knobs: dict[str, Any] | None,
    name: Any = None,
    policy: Any = None,
) -> TopkResult:
    comm = Comm(group, _comm_device(group, tensor))
    error: BaseException | None = None
    record: dict[str, int] = {"kind": _meta.name_code(_KIND_TOPK)}
    sel: Any = None
    try:
        _validate_topk(tensor, state, op, algorithm, group)
        knobs_checked, sel, backend, code = _resolve(algorithm, knobs, policy, group, name)
        numel = tensor.numel()
        k = state.k_for(numel)
        record.update(
            size=numel,
            row_numel=k,  # k must agree too: it is part of the shared call
            **_meta.shape_fields(tuple(tensor.shape)),
            dtype=_meta.name_code(_dtype_name(tensor.dtype)),
            op=_meta.name_code(op),
            algorithm=_meta.name_code(algorithm),
            policy=code,
            count=k,
        )
    except (TypeError, ValueError) as exc:
        error = exc
    _meta.exchange(comm, record, error)
    _meta.note_slot_use(comm, 0)  # top-k leaves the eager slot empty
    if sel is None:
        decision: Any = None
    else:
        site = (_KIND_TOPK, name, numel, k, tensor.dtype, comm.world_size, _group_key(group))
        decision = sel.decide_topk(
            site, world_size=comm.world_size, rank=comm.rank, backend=backend, name=name, numel=numel, k=k,
            dtype=tensor.dtype,
        )
        algorithm = decision.algorithm
        knobs_checked = _decided_knobs(decision, knobs)
        _apply_state_knobs(state, decision)
    acc_dtype = accum_dtype(tensor.dtype)
    acc = tensor.detach().reshape(-1).to(acc_dtype)
    if state.residual is not None:
        acc = acc + state.residual.to(acc.device)
    else:
        acc = acc.clone()
    out = algorithms.get(algorithm).topk_allreduce(acc, state, comm, knobs_checked)
    if out.sent is None:
        state.residual = torch.zeros_like(acc)
    else:
        residual = acc
        residual[out.sent] = 0
        state.residual = residual
    state.step += 1
    if sel is not None:
        sel.observe_topk(site, algorithm, k, comm.world_size, out.global_count)
    values = out.values / comm.world_size if op == "avg" else out.values
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "topk_allreduce: numel=%d k=%d P=%d -> %s; local %d, global %d",
            numel, k, comm.world_size, algorithm, out.local_count, out.global_count,
        )
    return TopkResult(
        out.indices,
        values.to(tensor.dtype),
        tuple(tensor.shape),
        algorithm,
        out.local_count,
        out.global_count,
        out.sent,
        comm.traffic,
        decision,
    )


def _apply_state_knobs(state: TopkState, decision: Any) -> None:
    """Apply the policy's knobs that live in the top-k state (``oktopk: {local_refresh, global_refresh}``)."""
    for key, value in decision.state_knobs.items():
        if getattr(state, key) != value:
            setattr(state, key, value)
