"""What a call costs on a GPU, audited on CPU tensors: host synchronizations, ops, and nondeterministic writes.

:class:`Audit` is a ``TorchDispatchMode``: every aten op that a block of code
dispatches passes through it. Run on the device code path
(:func:`colltune.algorithms.sparse.device_path`), the ops are the ones CUDA
would run, so what they would cost there can be counted on any machine:

- **Host synchronizations**: the ops that make the host wait for the GPU
  (:data:`SYNC_OPS`: a scalar read, an output whose size depends on the data,
  ``repeat_interleave`` without ``output_size``, boolean-mask indexing), and
  the reads of a tensor's contents into Python (``tolist``, ``numpy``), which
  on CUDA copy to the host. On CPU every tensor is "on the device", so a read
  of a tensor that would live on the host on a GPU counts too: the count is
  an upper bound.
- **Ops dispatched**: each costs host time, and each that is not a view a
  kernel launch on a GPU. The ``detach`` a dtype view's result comes back
  through under a dispatch mode (only there: ``torch.profiler`` records
  the view alone) is not counted.
- **Nondeterminism**: the ops PyTorch lists as nondeterministic on CUDA
  (``torch.use_deterministic_algorithms``) that accumulate (``index_add``,
  ``scatter_add``, ``scatter_reduce``, ``index_put`` with ``accumulate``,
  ``put_``, floating-point ``cumsum``, weighted ``bincount``, ``histc``)
  raise :class:`NondeterministicOp`; the listed ops that only write
  (``index_copy``, ``index_put``, ``scatter`` of a tensor) are checked to
  write each place once, which makes them deterministic: the audit reads
  their index and raises when it holds a duplicate.

Collectives (``c10d`` ops) are counted apart and never as syncs.
"""

from __future__ import annotations

import collections
import traceback
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops (overload packet names) that make the host wait for the device.
SYNC_OPS = frozenset({
    "_local_scalar_dense", "nonzero", "unique_consecutive", "_unique", "_unique2", "unique_dim",
    "unique_dim_consecutive", "masked_select", "_assert_async",
    "bincount", "histc",  # on CUDA both read their input's range (min and max) back to size or check the bins
})

#: aten ops that accumulate through atomics on CUDA: never on colltune's path.
ACCUMULATING_OPS = frozenset({
    "index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
    "index_reduce", "index_reduce_", "put", "put_", "histc", "_index_put_impl_", "embedding_dense_backward",
    "_embedding_bag_backward", "embedding_bag_backward",
})

#: aten ops listed as nondeterministic that only write: deterministic when every place is written once.
WRITING_OPS = frozenset({"index_copy", "index_copy_", "index_put", "index_put_", "scatter", "scatter_"})

#: aten ops that only make views: no kernel (:attr:`Audit.n_kernels` leaves them out).
VIEWS = frozenset({"slice", "select", "view", "expand", "as_strided", "alias", "unsqueeze", "squeeze", "t",
                   "transpose", "permute", "_unsafe_view", "split_with_sizes", "split", "detach", "lift_fresh",
                   "_reshape_alias", "unbind"})


class NondeterministicOp(AssertionError):
    """An op whose result on CUDA depends on thread scheduling ran on the audited path."""


class Audit(TorchDispatchMode):
    """Count ops, host syncs and collectives; refuse nondeterministic accumulation (see the module docstring).

    Args:
        trace: record where each sync came from (:attr:`where`).
        strict: raise :class:`NondeterministicOp` on a nondeterministic op;
            ``False`` only counts them (:attr:`nondeterministic`), to measure
            code that has them.

    Attributes:
        ops: aten op name -> count (collectives excluded).
        collectives: c10d op name -> count.
        syncs: op or read name -> count of host synchronizations.
        nondeterministic: what :class:`NondeterministicOp` would have said, per op seen (``strict=False``).
    """

    def __init__(self, *, trace: bool = False, strict: bool = True) -> None:
        super().__init__()
        self.trace, self.strict = trace, strict
        self.nondeterministic: list[str] = []
        #: Per sync, where colltune's code made it (with ``trace=True``): the innermost colltune frames.
        self.where: list[str] = []
        self.ops: collections.Counter[str] = collections.Counter()
        self.collectives: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()
        #: The result of the last op when it was a dtype view (see :meth:`__torch_dispatch__`).
        self._dtype_view: torch.Tensor | None = None

    @property
    def n_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def n_kernels(self) -> int:
        """The ops that are not views (:data:`VIEWS`): each a kernel launch on a GPU."""
        return sum(c for op, c in self.ops.items() if op not in VIEWS)

    @property
    def n_syncs(self) -> int:
        return sum(self.syncs.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        namespace, _, name = func._schema.name.partition("::")
        if namespace == "c10d":
            self.collectives[name] += 1
            return func(*args, **kwargs)
        if func is torch.ops.aten.detach.default and self._dtype_view is not None and args[0] is self._dtype_view:
            # A dtype view's result comes back through a detach under a dispatch mode only: outside one,
            # torch.profiler records the view alone. Not an op the call dispatches.
            self._dtype_view = None
            return func(*args, **kwargs)
        self.ops[name] += 1
        try:
            self._check(name, func, args, kwargs)
        except NondeterministicOp as exc:
            if self.strict:
                raise
            self.nondeterministic.append(str(exc))
        if name in SYNC_OPS:
            self.sync(name)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.sync(name)
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.sync("index(bool mask)")
        out = func(*args, **kwargs)
        self._dtype_view = out if func is torch.ops.aten.view.dtype else None
        return out

    def sync(self, what: str) -> None:
        """Count one host synchronization (and where it came from, when tracing)."""
        self.syncs[what] += 1
        if self.trace:
            frames = [f for f in traceback.extract_stack() if "/tests/" not in f.filename and "/torch/" not in f.filename]
            self.where.append(f"{what}: " + " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames[::-1][:4]))

    def _check(self, name: str, func: Any, args: tuple, kwargs: dict) -> None:
        if name in ACCUMULATING_OPS or (name == "index_put_" and _arg(func, args, kwargs, "accumulate", False)):
            raise NondeterministicOp(f"{func} accumulates with atomics on CUDA: its sums depend on thread scheduling")
        if name == "cumsum" and args[0].is_floating_point():
            raise NondeterministicOp(f"{func} on floating point is nondeterministic on CUDA")
        if name == "bincount" and _arg(func, args, kwargs, "weights", None) is not None:
            raise NondeterministicOp(f"{func} with weights is nondeterministic on CUDA")
        if name in WRITING_OPS:
            for index in _write_indices(name, func, args, kwargs):
                # Ops run here, inside the mode's own dispatch, are not audited.
                flat = index.reshape(-1)
                if name.startswith("scatter") or flat.numel() != torch.unique(flat).numel():
                    raise NondeterministicOp(f"{func} writes a place twice: the winner is unspecified on CUDA")


def _arg(func: Any, args: tuple, kwargs: dict, name: str, default: Any) -> Any:
    """The value of argument ``name`` of a call of ``func``, positional or keyword."""
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else default
    return default


def _write_indices(name: str, func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The integer index tensors through which a writing op writes."""
    if name.startswith("index_copy"):
        return [args[2]]
    if name.startswith("index_put"):
        return [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype != torch.bool]
    src = _arg(func, args, kwargs, "src", None)
    return [args[2]] if isinstance(src, torch.Tensor) else []


@contextmanager
def audit(*, trace: bool = False, strict: bool = True) -> Iterator[Audit]:
    """Audit the block (see :class:`Audit`): dispatched ops, and reads of tensor contents into Python (``tolist``, ``numpy``)."""
    mode = Audit(trace=trace, strict=strict)
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def reader(name: str) -> Any:
        original = saved[name]

        def read(self: torch.Tensor, *a: Any, **kw: Any) -> Any:
            mode.sync(f"Tensor.{name}")
            return original(self, *a, **kw)

        return read

    for name in saved:
        setattr(torch.Tensor, name, reader(name))
    try:
        with mode:
            yield mode
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
