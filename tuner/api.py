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

Helpers for :mod:`colltune.fused`, which runs these steps for a list of
tensors: :func:`submit_call` (the call queue), :func:`open_comm`,
:func:`outside_compile`, :func:`canonical_op`; the checks
:func:`check_op_and_algorithm`, :func:`group_backend`, :func:`is_sparse_coo`,
:func:`unpack_coo`, :func:`check_sparse_tensor`, :func:`check_dense_fits`,
:func:`first_range_error`, :func:`deferred_fields`, and the errors they
raise, :func:`argument_error` and :func:`input_error`; the decision and the
run, :func:`resolve_request`, :func:`decided_knobs`, :func:`group_key`,
:func:`run_sparse`. They are public inside the front-door layer, not
colltune's user API: ``__all__`` and the package ``colltune`` leave them out.

Example:
    >>> import torch, colltune
    >>> res = colltune.sparse_allreduce(torch.tensor([3, 1, 3]), torch.ones(3), size=8)
    >>> res.indices.tolist(), res.values.tolist()
    ([1, 3], [1.0, 2.0])
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import operator
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from colltune import algorithms
from colltune.algorithms import meta as _meta
from colltune.algorithms.allgather import eager_slot, slot_need
from colltune.algorithms.base import Delivered, Prepared, SparseInput, SparseResult, TopkOutput
from colltune.algorithms.comm import (
    Comm,
    Traffic,
    group_facts,
    group_serial,
    group_timeout,
    private_group,
    ranks_per_node,
)
from colltune.algorithms.errors import (
    AbandonedCallError,
    CollectiveError,
    ColltuneError,
    ColltuneTypeError,
    ColltuneValueError,
)
from colltune.algorithms.sparse import (
    INDEX_DTYPES,
    VALUE_DTYPES,
    Batch,
    accum_dtype,
    cast,
    coalesce,
    on_host,
    shares_storage,
    writable,
)
from colltune.algorithms.state import TopkState
from colltune.model.features import sketch_hashes
from colltune.select import online  # light: the selector itself is imported on the first auto call

__all__ = [
    "sparse_allreduce", "topk_allreduce", "SparseResult", "TopkResult", "AsyncHandle", "OPS", "CallerCheck",
    "check_with_peers",
]

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
    _meta.name_code(_meta.dtype_name(_dtype))


# --------------------------------------------------------------------------- async


def _joined(future: concurrent.futures.Future, handoff: _StreamHandoff | None, timeout: float | None = None) -> Any:
    """Return a queued call's result once the calling thread's stream has joined its kernels (on a GPU)."""
    out = future.result(timeout)
    if handoff is not None:
        handoff.join(out)
    return out


class AsyncHandle:
    """The pending result of a call made with ``async_op=True``.

    Calls run in submission order on one worker thread per process, so ranks
    issue their collectives in the same order; a synchronous call made while
    asynchronous ones are pending waits its turn behind them. When a call
    fails out of step with the other ranks (a peer died, a timeout), the
    calls queued behind it raise :class:`AbandonedCallError` without
    running, so ``wait()`` on every pending handle returns promptly.
    """

    __slots__ = ("_future", "_torch_future", "_handoff")

    def __init__(self, future: concurrent.futures.Future, handoff: _StreamHandoff | None = None) -> None:
        self._future = future
        self._handoff = handoff
        self._torch_future: torch.futures.Future = torch.futures.Future()

        def _done(f: concurrent.futures.Future) -> None:
            try:
                exc, out = f.exception(), None
                if exc is None:  # callbacks queue their kernels on this thread's stream: after the call's
                    out = _joined(f, handoff)
            except BaseException as err:  # noqa: BLE001 - the Future must complete, or a DDP hook waits for ever
                exc = err
            if exc is not None:
                self._torch_future.set_exception(exc)
            else:
                self._torch_future.set_result(out)

        future.add_done_callback(_done)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the call finished; return its result or raise its error.

        On a GPU the calling thread's current stream then waits for the
        call's kernels (no host sync), so what it queues next sees the result.
        """
        return _joined(self._future, self._handoff, timeout)

    def is_completed(self) -> bool:
        """Return whether the call has finished."""
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        """Return a ``torch.futures.Future`` completed with the result (for DDP hooks).

        On a GPU its callbacks run after the completing thread's current
        stream (colltune's worker thread's, or the caller's when the call is
        done first) has joined the call's kernels; the Future itself is not
        CUDA-aware, so a consumer on another stream calls :meth:`wait` (or
        completes a CUDA-aware Future in its callback, as ``colltune_hook`` does).
        """
        return self._torch_future


class _StreamHandoff:
    """Stream order between the caller's thread and colltune's worker thread, for a call on a GPU.

    The worker's kernels go to its current stream of the call's device (the
    default stream), not the caller's, which may be another one (a forward
    pass on a side stream). The caller's stream is marked when the call is
    queued and the worker's stream waits for that mark before the call; the
    worker's stream is marked after it, and :meth:`join` makes the caller's
    stream wait for that. No host sync either way.
    """

    __slots__ = ("device", "queued", "finished", "inputs")

    def __init__(self, device: torch.device, inputs: Any) -> None:
        self.device = device
        self.queued = torch.cuda.Event()
        self.queued.record(torch.cuda.current_stream(device))
        self.finished: Any = None
        #: The tensors the call reads, made on the caller's stream (:func:`_tensors_in` finds them).
        self.inputs = inputs

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread with the call's device current, after the caller's queued work.

        The inputs are then marked as used on the worker's stream: memory the
        caller frees goes back to its own stream's pool, and the allocator
        holds it until the worker's kernels queued so far have run, whenever
        and on whichever thread the last reference goes.
        """
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.queued)
            try:
                return fn()
            finally:
                self.finished = torch.cuda.Event()
                self.finished.record(stream)
                for t in _tensors_in(self.inputs):
                    if t.device == self.device:
                        t.record_stream(stream)
                self.inputs = None

    def join(self, result: Any) -> None:
        """Make the calling thread's current stream of the device wait for the call's kernels.

        The call's ``result``'s tensors, made on the worker's stream, are
        marked as used on this one too, so that the allocator does not hand
        their memory to the worker's stream while this one may still read them.
        """
        if self.finished is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.finished)
        for t in _tensors_in(result):
            if t.device == self.device:
                t.record_stream(stream)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The dense tensors a call's arguments or result hold: in lists, tuples and dataclasses (results, their
    delivered indices); a sparse COO tensor's indices and values."""
    if isinstance(value, torch.Tensor):
        return [value._indices(), value._values()] if is_sparse_coo(value) else [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    fields = getattr(value, "__dataclass_fields__", None)
    if fields is None:
        return []
    return [t for name in fields for t in _tensors_in(getattr(value, name))]


def _on_gpu(device: Any) -> bool:
    """Return whether ``device`` (a call's hint, or anything a bad argument gave) is a CUDA device."""
    return isinstance(device, torch.device) and device.type == "cuda"


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_pending = 0
#: ``active`` is set on colltune's worker thread (when the executor starts it).
_worker = threading.local()
#: The latest call queued on the worker (weakly: not to keep its result): when it is done, so is every call
#: queued before it. The worker holds the Future until the call has run, so a dead reference means done.
_last: weakref.ref[concurrent.futures.Future] | None = None
_lock = threading.Lock()
#: Calls of this process that failed out of step with the other ranks, and the latest such failure.
_out_of_step = 0
_out_of_step_by: BaseException | None = None


#: Backend messages that mean a peer rank is gone or silent (gloo's and NCCL's wording), not a bug in the call.
_PEER_FAILURE = (
    "Connection closed by peer", "Connection reset", "Broken pipe", "Socket closed", "Read error", "Write error",
    "Timed out", "timed out", "pair closure", "NCCL communicator was aborted",
)


def _pg_timeout_s() -> float | None:
    """Return the default group's timeout in seconds, when its backend tells (gloo and NCCL do)."""
    timeout = group_timeout(dist.group.WORLD)
    return None if timeout is None else timeout.total_seconds()


def _collective_error(exc: BaseException) -> CollectiveError | None:
    """Return ``exc`` as a :class:`CollectiveError` when it is the backend's report of a dead or silent peer."""
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if not (isinstance(exc, dist.DistError)
            or (isinstance(exc, RuntimeError) and any(s in said for s in _PEER_FAILURE))):
        return None
    if said.startswith("[") and "] " in said:  # gloo's source location
        said = said.split("] ", 1)[1]
    said = said.split(". ", 1)[0].rstrip(".")[:300]
    timeout = _pg_timeout_s()
    where = f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else "this rank"
    return CollectiveError(
        f"a collective of this call failed on {where}: a peer rank died, or did not answer within the process "
        f"group's timeout{f' ({timeout:g} s)' if timeout is not None else ''}. The backend said: {said}. Look for "
        "the first error in the other ranks' logs. The process group cannot run collectives any more: restart "
        "the job. To give slow peers longer, pass dist.init_process_group(..., "
        "timeout=datetime.timedelta(seconds=...))."
    )


def _run(fn: Callable[[], Any]) -> Any:
    """Run one call; count a failure that may have left this rank out of step with the others."""
    global _out_of_step, _out_of_step_by
    try:
        return fn()
    except CollectiveError as exc:
        # Raised as it is by the set-up of the group's private twin (a peer did not join): out of step.
        with _lock:
            _out_of_step += 1
            _out_of_step_by = exc
        raise
    except ColltuneError:
        raise  # raised by every rank at the same call (the metadata exchange): the ranks stay in step
    except BaseException as exc:
        wrapped = _collective_error(exc)
        with _lock:
            _out_of_step += 1
            _out_of_step_by = wrapped or exc
        if wrapped is not None:
            raise wrapped from exc
        raise


def _abandoned(cause: BaseException) -> AbandonedCallError:
    """Return the error of a queued call dropped because of ``cause``."""
    lines = str(cause).strip().splitlines()
    said = lines[0] if lines else ""
    if said.startswith("[") and "] " in said:  # gloo's source location
        said = said.split("] ", 1)[1]
    said = said.split(". ", 1)[0].rstrip(".")[:300]
    err = AbandonedCallError(
        f"this call was not run: a colltune call queued before it failed ({type(cause).__name__}: {said}) "
        "out of step with the other ranks (a peer rank died, a collective timed out, or this rank raised "
        "where the others did not), so the calls queued behind it were dropped. Wait on the earlier "
        "handle for its error; restart the job (or re-create the process group) before calling "
        "collectives again."
    )
    err.__cause__ = cause
    return err


def submit_call(fn: Callable[[Any], Any], async_op: bool, group: Any, device: Any = None, inputs: Any = None) -> Any:
    """Run ``fn(wire)`` now, or queue it behind the pending calls; return its result, or a handle with ``async_op``.

    ``wire`` is ``group``'s :func:`~colltune.algorithms.comm.private_group`,
    made here, on the calling thread, at the call's place in the caller's
    sequence of calls on the group. ``device`` is where the call's tensors
    are (``None`` when unknown), ``inputs`` the tensors it reads (a list or
    tuple of them, or of tuples): a call queued on a GPU keeps stream order
    with the caller's thread (:class:`_StreamHandoff`).
    """
    global _executor, _pending, _last
    # Making a twin is a collective on the caller's thread: the calls queued on other groups' twins go first.
    wire = _run(lambda: private_group(_exchange_group(group), before_setup=drain))
    with _lock:
        if not async_op and _pending == 0:
            run_inline = True
        else:
            run_inline = False
            if _executor is None:
                _executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="colltune", initializer=lambda: setattr(_worker, "active", True))
            _pending += 1
        seen = _out_of_step
    if run_inline:  # on the caller's thread and stream: no handoff
        return _run(lambda: fn(wire))
    try:
        handoff = _StreamHandoff(device, inputs) if _on_gpu(device) else None
    except BaseException:
        with _lock:
            _pending -= 1
        raise

    def _task() -> Any:
        global _pending
        try:
            with _lock:
                cause = _out_of_step_by if _out_of_step != seen else None
            if cause is not None:
                # A call queued before this one failed after this one was submitted: drop it.
                raise _abandoned(cause)
            if handoff is not None:
                return handoff.run(lambda: _run(lambda: fn(wire)))
            return _run(lambda: fn(wire))
        finally:
            with _lock:
                _pending -= 1

    with _lock:
        future = _executor.submit(_task)  # type: ignore[union-attr]
        _last = weakref.ref(future)
    return AsyncHandle(future, handoff) if async_op else _joined(future, handoff)


def _on_worker() -> bool:
    """Whether this is colltune's worker thread."""
    return getattr(_worker, "active", False)


def drain() -> None:
    """Return once colltune's worker thread has finished every call queued so far, failed ones included.

    Their results and errors stay with their handles. A thread that is about
    to issue collectives of its own on a GPU calls this first where their
    order against colltune's queued ones must be the same on every rank
    (NCCL asks for that of communicators used from several threads). On
    the worker thread itself it returns at once: the calls queued before
    the running one are done, and those after it wait for it.
    """
    if _on_worker():
        return
    with _lock:
        last = _last() if _last is not None else None
    if last is not None:
        concurrent.futures.wait([last])


# --------------------------------------------------------------------------- topology

# --------------------------------------------------------------------------- torch.compile


F = TypeVar("F", bound=Callable[..., Any])


def outside_compile(fn: F) -> F:
    """Have ``torch.compile`` run ``fn``, and everything it calls, as plain Python: one graph break at the call.

    What ``torch.compiler.disable`` does, without importing Dynamo (seconds)
    at import time: Dynamo breaks the graph at a function marked
    ``_torchdynamo_disable`` instead of inlining it, and the frame strategy
    makes it skip ``fn``'s frame and every frame below it. A torch without
    these hooks leaves ``fn`` as it is.
    """
    try:
        from torch._C._dynamo import eval_frame

        skip = eval_frame._FrameAction.SKIP
        eval_frame.set_code_exec_strategy(fn.__code__, eval_frame._FrameExecStrategy(skip, skip))
        fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    except (ImportError, AttributeError, TypeError, RuntimeError):  # pragma: no cover - other torch builds
        pass
    return fn


# --------------------------------------------------------------------------- validation


def argument_error(cls: type[ColltuneError], argument: str, message: str) -> ColltuneError:
    """Return an error about ``argument``; the metadata record carries its name to the other ranks."""
    return cls(message, argument=argument)


#: ``torch.distributed.ReduceOp`` names of the ops in :data:`OPS`.
_REDUCE_OPS = {"SUM": "sum", "AVG": "avg"}


def canonical_op(op: Any) -> Any:
    """Return ``op`` as one of :data:`OPS` when it is ``dist.ReduceOp.SUM`` or ``AVG``; anything else unchanged."""
    if isinstance(op, str):
        return op
    name = getattr(op, "name", None)  # a ReduceOp.RedOpType
    if name is None and isinstance(op, dist.ReduceOp):
        name = next((k for k in _REDUCE_OPS if op == getattr(dist.ReduceOp, k)), None)
    return _REDUCE_OPS.get(name, op) if isinstance(name, str) else op


def check_op_and_algorithm(op: Any, algorithm: Any) -> None:
    """Check ``op`` and ``algorithm``, the arguments both front-door functions take."""
    if not (isinstance(op, str) and op in OPS):
        said = f"ReduceOp.{op.name}" if isinstance(getattr(op, "name", None), str) else repr(op)
        raise argument_error(ColltuneValueError, "op",
                             f"op must be one of {', '.join(repr(o) for o in OPS)} (or dist.ReduceOp.SUM, dist.ReduceOp.AVG), "
                             f"but got {said}; colltune sums (and averages) only: reduce other ops with torch.distributed.")
    if algorithm != "auto":
        try:
            algorithms.get(algorithm)
        except ColltuneError as exc:
            exc.argument = "algorithm"
            raise


#: Device types each backend's collectives move; other backends are trusted with any device but ``meta``.
_BACKEND_DEVICES: dict[str, tuple[str, ...]] = {"nccl": ("cuda",), "gloo": ("cpu", "cuda"), "local": ("cpu", "cuda")}


def group_backend(group: Any) -> str:
    """Return the group's backend (``gloo``, ``nccl``...), or ``local`` without a process group.

    Raises:
        ColltuneTypeError: ``group`` is neither ``None`` nor a process group.
        ColltuneValueError: this rank is not a member of ``group``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return "local"
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise argument_error(ColltuneTypeError, "group",
                             f"group must be a torch.distributed.ProcessGroup or None, but got {type(group).__name__}.")
    rank, _, backend = group_facts(group)
    if rank < 0:
        raise argument_error(ColltuneValueError, "group",
                             f"this rank ({dist.get_rank()}) is not a member of the group it passed; call "
                             "collectives only on the ranks of their group, as torch.distributed requires.")
    return backend


def _comm_device(group: Any, hint: Any) -> torch.device:
    """Return where the call's collectives run: ``hint``'s device if the backend moves it, else the backend's own.

    Never raises, so that even a rank whose arguments are unusable (a bad
    group, a ``meta`` tensor, CUDA values on a backend without CUDA) joins
    the metadata exchange and tells the others.
    """
    try:
        backend = group_backend(group)
    except ColltuneError:
        backend = "invalid"
    if isinstance(hint, torch.Tensor) and hint.device.type in _BACKEND_DEVICES.get(backend, ("cpu", "cuda")):
        if hint.device.type != "cuda" or torch.cuda.is_available():
            return hint.device
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange_group(group: Any) -> Any:
    """Return the group the metadata exchange runs on: ``group``, or the default group when ``group`` is unusable.

    A rank that passed something that is not a process group still tells
    the others, over the default group (the group they most likely passed).
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    return None


def _check_tensor(t: Any, argument: str, what: str) -> None:
    """Check that ``t`` is a strided torch.Tensor with data on a device the group's backend moves."""
    if not isinstance(t, torch.Tensor):
        raise argument_error(ColltuneTypeError, argument,
                             f"{argument} must be a torch.Tensor {what}, but got {type(t).__name__}.")
    if t.is_nested:
        raise argument_error(ColltuneTypeError, argument, f"{argument} must be a regular tensor, but got a nested tensor; "
                             f"concatenate its components with torch.cat(list({argument}.unbind())).")
    if t.layout != torch.strided:
        hint = (
            "pass a sparse COO tensor t alone, sparse_allreduce(t)" if t.layout == torch.sparse_coo
            else f"convert it with {argument}.to_dense()"
        )
        raise argument_error(ColltuneTypeError, argument, f"{argument} must be a dense (strided) tensor, but got layout "
                             f"{str(t.layout).replace('torch.', '')}; {hint}.")


#: ``(backend, device)`` pairs :func:`_check_device` passed: a call's tensors are checked in a set lookup (whether
#: CUDA is available does not change within a process).
_DEVICES_OK: set[tuple[str, torch.device]] = set()


def _check_device(group: Any, device: torch.device, argument: str, backend: str | None = None) -> None:
    """Raise unless the group's backend (``backend`` when the caller knows it) moves tensors on ``device``
    (and the device holds data)."""
    if device.type == "meta":
        raise argument_error(ColltuneValueError, argument, f"{argument} is on the meta device, which holds no data; "
                             f"pass a tensor with values (on cpu, or cuda with NCCL).")
    backend = group_backend(group) if backend is None else backend
    if (backend, device) in _DEVICES_OK:
        return
    allowed = _BACKEND_DEVICES.get(backend)
    if allowed is not None and device.type not in allowed:
        where = " or ".join(allowed)
        raise argument_error(ColltuneValueError, argument,
                             f"{argument} is on {device}, but the group's backend {backend} moves {where} tensors only; "
                             f"move it with {argument}.to({allowed[0]!r}) or use a group whose backend moves {device.type}.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argument_error(ColltuneValueError, argument, f"{argument} is on {device}, but CUDA is not available here.")
    _DEVICES_OK.add((backend, device))


_dtype_name = _meta.dtype_name
_VALUE_NAMES = ", ".join(_dtype_name(d) for d in VALUE_DTYPES)
#: The largest ``size``: indices are int64 and the record carries sizes as int64.
MAX_SIZE = (1 << 63) - 1


def _as_int(x: Any) -> int | None:
    """Return ``x`` as an int if it is an integer, else ``None``.

    Integers are ``int``, NumPy integers and 0-d torch integers; ``bool`` is not one.
    """
    if isinstance(x, (bool, float)) or getattr(x, "dtype", None) == torch.bool:
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _check_size(size: Any, row_shape: tuple[int, ...]) -> int:
    """Return ``n`` from ``size`` (an int or a shape ``(n, *row_shape)``)."""
    if type(size) is int and 1 <= size <= MAX_SIZE:  # the usual case, in one test
        return size
    if isinstance(size, (tuple, list, torch.Size)):
        shape = tuple(_as_int(s) for s in size)
        if not shape or any(s is None for s in shape):
            raise argument_error(ColltuneTypeError, "size",
                                 f"size must be an int or a shape (n, *row_shape) of ints, but got {size!r}.")
        if shape[1:] != row_shape:
            raise argument_error(ColltuneValueError, "size",
                                 f"values rows have shape {row_shape}, but size {shape} says rows of shape {shape[1:]}; "
                                 f"pass size=({shape[0]}, *values.shape[1:]) or reshape values.")
        n = shape[0]
    else:
        n = _as_int(size)
        if n is None:
            raise argument_error(ColltuneTypeError, "size", f"size must be an int (the number of dense rows), but got {size!r}.")
    if n < 1:
        raise argument_error(ColltuneValueError, "size", f"size must be >= 1, but got {n}.")
    if n > MAX_SIZE:
        raise argument_error(ColltuneValueError, "size",
                             f"size must be at most 2^63 - 1 (indices are int64), but got {n}; pass the number of dense rows.")
    return n


def is_sparse_coo(t: Any) -> bool:
    """Return whether ``t`` is a sparse COO tensor."""
    return isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo


def unpack_coo(indices: Any, values: Any, size: Any) -> tuple[Any, Any, Any]:
    """Return the row indices, values and shape of a sparse COO tensor passed alone; else the arguments as they came."""
    alone = "pass it alone, sparse_allreduce(t) (its size is taken from it)"
    if not is_sparse_coo(indices):
        if is_sparse_coo(values):
            raise argument_error(ColltuneTypeError, "values", f"values is a sparse COO tensor; {alone}.")
        if values is None or size is None:
            missing = "values" if values is None else "size"
            raise argument_error(ColltuneTypeError, missing,
                                 f"{missing} is required: pass sparse_allreduce(indices, values, size), "
                                 "or a sparse COO tensor alone, sparse_allreduce(t).")
        return indices, values, size
    if values is not None or size is not None:
        extra = "values" if values is not None else "size"
        raise argument_error(ColltuneTypeError, extra,
                             f"indices is a sparse COO tensor, which carries its values and size, but {extra} was passed "
                             f"too; {alone}, or pass its parts: sparse_allreduce(t._indices()[0], t._values(), t.shape).")
    rows = indices._indices()  # [sparse_dim, nnz]: its shape answers sparse_dim() with no op of its own
    if rows.shape[0] != 1:
        raise argument_error(ColltuneValueError, "indices",
                             f"a sparse COO tensor must have sparse rows (sparse_dim 1, the layout of "
                             f"nn.Embedding(sparse=True)'s gradients), but got sparse_dim {rows.shape[0]} and shape "
                             f"{tuple(indices.shape)}; convert it with t.to_dense().to_sparse(1), or pass flat indices and "
                             "values with a flat size.")
    return rows[0], indices._values(), tuple(indices.shape)


def check_sparse_tensor(
    indices: Any, values: Any, size: Any, group: dist.ProcessGroup | None, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, ...]]:
    """Check one sparse tensor's arguments; return indices, values as ``[k, r]``, n and the row shape.

    The indices' range is checked by the coalesce (:func:`coalesce_checked`):
    on the host path from the coalesced indices' ends, on the device path
    with its one host read. No pass over the indices is made here.
    ``backend`` is the group's (:func:`group_backend`) when the caller knows
    it: a fused call checks many tensors against one group.
    """
    _check_tensor(indices, "indices", "of int32 or int64")
    _check_tensor(values, "values", "of floats")
    if indices.dtype not in INDEX_DTYPES:
        hint = " (indices must be whole row numbers)" if indices.is_floating_point() else ""
        raise argument_error(ColltuneTypeError, "indices",
                             f"indices must have dtype int32 or int64, but got {_dtype_name(indices.dtype)}{hint}; "
                             "convert them with indices.long().")
    if indices.dim() != 1:
        raise argument_error(ColltuneValueError, "indices",
                             f"indices must be 1-D (one row index per entry), but got shape {tuple(indices.shape)}; "
                             "for a COO tensor pass its row indices, e.g. t.indices()[0].")
    if values.dtype not in VALUE_DTYPES:
        raise argument_error(ColltuneTypeError, "values",
                             f"values must have one of the dtypes {_VALUE_NAMES}, but got {_dtype_name(values.dtype)}; "
                             "convert them with values.float().")
    if values.dim() == 0:
        raise argument_error(ColltuneValueError, "values",
                             "values must have shape [k] or [k, *row_shape], one row per index, but got a 0-d tensor.")
    if values.shape[0] != indices.shape[0]:
        raise argument_error(ColltuneValueError, "values",
                             f"indices and values must have the same length (one value row per index), but got "
                             f"{indices.shape[0]} indices and {values.shape[0]} value rows.")
    _check_device(group, values.device, "values", backend)
    if indices.device != values.device:
        raise argument_error(ColltuneValueError, "indices",
                             f"indices and values must be on the same device, but got {indices.device} and {values.device}.")
    row_shape = tuple(values.shape[1:])
    n = _check_size(size, row_shape)
    if values.dim() != 2:  # [k] or [k, *row_shape] as [k, r]; a [k, r] tensor already is (a call's op saved)
        values = values.reshape(values.shape[0], int(torch.Size(row_shape).numel()))
    return indices, values, n, row_shape


def check_bounds(lo: int, hi: int, n: int) -> None:
    """Raise naming ``indices`` unless ``lo`` and ``hi``, the least and the greatest index, are in ``[0, n)``."""
    if lo < 0:
        raise argument_error(ColltuneValueError, "indices",
                             f"indices must be in [0, size) = [0, {n}), but got a negative index {lo}; "
                             "wrap negative indices with indices % size if they count from the end.")
    if hi >= n:
        raise argument_error(ColltuneValueError, "indices",
                             f"indices must be in [0, size) = [0, {n}), but got index {hi}; "
                             "pass a larger size or fix the indices.")


def coalesce_checked(indices: torch.Tensor, values: torch.Tensor, n: int, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Coalesce a call's validated tensor (see :func:`coalesce`) and check its indices' range.

    On the host path the coalesced indices are sorted, so their ends are
    their least and greatest: the check costs no pass of its own. On the
    device path the tensor goes as a :class:`~colltune.algorithms.sparse.Batch`
    of one, whose one host read also tells whether an index is out of range.
    """
    if on_host(values):
        idx, vals = coalesce(indices, values, acc)
        if idx.numel():
            check_bounds(int(idx[0]), int(idx[-1]), n)
        return idx, vals
    batch = Batch([(indices, values, n)], acc)
    stats = batch.stats.tolist()
    if stats[0]:
        raise first_range_error([(indices, values, n)])
    return batch.finish(stats[1:])


def first_range_error(
    items: Sequence[tuple[torch.Tensor, torch.Tensor, int]], named: Callable[[Exception, int], Exception] | None = None,
) -> Exception:
    """Return the range error of the first of ``items`` with an index outside its ``[0, size)`` (``named`` names it).

    For the error path only, once a batch's stats said that one has: it reads every tensor's bounds.
    """
    for j, (indices, _, n) in enumerate(items):
        try:
            if indices.numel():
                lo, hi = torch.aminmax(indices)
                check_bounds(int(lo), int(hi), n)
        except ColltuneError as exc:
            return exc if named is None else named(exc, j)
    return argument_error(ColltuneValueError, "indices", "an index is outside its tensor's [0, size).")


def deferred_fields(stats: torch.Tensor, record: dict[str, int], argument: str) -> dict[str, torch.Tensor]:
    """The record's fields a deferred coalesce leaves on the device: ``stats``, ``[bad, count]`` (int64; ``bad``
    is 1, a value error's code, when an index is out of range), fills ``error`` and ``count`` with one copy.
    ``record`` names ``argument`` as the one at fault, which a peer reads only when ``error`` is set."""
    record["error_arg"] = _meta.name_code(argument)
    return {"error": stats}


def _device_bytes(device: torch.device) -> int:
    """Return the memory of ``device`` in bytes (physical memory for the CPU), cached."""
    key = (device.type, device.index)
    got = _DEVICE_BYTES.get(key)
    if got is None:
        if device.type == "cuda":
            got = int(torch.cuda.get_device_properties(device).total_memory)
        else:
            try:
                got = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):
                got = 1 << 62  # unknown: do not refuse
        _DEVICE_BYTES[key] = got
    return got


_DEVICE_BYTES: dict[tuple[str, int | None], int] = {}


def check_dense_fits(n: int, row_numel: int, dtype: torch.dtype, device: torch.device) -> None:
    """Raise if ``dense``'s buffers (``n`` rows in the accumulation dtype, and the presence test's byte per row)
    exceed the device."""
    need = n * (row_numel * accum_dtype(dtype).itemsize + 1)
    have = _device_bytes(device)
    if need > have:
        raise argument_error(ColltuneValueError, "size",
                             f"algorithm 'dense' needs {need / 2**30:.3g} GiB for size {n} (rows of {row_numel} "
                             f"{_dtype_name(accum_dtype(dtype))} and a presence byte each), more than the {have / 2**30:.3g} GiB "
                             f"of {device.type}; use algorithm 'allgather', 'oktopk' or 'auto'.")


# --------------------------------------------------------------------------- auto


def _selector_module() -> Any:
    # Imported on the first auto call: explicit algorithms never load policies or profiles.
    from colltune.select import selector

    return selector


def _check_name(name: Any) -> None:
    """Check that ``name`` is a str or ``None``."""
    if name is not None and not isinstance(name, str):
        raise argument_error(ColltuneTypeError, "name",
                             f"name must be a str (the tensor's name, for policy rules and decision caching) or None, "
                             f"but got {type(name).__name__}.")


def _policy_code(sel: Any, backend: str, name: str | None, knobs: dict[str, dict[str, Any]]) -> int:
    """Return what the metadata record's ``policy`` field carries for an auto call.

    The selector's digest (policy, ``COLLTUNE_ALGO``, profile, settings),
    the tensor name and the caller's knobs per algorithm: ranks that would
    decide or run differently disagree on this number, so every rank raises
    instead of hanging.
    """
    return _meta.digest(sel.digest(backend), name, sorted((a, sorted(k.items())) for a, k in knobs.items()))


def _check_knobs_mapping(knobs: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(knobs, Mapping) or not all(isinstance(k, str) for k in knobs):
        raise argument_error(ColltuneTypeError, "knobs",
                             f"knobs{what} must be a dict of knob names to values, e.g. {{'mode': 'pad'}}, but got "
                             f"{type(knobs).__name__} {knobs!r:.80}.")
    return knobs


def _check_explicit_knobs(algo: algorithms.Algorithm, knobs: Any) -> dict[str, Any]:
    """Return ``algo``'s knobs with the caller's applied, checked (errors name the argument ``knobs``)."""
    try:
        return algo.check_knobs(dict(_check_knobs_mapping(knobs, "")) if knobs else None)
    except ColltuneError as exc:
        exc.argument = "knobs"
        raise


def _auto_knobs(knobs: Any) -> dict[str, dict[str, Any]]:
    """Return an auto call's knobs per algorithm, each checked against its algorithm.

    ``knobs`` maps algorithm names to their knobs (``{"allgather": {"mode":
    "pad"}}``), or names knobs directly (``{"mode": "pad"}``), each applied
    to every algorithm that has it. A knob applies when its algorithm runs,
    so a valid allgather knob never fails a call that auto sends to dense.
    """
    if not knobs:
        return {}
    per: dict[str, dict[str, Any]] = {}
    names = algorithms.names()
    for key, value in _check_knobs_mapping(knobs, " with algorithm 'auto'").items():
        if key in names:
            per.setdefault(key, {}).update(_check_knobs_mapping(value, f"[{key!r}]"))
            continue
        owners = [a for a in names if key in algorithms.get(a).knobs]
        if not owners:
            raise argument_error(ColltuneValueError, "knobs",
                                 f"knob {key!r} is not a knob of any algorithm ({', '.join(names)}); give knobs per algorithm, "
                                 f"e.g. knobs={{'allgather': {{'mode': 'pad'}}}}, or remove it.")
        for a in owners:
            per.setdefault(a, {})[key] = value
    for a, kn in per.items():
        _check_explicit_knobs(algorithms.get(a), kn)
    return per


#: Per registered algorithm object: its default knobs, checked, and their code in the record.
_DEFAULT_KNOBS: dict[Any, tuple[dict[str, Any], int]] = {}


def resolve_request(
    algorithm: str, knobs: Any, policy: Any, group: dist.ProcessGroup | None, name: Any
) -> tuple[dict[str, Any] | None, Any, str | None, int]:
    """Check ``name`` and ``knobs`` and resolve the request before the metadata exchange.

    Returns ``(knobs, selector, backend, code)``: for an explicit algorithm
    its checked knobs; for ``auto`` the caller's knobs per algorithm
    (applied to the selector's choice after the exchange), the selector and
    backend (else ``None``); and the code the record's ``policy`` field
    carries, a digest of everything else the ranks must agree on.
    """
    _check_name(name)
    if algorithm != "auto":
        algo = algorithms.get(algorithm)
        if not knobs:
            # The defaults' code, made once per algorithm (the common case; a few us per call otherwise).
            default = _DEFAULT_KNOBS.get(algo)
            if default is None:
                checked = algo.check_knobs(None)
                default = _DEFAULT_KNOBS[algo] = (checked, _meta.digest(sorted(checked.items())))
            return dict(default[0]), None, None, default[1]
        checked = _check_explicit_knobs(algo, knobs)
        # Knobs change the schedule (which messages, which refreshes): ranks
        # that pass different ones disagree on this code and raise.
        return checked, None, None, _meta.digest(sorted(checked.items()))
    per_algorithm = _auto_knobs(knobs)
    try:
        sel = _selector_module().selector_for(policy)
    except ColltuneError as exc:
        exc.argument = exc.argument or "policy"
        raise
    backend = group_backend(group)
    return per_algorithm, sel, backend, _policy_code(sel, backend, name, per_algorithm)


def decided_knobs(decision: Any, knobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Return the knobs of the selector's choice: the policy's, overridden by the caller's for that algorithm."""
    own = knobs.get(decision.algorithm)
    return algorithms.get(decision.algorithm).check_knobs({**decision.knobs, **own} if own else decision.knobs)


def group_key(group: dist.ProcessGroup | None) -> int:
    """Return the part of a call site's key that tells groups apart (never a destroyed group's)."""
    return group_serial(group) if isinstance(group, dist.ProcessGroup) else 0


def open_comm(group: Any, hint: Any, wire: Any) -> Comm:
    """Return the call's view of its group, on the device its collectives run on.

    Raises only for a rank outside ``group``, which no other rank waits for.
    """
    if isinstance(group, dist.ProcessGroup) and dist.is_initialized() and group_facts(group)[0] < 0:
        group_backend(group)  # raises the error that names the group
    return Comm(_exchange_group(group), _comm_device(group, hint), wire=wire)


def input_error(exc: Exception) -> ColltuneError:
    """Return ``exc`` as this rank's input error: colltune's own as they are, anything else wrapped.

    An exception nobody anticipated (an ``AttributeError`` deep in a check,
    an ``OverflowError``, a device error) still becomes a colltune error that
    rides in the metadata record, so the other ranks raise with this one.
    """
    if isinstance(exc, ColltuneError):
        return exc
    wrapped = (ColltuneTypeError if isinstance(exc, TypeError) else ColltuneValueError)(
        f"this rank's arguments could not be prepared for the collective: {type(exc).__name__}: {exc}; "
        "the other ranks raised RemoteInputError. Check the arguments against the docstring.",
        argument="unknown",
    )
    wrapped.__cause__ = exc
    return wrapped


# --------------------------------------------------------------------------- a caller's check


_KIND_CHECK = "check"
_meta.name_code(_KIND_CHECK)


@dataclass(frozen=True)
class CallerCheck:
    """What a training wrapper has every rank check in the metadata record of its step's first call.

    A synchronizer decides locally, before any collective, how its gradients
    travel; a rank that fails there (a gradient of the wrong layout, a
    policy file it cannot read) or that is a step ahead (it retried a step
    the others did not) would leave the others waiting in a collective, or
    pair its step with theirs. Its check rides in the record of the first
    call it makes instead (:func:`colltune.fused.submit_many`), or alone
    (:func:`check_with_peers`): both are one metadata exchange on the
    group's twin, so a rank that cannot tell which call comes first still
    meets the others there.

    Attributes:
        step: the wrapper's count of synchronizations that succeeded, the
            same on every rank (record field ``step``).
        plan: a code of how this step's gradients travel (``-1`` when this
            rank could not route them); the same on every rank (field ``plan``).
        error: this rank's error found before the call, or ``None``: it
            travels as an input error, so this rank raises it and the others
            :class:`~colltune.RemoteInputError` naming this rank.
    """

    step: int
    plan: int
    error: Exception | None = None

    def fields(self) -> dict[str, int]:
        """Return the record fields of the check."""
        return {"step": self.step, "plan": self.plan}


def check_with_peers(group: dist.ProcessGroup | None, hint: torch.Tensor | None, check: CallerCheck) -> None:
    """Exchange ``check`` alone: one metadata record per rank, in order with the calls on ``group``.

    Args:
        group: the process group.
        hint: a tensor on the device the wrapper's calls run on (so the
            record takes their code path), or ``None``.
        check: the check.

    Raises:
        The rank's own ``check.error``; :class:`~colltune.RemoteInputError`
        when another rank's check carried one; :class:`~colltune.RankMismatchError`
        when ranks are at different steps or route them differently.
    """
    submit_call(lambda wire: _check_alone(group, hint, check, wire), False, group, getattr(hint, "device", None))


def _check_alone(group: Any, hint: Any, check: CallerCheck, wire: Any) -> None:
    comm = open_comm(group, hint, wire)
    record = {"kind": _meta.name_code(_KIND_CHECK), **check.fields()}
    error = None if check.error is None else input_error(check.error)
    _meta.exchange(comm, record, error)


# --------------------------------------------------------------------------- sparse_allreduce


@outside_compile
def sparse_allreduce(
    indices: torch.Tensor, values: torch.Tensor | None = None, size: int | Sequence[int] | None = None,
    op: str | dist.ReduceOp = "sum",
    group: dist.ProcessGroup | None = None, algorithm: str = "auto", async_op: bool = False, *,
    knobs: dict[str, Any] | None = None, name: str | None = None, policy: Any = None, donate: bool = False,
) -> SparseResult | AsyncHandle:
    """Sum a sparse tensor over the ranks of ``group``; every rank gets the same result.

    Args:
        indices: 1-D int32 or int64 row indices, any order, duplicates allowed
            (they are summed); or a sparse COO tensor with sparse rows (what
            ``nn.Embedding(sparse=True)`` puts in ``.grad``), passed alone:
            its indices, values and shape are used.
        values: ``[k]`` or ``[k, *row_shape]``, one row per index; float32,
            float64, float16 or bfloat16 (16-bit types are summed in fp32).
        size: the number of dense rows ``n``, or the dense shape ``(n, *row_shape)``.
        op: ``sum`` or ``avg`` (the sum divided by the world size), or
            ``dist.ReduceOp.SUM`` / ``dist.ReduceOp.AVG``.
        group: the process group; ``None`` for the default group. Without an
            initialized process group the call is local (world size 1).
        algorithm: ``auto`` or a registered algorithm's name (such as
            ``dense``; :func:`colltune.algorithms.names` lists them).
        async_op: return an :class:`AsyncHandle` instead of waiting.
        knobs: options of the algorithm, e.g. ``{"mode": "alltoall"}`` for
            ``allgather``; unknown names are rejected. With ``auto``, per
            algorithm (``{"allgather": {"mode": "pad"}}``) or by knob name
            (applied to every algorithm that has it), each applied on top of
            the policy's knobs when its algorithm is chosen.
        name: the tensor's name: policy rules match it (globs), and
            decisions are cached per name (calls without one share a cache
            per size, row shape and dtype). Must be the same on every rank.
        policy: for ``auto``: a :class:`colltune.model.policy.Policy`, a policy file
            path or a :class:`colltune.Selector`; ``None`` uses the process-wide
            selector (:func:`colltune.configure`, else the environment and the
            profile shipped for the backend).
        donate: give ``indices`` and ``values`` to the call, as
            ``dist.all_reduce`` takes its tensor: the result may be reduced
            into their memory or be them, so their contents afterwards are
            unspecified. It saves copies where the result has every row
            (dense at density 1 reduces the values in place and hands the
            indices back, as a plain ``all_reduce`` would); the result is the
            same either way.

    Returns:
        A :class:`SparseResult`: int64 indices (sorted, unique: the union of
        all ranks' indices) and their summed values, bitwise identical on
        every rank; or an :class:`AsyncHandle` whose ``wait()`` returns it.

    Raises:
        ColltuneTypeError, ColltuneValueError: this rank's arguments are invalid.
        RemoteInputError: another rank's arguments are invalid; the message
            names the rank and the argument.
        RankMismatchError: ranks disagree on size, row shape, dtype, op,
            algorithm or knobs, or (``auto``) on the policy, profile or name.
        CollectiveError: a peer rank died or timed out during the call.
        AbandonedCallError: (asynchronous calls) a call queued before this
            one failed out of step with the other ranks; this one did not run.

    Example:
        >>> res = colltune.sparse_allreduce(idx, vals, size=1_000_000, op="avg")  # doctest: +SKIP
        >>> grad = res.to_dense()  # doctest: +SKIP
    """
    op = canonical_op(op)
    return submit_call(
        lambda wire: _sparse_allreduce(indices, values, size, op, group, algorithm, knobs, name, policy, wire,
                                       donate),
        async_op, group, getattr(values if values is not None else indices, "device", None), (indices, values),
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
    wire: Any = None,
    donate: Any = False,
) -> SparseResult:
    """Run one ``sparse_allreduce`` on this rank: prepare, exchange the records, decide, run, return the result.

    A failure while preparing rides in this rank's record, so every rank
    raises at the exchange and none is left waiting.
    """
    comm = open_comm(group, values if values is not None else indices, wire)
    call = _SparseCall(comm, {"kind": _meta.name_code(_KIND_SPARSE)})
    error: BaseException | None = None
    try:
        call.prepare(indices, values, size, op, group, algorithm, knobs, name, policy, donate)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of any failure before the exchange
        error, call.slot, call.eager, call.sketch_bytes, call.payload_bytes = (
            input_error(exc), None, _meta.EAGER_NONE, 0, 0)
    timer = online.start(comm, call.sel)
    records, slots = _meta.exchange(comm, call.record, error, call.slot, device_fields=call.device_fields,
                                    deferred_error=call.deferred_error)
    counts = tuple(records.column("count"))
    call.settle(counts)
    algorithm, decision = call.decide(algorithm, counts, slots, name)
    inp = call.sparse_input(counts, slots, op, algorithm)
    # Size the next call's eager slot from this one: the same records and
    # decision on every rank, so every rank sizes it alike.
    has_entries = call.eager in (_meta.EAGER_ENTRIES, _meta.EAGER_SKETCH)
    _meta.note_slot_use(
        comm,
        slot_need(counts, inp.row_numel, inp.size, inp.dtype) + call.payload_bytes
        if has_entries and algorithms.get(algorithm).eager_entries else 0,
    )
    # A call that pays one-off set-up (Ok-Topk's boundaries) teaches online correction nothing of the others.
    one_off = timer is not None and algorithms.get(algorithm).one_off(comm, inp.size, call.knobs_checked)
    out_idx, out_vals = run_sparse(inp, comm, algorithm, call.knobs_checked, op)
    online.hold(comm, timer, call.sel, call.site, None if one_off else decision)
    if call.sel is not None:
        call.sel.observe_sparse(call.site, counts, out_idx.numel())
    out_vals = cast(out_vals, call.dtype).reshape((out_idx.numel(),) + inp.row_shape)
    return SparseResult(out_idx, out_vals, inp.size, algorithm, comm.traffic, decision)


class _SparseCall:
    """One rank's side of a ``sparse_allreduce``: what it prepares before the exchange and decides after it."""

    def __init__(self, comm: Comm, record: dict[str, int]) -> None:
        self.comm, self.record = comm, record
        self.sel: Any = None
        self.likely: str | None = None  # the algorithm whose payload the record carries
        self.slot: np.ndarray | torch.Tensor | None = None
        self.eager, self.sketch_bytes, self.payload_bytes = _meta.EAGER_NONE, 0, 0
        self.work: Any = None  # the likeliest algorithm's own work beside its payload (Prepared.work)
        self.knobs_checked: Any = None
        self.site: tuple = ()
        self.owned = False  # whether the coalesced values are the call's to overwrite (SparseInput.owned)
        self.owned_indices = False  # and whether its indices may be handed back (SparseInput.owned_indices)
        #: Deferred coalesce (device path): the record's fields still on the device, and the range error.
        self.device_fields: dict[str, torch.Tensor] | None = None
        self.deferred_error: Callable[[], BaseException] | None = None

    def prepare(self, indices: Any, values: Any, size: Any, op: Any, group: Any, algorithm: Any,
                knobs: dict[str, Any] | None, name: Any, policy: Any, donate: Any = False) -> None:
        """Validate and coalesce the input, resolve the algorithm's knobs, fill the record and its eager slot."""
        comm = self.comm
        if not isinstance(donate, bool):
            raise argument_error(ColltuneTypeError, "donate",
                                 f"donate must be True or False, but got {donate!r}; pass donate=True to let the "
                                 "call reduce into the values' memory.")
        indices, values, size = unpack_coo(indices, values, size)
        check_op_and_algorithm(op, algorithm)
        idx, vals, n, row_shape = check_sparse_tensor(indices, values, size, group)
        self.knobs_checked, self.sel, self.backend, code = resolve_request(algorithm, knobs, policy, group, name)
        if algorithm == "dense":
            check_dense_fits(n, vals.shape[1], values.dtype, comm.device)
        self.site = (_KIND_SPARSE, name, n, vals.shape[1], values.dtype, comm.world_size, group_key(group))
        if self.can_defer(algorithm):
            idx, vals = self.defer(idx, vals, n, accum_dtype(values.dtype))
        else:
            idx, vals = coalesce_checked(idx, vals, n, accum_dtype(values.dtype))
        self.idx, self.vals, self.n, self.row_shape, self.dtype = idx, vals, n, row_shape, values.dtype
        # Donated memory is written only where a collective may take it as it is: contiguous, each element
        # its own (not expanded), and not an inference tensor (no in-place update outside inference mode).
        self.owned = not shares_storage(vals, values) or (donate and writable(vals))
        self.owned_indices = donate or not shares_storage(idx, indices)
        self.record.update(
            size=n,
            row_numel=vals.shape[1],
            **_meta.shape_fields(row_shape),
            dtype=_meta.name_code(_dtype_name(values.dtype)),
            op=_meta.name_code(op),
            algorithm=_meta.name_code(algorithm),
            policy=code,
            count=idx.numel() if self.device_fields is None else 0,  # deferred: the device's count
        )
        if comm.world_size > 1:
            self.fill_slot(algorithm)
        self.record["eager"], self.record["payload"] = self.eager, self.payload_bytes

    def can_defer(self, algorithm: str) -> bool:
        """Whether the coalesce can wait for the record: on the device path at P > 1, unless an overlap sketch
        goes in the slot (it hashes the exact indices). Payloads take the padded indices (their padding is
        the size, past every real index) and the entries the first rows."""
        comm, sel = self.comm, self.sel
        if comm.world_size == 1 or comm.host:
            return False
        return not (algorithm == "auto" and sel is not None and sel.wants_sketch(self.site, self.backend))

    def defer(self, idx: torch.Tensor, vals: torch.Tensor, n: int, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Coalesce with no host read: the unique count and the range check ride in the record (see
        :meth:`~colltune.algorithms.sparse.Batch.padded`); return the padded entries, cut by :meth:`settle`."""
        pad_idx, pad_vals, stats = Batch([(idx, vals, n)], acc).padded()
        self.device_fields = deferred_fields(stats, self.record, "indices")
        self.deferred_error = lambda: first_range_error([(idx, vals, n)])
        return pad_idx, pad_vals

    def settle(self, counts: tuple[int, ...]) -> None:
        """After the exchange: cut a deferred coalesce's padded entries to this rank's count (views)."""
        if self.device_fields is not None:
            u = counts[self.comm.rank]
            self.idx, self.vals = self.idx[:u], self.vals[:u]

    def fill_slot(self, algorithm: str) -> None:
        """Fill the record's eager slot.

        It carries, in order: the payload of the algorithm likeliest to run
        (its own metadata, e.g. Ok-Topk's counts per region), on the first
        auto call at a site a sketch of the indices (the selector estimates
        the overlap from it without a collective of its own), and this
        rank's first entries (allgather then needs no second collective).
        """
        comm, sel, idx = self.comm, self.sel, self.idx
        cap = _meta.slot_bytes(comm)
        self.likely = likely = sel.last_choice(self.site) if sel is not None else algorithm
        parts: list[np.ndarray | torch.Tensor] = []
        if likely is not None and not algorithms.get(likely).eager_entries:
            own = algorithms.get(likely).eager_payload(
                idx, self.n, comm, None if sel is not None else self.knobs_checked, cap
            )
            if isinstance(own, Prepared):
                own, self.work = own.payload, own.work
            if own is not None:
                parts.append(own)
                self.payload_bytes = _meta.part_bytes(own)
        if algorithm == "auto" or algorithms.get(algorithm).eager_entries:
            room = cap - self.payload_bytes
            if sel is not None and sel.wants_sketch(self.site, self.backend):
                # The sketch (1 KiB: 256 hashes), then as many entries as still fit.
                self.sketch_bytes, self.eager = min(room, _SKETCH_BYTES), _meta.EAGER_SKETCH
                sketch = np.zeros(self.sketch_bytes, dtype=np.uint8)
                hashes = sketch_hashes(idx, self.sketch_bytes, sel.bitmap_seed).view(np.uint8)
                sketch[: hashes.size] = hashes
                parts.append(sketch)
            else:
                self.eager = _meta.EAGER_ENTRIES
            parts.append(eager_slot(idx.to(comm.device), self.vals.to(comm.device), self.n, self.dtype,
                                    room - self.sketch_bytes))
        self.slot = _meta.join_slot(parts, comm.device)

    def decide(self, algorithm: str, counts: tuple[int, ...], slots: Any, name: Any) -> tuple[str, Any]:
        """Return the algorithm to run and the selector's decision (``None`` when the caller named one)."""
        sel = self.sel
        if sel is None:
            return algorithm, None
        sketches = None
        if self.eager == _meta.EAGER_SKETCH:
            table = np.ascontiguousarray(slots[:, self.payload_bytes : self.payload_bytes + self.sketch_bytes])
            table = table.view(np.uint32)
            sketches = [table[r, : min(c, table.shape[1])] for r, c in enumerate(counts)]
        decision = sel.decide_sparse(
            self.site, comm=self.comm, backend=self.backend, name=name, size=self.n, row_numel=self.vals.shape[1],
            dtype=self.dtype, counts=counts, indices=self.idx, sketches=sketches,
            ranks_per_node=ranks_per_node(self.comm.group),
        )
        self.knobs_checked = decided_knobs(decision, self.knobs_checked)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("sparse_allreduce: n=%d k_max=%d k_sum=%d P=%d -> %s", self.n, max(counts), sum(counts),
                         self.comm.world_size, decision.algorithm)
        return decision.algorithm, decision

    def sparse_input(self, counts: tuple[int, ...], slots: Any, op: str, algorithm: str) -> SparseInput:
        """Return what the algorithm receives: the local entries, every rank's counts, slots and payloads."""
        entries_at = self.payload_bytes + self.sketch_bytes
        has_entries = self.eager in (_meta.EAGER_ENTRIES, _meta.EAGER_SKETCH)
        eager_entries = slots[:, entries_at:] if has_entries else None
        # The payload belongs to the algorithm that made it: another one chosen meanwhile does not get it.
        mine = bool(self.payload_bytes) and algorithm == self.likely
        payload = slots[:, : self.payload_bytes] if mine else None
        return SparseInput(self.idx, self.vals, self.n, self.row_shape, self.dtype, counts, eager_entries, op,
                           payload, owned=self.owned, owned_indices=self.owned_indices, work=self.work if mine else None)


def run_sparse(
    inp: SparseInput, comm: Comm, algorithm: str, knobs: dict[str, Any], op: str, bounds: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the algorithm (nothing to move when no rank has entries) and apply ``avg`` where it did not.

    ``bounds``: the row offsets of a fused call's tensors laid end to end in ``inp``.
    """
    if inp.k_sum == 0:
        return (torch.empty(0, dtype=torch.int64, device=comm.device),
                torch.empty((0, inp.row_numel), dtype=inp.acc_dtype, device=comm.device))
    algo = algorithms.get(algorithm)
    if bounds is None:
        out_idx, out_vals = algo.sparse_allreduce(inp, comm, knobs)
    else:
        out_idx, out_vals = algo.sparse_allreduce_parts(inp, comm, knobs, bounds)
    if op == "avg" and not algo.applies_avg and comm.world_size > 1:
        # In place, unless the result is memory the call may not write: values it does not own are the caller's
        # (they share its storage), checked for registered algorithms too.
        shared = not inp.owned and shares_storage(out_vals, inp.values)
        out_vals = out_vals / comm.world_size if shared else out_vals.div_(comm.world_size)
    return out_idx, out_vals


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
            delivered (and so left the residual); ``None`` means all. On a
            device it is compacted when first read (that read is a host
            sync the call itself does not make).
        traffic: bytes and messages this rank sent.
    """

    indices: torch.Tensor | None
    values: torch.Tensor
    shape: tuple[int, ...]
    algorithm: str
    local_count: int
    global_count: int
    _sent: "torch.Tensor | Delivered | None"
    traffic: Traffic = field(default_factory=Traffic)
    decision: Any = None

    @property
    def sent_indices(self) -> torch.Tensor | None:
        """See the class docstring."""
        if isinstance(self._sent, Delivered):
            self._sent = self._sent.compact()
        return self._sent

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


@outside_compile
def topk_allreduce(
    tensor: torch.Tensor, state: TopkState, op: str | dist.ReduceOp = "avg", group: dist.ProcessGroup | None = None,
    algorithm: str = "auto", async_op: bool = False, *,
    knobs: dict[str, Any] | None = None, name: str | None = None, policy: Any = None,
) -> TopkResult | AsyncHandle:
    """Sparsify a dense tensor to about k entries per rank and sum the selection over ranks.

    The selection is taken from ``state.residual + tensor``; what is not
    delivered stays in ``state.residual`` for the next call (error feedback),
    so nothing is lost, only delayed; except that a call whose result holds
    a non-finite value (an overflow, which an AMP scaler skips) leaves the
    residual as it was, and a rank's own non-finite entries not sent are
    dropped from it.

    Args:
        tensor: a dense floating tensor (e.g. a gradient), same shape on every rank.
        state: this tensor's :class:`TopkState` (one per tensor).
        op: ``avg`` (default, as for gradients) or ``sum``, or
            ``dist.ReduceOp.AVG`` / ``dist.ReduceOp.SUM``.
        group: the process group; ``None`` for the default group.
        algorithm: ``auto``, ``dense`` (no compression), ``allgather`` (TopkA)
            or ``oktopk``.
        async_op: return an :class:`AsyncHandle` instead of waiting.
        knobs: options of the algorithm (with ``auto``, as for :func:`sparse_allreduce`).
        name: the tensor's name, for policy rules and the decision cache;
            the same on every rank.
        policy: for ``auto``: a policy, a policy file path or a
            :class:`colltune.Selector`; ``None`` for the process-wide selector.

    Returns:
        A :class:`TopkResult` (or a handle to one), identical on every rank.

    Example:
        >>> state = colltune.TopkState(density=0.01)  # doctest: +SKIP
        >>> grad.copy_(colltune.topk_allreduce(grad, state).to_dense())  # doctest: +SKIP
    """
    op = canonical_op(op)
    return submit_call(
        lambda wire: _topk_allreduce(tensor, state, op, group, algorithm, knobs, name, policy, wire), async_op, group,
        getattr(tensor, "device", None), (tensor,),
    )


def _validate_topk(tensor: Any, state: Any, op: Any, algorithm: Any, group: Any) -> None:
    """Check the arguments of ``topk_allreduce``."""
    check_op_and_algorithm(op, algorithm)
    _check_tensor(tensor, "tensor", "of floats")
    if tensor.dtype not in VALUE_DTYPES:
        raise argument_error(ColltuneTypeError, "tensor",
                             f"tensor must have one of the dtypes {_VALUE_NAMES}, but got {_dtype_name(tensor.dtype)}.")
    if tensor.numel() == 0:
        raise argument_error(ColltuneValueError, "tensor", "tensor must have at least one element, but got an empty tensor.")
    _check_device(group, tensor.device, "tensor")
    if not isinstance(state, TopkState):
        raise argument_error(ColltuneTypeError, "state",
                             f"state must be a colltune.TopkState, but got {type(state).__name__}; create one with "
                             "colltune.TopkState(density=0.01) and keep it for this tensor.")
    if state.residual is not None and state.residual.numel() != tensor.numel():
        raise argument_error(ColltuneValueError, "state",
                             f"state holds a residual of {state.residual.numel()} elements, but tensor has "
                             f"{tensor.numel()}; use one TopkState per tensor.")


def _topk_allreduce(
    tensor: Any,
    state: Any,
    op: Any,
    group: Any,
    algorithm: Any,
    knobs: dict[str, Any] | None,
    name: Any = None,
    policy: Any = None,
    wire: Any = None,
) -> TopkResult:
    """Run one ``topk_allreduce`` on this rank: validate, prepare, exchange the records, decide, run, return the result.

    A failure while validating rides in this rank's record, so every rank
    raises at the exchange and none is left waiting. ``acc = residual +
    tensor`` is formed before the exchange, so that the algorithm likeliest
    to run can do its local work first and send what the others need of it
    in the record (Ok-Topk: its local selection's counts per region).
    """
    comm = open_comm(group, tensor, wire)
    error: BaseException | None = None
    record: dict[str, int] = {"kind": _meta.name_code(_KIND_TOPK)}
    sel: Any = None
    prep: Prepared | None = None
    try:
        _validate_topk(tensor, state, op, algorithm, group)
        knobs_checked, sel, backend, code = resolve_request(algorithm, knobs, policy, group, name)
        numel = tensor.numel()
        k = state.k_for(numel)
        record.update(_topk_fields(tensor, k, op, algorithm, code))
        site = (_KIND_TOPK, name, numel, k, tensor.dtype, comm.world_size, group_key(group))
        acc = _accumulate(tensor, state)
        likely = sel.last_choice(site) if sel is not None else algorithm
        prep = _topk_prepare(likely, acc, state, comm)
        record["payload"] = 0 if prep is None else len(prep.payload)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of any failure before the exchange
        error, prep = input_error(exc), None
    timer = online.start(comm, sel)
    _, slots = _meta.exchange(comm, record, error, None if prep is None else prep.payload)
    _meta.note_slot_use(comm, 0)  # top-k leaves the rest of the eager slot empty
    if sel is None:
        decision: Any = None
    else:
        decision, knobs_checked = _decide_topk(sel, site, comm, backend, name, tensor, k, state, knobs_checked)
        algorithm = decision.algorithm
    if prep is not None and algorithm == likely and slots is not None:
        prep.gathered = slots[:, : len(prep.payload)]
    else:
        prep = None  # the payload belongs to the algorithm that made it: another one chosen meanwhile runs without
    out = _run_topk(acc, state, comm, algorithm, knobs_checked, prep)
    online.hold(comm, timer, sel, site, decision)
    state.step += 1
    if sel is not None:
        sel.observe_topk(site, algorithm, k, comm.world_size, out.global_count)
    values = out.values / comm.world_size if op == "avg" else out.values
    logger.debug("topk_allreduce: numel=%d k=%d P=%d -> %s; local %d, global %d",
                 numel, k, comm.world_size, algorithm, out.local_count, out.global_count)
    return TopkResult(out.indices, values.to(tensor.dtype), tuple(tensor.shape), algorithm, out.local_count,
                      out.global_count, out.sent, comm.traffic, decision)


def _topk_prepare(likely: str | None, acc: torch.Tensor, state: TopkState, comm: Comm) -> Prepared | None:
    """Return the pre-exchange work and record payload of ``likely``, the algorithm likeliest to run, or ``None``.

    Whether there is one depends only on what every rank shares (the
    site's last choice, the state's step, refresh periods and boundaries,
    the group's slot size), so every rank's record agrees on ``payload``.
    """
    if likely is None or comm.world_size < 2:
        return None
    return algorithms.get(likely).topk_prepare(acc, state, comm, _meta.slot_bytes(comm))


def _topk_fields(tensor: torch.Tensor, k: int, op: str, algorithm: str, code: int) -> dict[str, int]:
    """Return the metadata record's fields of a top-k call; ``k`` must agree too: it is part of the shared call."""
    return dict(
        size=tensor.numel(),
        row_numel=k,
        **_meta.shape_fields(tuple(tensor.shape)),
        dtype=_meta.name_code(_dtype_name(tensor.dtype)),
        op=_meta.name_code(op),
        algorithm=_meta.name_code(algorithm),
        policy=code,
        count=k,
    )


def _decide_topk(
    sel: Any, site: tuple, comm: Comm, backend: str | None, name: Any, tensor: torch.Tensor, k: int, state: TopkState,
    knobs: dict[str, dict[str, Any]],
) -> tuple[Any, dict[str, Any]]:
    """Return the selector's decision for an auto top-k call and its knobs; apply the knobs ``state`` keeps."""
    decision = sel.decide_topk(
        site, world_size=comm.world_size, rank=comm.rank, backend=backend, name=name, numel=tensor.numel(), k=k,
        dtype=tensor.dtype, ranks_per_node=ranks_per_node(comm.group),
    )
    checked = decided_knobs(decision, knobs)
    _apply_state_knobs(state, decision)
    return decision, checked


def _accumulate(tensor: torch.Tensor, state: TopkState) -> torch.Tensor:
    """Return ``residual + tensor``, flat, in the accumulation dtype: a fresh tensor the call may change."""
    acc = tensor.detach().reshape(-1).to(accum_dtype(tensor.dtype))
    if state.residual is not None:
        return acc + state.residual.to(acc.device)
    return acc.clone()


def _run_topk(
    acc: torch.Tensor, state: TopkState, comm: Comm, algorithm: str, knobs: dict[str, Any],
    prepared: Prepared | None = None,
) -> TopkOutput:
    """Run the algorithm on ``acc = residual + tensor`` and keep what it did not deliver as the new residual
    (the old one where the result holds a non-finite value; a rank's own non-finite entries dropped).

    ``prepared``: what the algorithm's own :meth:`~colltune.algorithms.base.Algorithm.topk_prepare`
    returned before the exchange (with every rank's payload), if anything.
    """
    algo = algorithms.get(algorithm)
    if prepared is None:
        out = algo.topk_allreduce(acc, state, comm, knobs)
    else:
        out = algo.topk_allreduce(acc, state, comm, knobs, prepared=prepared)
    # An overflow (a non-finite value in the result: the same bits on every rank) is a step an AMP scaler skips,
    # so the residual keeps what it held, not this step's gradient. Otherwise a rank's own non-finite entries
    # that were not sent are dropped: kept, they would make every later step's sum non-finite. No host sync.
    old = None if state.residual is None else state.residual.to(acc.device)
    # NaN < inf is False, as inf < inf is: one reduction and a comparison (isfinite takes three kernels more).
    ok = out.values.abs().amax() < math.inf if out.values.numel() else True
    if out.sent is None:  # everything was sent
        state.residual = torch.zeros_like(acc) if old is None or ok is True else old.masked_fill(ok, 0.0)
        return out
    if isinstance(out.sent, Delivered):
        out.sent.clear(acc)
    else:
        acc[out.sent] = 0
    acc.nan_to_num_(0.0, 0.0, 0.0)
    if ok is not True:
        acc = acc.mul_(ok) if old is None else torch.where(ok, acc, old)
    state.residual = acc
    return out


def _apply_state_knobs(state: TopkState, decision: Any) -> None:
    """Apply the policy's knobs that live in the top-k state (``oktopk: {local_refresh, global_refresh}``)."""
    for key, value in decision.state_knobs.items():
        if getattr(state, key) != value:
            setattr(state, key, value)
