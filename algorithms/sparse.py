"""COO helpers shared by every algorithm: dtypes, coalescing, packing, merging.

A sparse tensor here is COO over the first dimension: 1-D ``indices`` and
``values`` of shape ``[k, *row_shape]``, flattened internally to ``[k, r]``
with ``r`` the number of elements per row.

Determinism is the point of this module. Every cross-rank reduction goes
through :func:`merge_sources`, which adds the sources in a fixed order with
unique indices inside each source, so the same inputs give the same bits on
every rank and on every backend (no atomics race, no arrival-order sums).

Two code paths do the work. CPU tensors take the *host* path (NumPy: sorts,
sums, selections and packing, fastest for a CPU's small calls); tensors on
other devices take the *device* path (torch operations that also run on
CUDA). :func:`on_host` chooses, and every module that branches on the device
asks it. The switch :func:`device_path` (or ``COLLTUNE_DEVICE_PATH=1`` in the
environment when this module is imported) sends CPU tensors down the device
path too, with the backend's own collectives (:class:`~colltune.algorithms.comm.Comm`
runs nothing direct there, as on NCCL), so that the code CUDA runs is tested,
and compared bit for bit with the host path, on machines without a GPU.
"""

from __future__ import annotations

import functools
import math
import os
from contextlib import contextmanager
from itertools import accumulate
from typing import Any, Iterator, Sequence

import numpy as np

from colltune.algorithms.lazy import torch

__all__ = [
    "on_host",
    "shares_storage",
    "writable",
    "fresh",
    "out_buffer",
    "cast",
    "row_numbers",
    "device_path",
    "set_device_path",
    "VALUE_DTYPES",
    "INDEX_DTYPES",
    "accum_dtype",
    "wire_index_dtype",
    "coalesce",
    "pack",
    "reinterpret",
    "entry_bytes",
    "unpack",
    "merge_sources",
    "dtype_code",
    "split_layout",
    "gather_mode",
    "merge_runs",
    "read_part_counts",
    "run_starts",
    "merge_host_pieces",
    "offsets",
    "pack_host",
    "unpack_host",
    "merge_host",
    "sum_by_index",
    "sum_sorted_runs",
    "sum_sorted_runs_padded",
    "Parts",
    "Batch",
    "upload",
    "mask_positions",
    "Magnitudes",
]

#: Names of the value dtypes colltune reduces (:data:`VALUE_DTYPES`). fp16 and bf16 are accumulated in fp32.
VALUE_DTYPE_NAMES: tuple[str, ...] = ("float32", "float64", "float16", "bfloat16")
#: Names of the index dtypes accepted on input (:data:`INDEX_DTYPES`). Output indices are always int64.
INDEX_DTYPE_NAMES: tuple[str, ...] = ("int32", "int64")
#: Value dtypes colltune reduces, and index dtypes accepted on input: torch's dtypes of the names above, made
#: when first read (by the module's ``__getattr__``), so that importing this module needs no torch.
VALUE_DTYPES: tuple[torch.dtype, ...]
INDEX_DTYPES: tuple[torch.dtype, ...]
#: Small integers naming dtypes in metadata records (:func:`dtype_code`).
_DTYPE_CODES: dict[str, int] = {"float32": 1, "float64": 2, "float16": 3, "bfloat16": 4, "int32": 5, "int64": 6}


def __getattr__(name: str) -> Any:
    if name in ("VALUE_DTYPES", "INDEX_DTYPES"):
        dtypes = tuple(getattr(torch, n) for n in (VALUE_DTYPE_NAMES if name == "VALUE_DTYPES" else INDEX_DTYPE_NAMES))
        globals()[name] = dtypes
        return dtypes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_INT32_MAX = 2**31 - 1

#: Whether CPU tensors take the device path (see the module docstring); read from the environment once.
_device_path: bool = os.environ.get("COLLTUNE_DEVICE_PATH", "").strip() not in ("", "0")


def on_host(where: torch.device | torch.Tensor) -> bool:
    """True when work on ``where`` (a device, or a tensor's device) takes the host (NumPy) path.

    That is on the CPU, unless the device path is switched on
    (:func:`device_path`), which sends CPU tensors down the path CUDA tensors take.
    """
    if _device_path:
        return False
    device = where.device if isinstance(where, torch.Tensor) else where
    return device.type == "cpu"


def set_device_path(enabled: bool) -> bool:
    """Send CPU tensors down the device path (``True``) or the host path (``False``); return the previous setting.

    Process-wide, for tests and comparisons: every rank of a group must hold
    the same setting, or their collectives differ.
    """
    global _device_path
    before, _device_path = _device_path, bool(enabled)
    return before


@contextmanager
def device_path(enabled: bool = True) -> Iterator[None]:
    """Within the ``with`` block, CPU tensors take the device path (or, with ``enabled=False``, the host path).

    Example:
        >>> import torch
        >>> with device_path():
        ...     on_host(torch.zeros(1))
        False
    """
    before = set_device_path(enabled)
    try:
        yield
    finally:
        set_device_path(before)


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same storage (so writing one may change the other); empty ones share none."""
    pa, pb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
    return pa != 0 and pa == pb and a.device == b.device


#: From this many bytes a fresh CPU tensor comes from NumPy (:func:`fresh`).
HUGE_PAGES_FROM = 4 << 20
@functools.cache
def _np_of(dtype: torch.dtype) -> Any:
    """NumPy's dtype for the bytes of a torch dtype :func:`fresh` makes (bf16 as its 16 raw bits), or ``None``."""
    return {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16, torch.bfloat16: np.int16,
            torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.uint8: np.uint8,
            torch.bool: np.bool_}.get(dtype)


def _from_numpy(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`fresh` takes a tensor of this shape and dtype from NumPy: a large one on the CPU."""
    return device.type == "cpu" and _np_of(dtype) is not None and math.prod(shape) * dtype.itemsize >= HUGE_PAGES_FROM


def fresh(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Return an uninitialized tensor, for a result or a buffer a call writes once.

    On the CPU, from :data:`HUGE_PAGES_FROM` bytes on, NumPy allocates it:
    NumPy asks the kernel for transparent huge pages (``madvise``), so
    writing it the first time faults in 2 MiB at a time instead of 4 KiB.
    New memory is faulted in on every call (glibc returns blocks over 32
    MiB to the kernel when they are freed), and there this makes filling 64
    MiB about 4x faster (8 ms against 34 with torch's allocator on a
    two-core machine, where writing into memory already faulted takes 5).
    Elsewhere, and for small tensors, ``torch.empty``.
    """
    device = torch.device(device)
    if not _from_numpy(shape, dtype, device):
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    t = torch.from_numpy(np.empty(tuple(shape), dtype=_np_of(dtype)))
    return t.view(dtype) if t.dtype != dtype else t


def out_buffer(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
    """Return an ``out=`` tensor from NumPy for a large CPU result, else ``None`` (the op allocates as usual).

    For the ops with an ``out`` argument: on the device path the call stays one op.
    """
    device = torch.device(device)
    return fresh(shape, dtype, device) if _from_numpy(shape, dtype, device) else None


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return ``t`` in ``dtype``: ``t`` itself when it already is, else a copy (large CPU ones from :func:`fresh`)."""
    if t.dtype == dtype:
        return t
    out = out_buffer(t.shape, dtype, t.device)
    return t.to(dtype) if out is None else out.copy_(t)


def row_numbers(n: int, device: torch.device | str) -> torch.Tensor:
    """Return ``0..n-1`` as int64 on ``device``, in memory from :func:`fresh`."""
    device = torch.device(device)
    if not _from_numpy((n,), torch.int64, device):
        return torch.arange(n, device=device)
    return torch.from_numpy(np.arange(n, dtype=np.int64))


def writable(t: torch.Tensor) -> bool:
    """Whether a call may reduce into ``t`` and hand it to a collective: contiguous, and not an inference tensor."""
    return t.is_contiguous() and not t.is_inference()


@functools.cache
def dtype_code(dtype: torch.dtype) -> int:
    """Return a small integer naming ``dtype``, for metadata records (0 if unknown)."""
    return _DTYPE_CODES.get(str(dtype).rpartition(".")[2], 0)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype sums are accumulated in (fp32 for fp16 and bf16)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def wire_index_dtype(size: int) -> torch.dtype:
    """Return the narrowest index dtype that holds every row index below ``size``."""
    return torch.int32 if size <= _INT32_MAX else torch.int64


def coalesce(indices: torch.Tensor, values: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort ``indices``, sum the rows of duplicates, and return int64 indices with values in ``acc``.

    Args:
        indices: 1-D integer tensor, any order, duplicates allowed.
        values: ``[k, r]`` tensor, one row per index.
        acc: the accumulation dtype of the result.

    Returns:
        ``(idx, vals)`` with ``idx`` int64, sorted and unique, and ``vals`` of
        shape ``[len(idx), r]`` and dtype ``acc``. The rows of duplicates are
        summed in an order fixed by the input (the same input gives the same bits).
        Sorted unique input keeps its values' bits; on the host path it is
        returned without a copy of its indices. On the device path the
        count of unique indices is the one host read.
    """
    idx = cast(indices, torch.int64)
    vals = cast(values, acc)
    if idx.numel() <= 1:
        return idx, vals
    if on_host(idx):
        return _coalesce_host(idx, vals)
    ordered = (idx[1:] > idx[:-1]).all()  # stays on the device: no host read
    idx, order = torch.sort(idx, stable=True)
    vals = vals.index_select(0, order)
    union, sums = sum_sorted_runs(idx, vals)
    if union.numel() == idx.numel():  # sorted unique input keeps its bits, as the host path returns it
        sums = torch.where(ordered, vals, sums)
    return union, sums


class Parts:
    """A fused call's tensors laid end to end in one index space, and how many result rows each one gets.

    Attributes:
        bounds: the tensors' row offsets (``bounds[j]`` to ``bounds[j + 1]``
            is tensor ``j``), host ints.
        sizes: each tensor's count of result rows, set by the reduction
            that produced the result when it read them with its own count
            (:func:`sum_sorted_runs`), else ``None`` (the caller reads them).
    """

    __slots__ = ("bounds", "sizes")

    def __init__(self, bounds: Sequence[int]) -> None:
        self.bounds = list(bounds)
        self.sizes: list[int] | None = None


def count_between(idx: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """How many of sorted ``idx`` lie in each ``[bounds[j], bounds[j+1])``: int64, where ``idx`` is, not read."""
    return torch.diff(torch.searchsorted(idx, upload(bounds, idx.device)))


def read_sizes(heads: torch.Tensor, parts: Parts | None) -> list[int]:
    """Read every owner's head (``[P, 1 + T]`` int64: its size, then with ``parts`` its count per part) in one read.

    Returns the sizes; with ``parts`` sets ``parts.sizes``, each part's
    counts summed over the owners.
    """
    table = heads.tolist()
    if parts is not None:
        parts.sizes = [sum(col) for col in zip(*(row[1:] for row in table))]
    return [row[0] for row in table]


def sum_sorted_runs(idx: torch.Tensor, vals: torch.Tensor, parts: Parts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the rows of each run of equal indices in sorted ``idx``, in row order: the device path's one reduction.

    ``idx`` is sorted int64 (``[K]``), ``vals`` ``[K, r]`` in the accumulation
    dtype. Returns the sorted unique indices and, per index, ``((0 + v_first)
    + v_next) + ...`` in the order the rows come, the bits the host path's
    :func:`sum_by_index` gives (see :func:`_segment_sums`). The run count is
    the one host read (``unique_consecutive``); with ``parts`` that read also
    brings each part's count of unique indices, into ``parts.sizes``.
    """
    if parts is not None:
        return _sum_sorted_runs_parts(idx, vals, parts)
    uniq, counts = torch.unique_consecutive(idx, return_counts=True)
    if uniq.numel() == idx.numel():
        return idx, vals + 0.0  # 0 + v, as a sum gives (a lone -0.0 comes out +0.0); never in place
    return uniq, _segment_sums(vals, counts)


def sum_sorted_runs_padded(idx: torch.Tensor, vals: torch.Tensor, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sum_sorted_runs` with no host read: the result padded to ``K`` rows.

    The first ``u`` rows (``u`` the run count, never read) are the sums
    :func:`sum_sorted_runs` gives, bit for bit; the rest have index ``fill``
    and zero rows. For a caller that only selects among the sums by
    magnitude (zeros are never selected) and so never needs ``u``.
    """
    return _padded_runs(idx, vals, run_starts(idx), fill)


def run_starts(idx: torch.Tensor) -> torch.Tensor:
    """Where a run of equal values begins in sorted ``idx``: a bool tensor, the first element set."""
    starts = torch.ones(idx.numel(), dtype=torch.bool, device=idx.device)
    torch.ne(idx[1:], idx[:-1], out=starts[1:])
    return starts


def _padded_runs(
    idx: torch.Tensor, vals: torch.Tensor, starts: torch.Tensor, fill: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the runs of sorted ``idx`` that begin where ``starts`` is set, padded to ``K`` rows (index ``fill``, zeros)."""
    offs = mask_positions(starts, idx.numel() + 1)  # past the run count, position k: empty runs, zero sums
    return _run_heads(idx, offs, fill), _segment_sums(vals, offsets=offs)


def _run_heads(idx: torch.Tensor, offs: torch.Tensor, fill: int) -> torch.Tensor:
    """Each run's index from its first position in ``offs`` (``K + 1``); position ``K``, past the runs, gives ``fill``."""
    return torch.cat((idx, idx.new_full((1,), fill))).index_select(0, offs[: idx.numel()])


def _sum_sorted_runs_parts(idx: torch.Tensor, vals: torch.Tensor, parts: Parts) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sum_sorted_runs`, reading the run count and every part's with it in one read."""
    k = idx.numel()
    # The runs starting before each part's first position, in the one host read.
    flags = run_starts(idx)
    u = read_part_counts(flags, torch.searchsorted(idx, upload(parts.bounds, idx.device)), parts)
    if u == k:
        return idx, vals + 0.0  # as above
    offs = mask_positions(flags, u + 1)  # where each run begins, then k (past the last run)
    return idx.index_select(0, offs[:u]), _segment_sums(vals, offsets=offs)


def read_part_counts(flags: torch.Tensor, at: torch.Tensor, parts: Parts) -> int:
    """Count the set ``flags`` before each part's first position ``at`` (``T + 1``, int64), in one host read.

    Sets ``parts.sizes`` (each part's count of set flags) and returns the total.
    """
    runs = torch.zeros(flags.numel() + 1, dtype=torch.int64, device=flags.device)  # runs[x]: set before x
    torch.cumsum(flags, 0, out=runs[1:])
    seen = runs.index_select(0, at).tolist()
    parts.sizes = [b - a for a, b in zip(seen, seen[1:])]
    return seen[-1]


def _segment_sums(vals: torch.Tensor, lengths: torch.Tensor | None = None,
                  offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Sum ``[K, r]`` rows in consecutive runs (a run of 0 gives zeros), each from +0, in order.

    The runs are given by their ``lengths``, or by their ``offsets`` (each
    run's first row, then ``K``: :func:`mask_positions` asked for one more), which saves
    ``segment_reduce`` the running sum it makes of lengths. No atomics:
    ``torch.segment_reduce`` adds each output element's run sequentially in
    one thread (its 2-D kernel; values always go as ``[K, r]``), so the
    result is a pure function of the input on CUDA too, where ``index_add_``
    races between duplicates.
    """
    if vals.shape[1] == 0:
        runs = lengths.numel() if lengths is not None else offsets.numel() - 1
        return vals.new_zeros((runs, 0))
    return torch.segment_reduce(vals, "sum", lengths=lengths, offsets=offsets, axis=0, unsafe=True)


def upload(data: "list[int] | np.ndarray | torch.Tensor", device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Return host data (a list, a NumPy array or a CPU tensor) as a tensor on ``device`` (a list or an array as
    ``dtype``, by default int64), without a host sync.

    A blocking copy to a CUDA device is followed by a synchronization of the
    stream (the host waits for every queued kernel); this one is
    non-blocking: from pageable memory CUDA stages the bytes before the call
    returns, so the source may be dropped or reused at once, and the host
    goes on queuing. On the CPU the data is only wrapped.
    """
    t = data if isinstance(data, torch.Tensor) else torch.as_tensor(data, dtype=dtype or torch.int64)
    return t if t.device == device else t.to(device, non_blocking=True)


class Batch:
    """Many sparse tensors of one row width coalesced on the device in one pass, with one host read.

    The device path's way to validate and coalesce a call's tensors (one for
    ``sparse_allreduce``, many for a fused call): the tensors' indices are
    laid end to end in one index space (tensor ``j`` at offset ``A_j``, as
    TorchRec's jagged tensors pack features), sorted once and summed per run
    once (:func:`_segment_sums`: each tensor's result has the bits its own
    :func:`coalesce` gives, except that every row is a sum from ``+0``, also
    where the input came sorted and unique: a ``-0.0`` comes out ``+0.0``,
    as every reduction of it does anyway, for three to nine fewer kernels).
    Building a batch launches a fixed number of
    kernels whatever the number of tensors and reads nothing; what the host
    needs is :attr:`stats`, ``[any index out of range (0 or 1), unique count
    of tensor 0, of tensor 1, ...]``, a small int64 tensor the caller reads
    once (or sends in the metadata record) and hands, less its first
    element, to :meth:`finish`, which sums the runs without another read;
    :meth:`span` then slices tensors' results out of the union.

    Args:
        items: ``(indices, values, size)`` per tensor: 1-D integer indices,
            ``[k, r]`` values of one ``r`` and dtype, the number of rows.
        acc: the accumulation dtype.
    """

    def __init__(self, items: list[tuple[torch.Tensor, torch.Tensor, int]], acc: torch.dtype) -> None:
        device = items[0][1].device
        t = self.count = len(items)
        sizes = [n for _, _, n in items]
        ks = [i.numel() for i, _, _ in items]
        self.at, self.k, self.n = offsets(sizes), sum(ks), sizes[0]
        k = self.k
        if t == 1:  # no offsets, no per-tensor bookkeeping: a third of the kernels
            raw, vals = items[0][0].to(torch.int64), items[0][1].to(acc)
        else:
            # Every host figure the kernels need, in one upload: offsets, sizes, entry counts.
            meta = upload([*self.at, *sizes, *ks], device)
            base, limit, kt = meta[:t], meta[t + 1 : 2 * t + 1], meta[2 * t + 1 :]
            raw, vals = torch.cat([i for i, _, _ in items]).to(torch.int64), torch.cat([v for _, v, _ in items]).to(acc)
            owner = torch.repeat_interleave(torch.arange(t, device=device), kt, output_size=k)
            bad, raw = ((raw < 0) | (raw >= limit[owner])).any(), raw + base[owner]
        self.sorted, order = torch.sort(raw, stable=True)
        self.vals = vals.index_select(0, order)
        self.starts = run_starts(self.sorted)
        #: Where each run begins, padded to ``k + 1`` with ``k``, once :meth:`padded_indices` found them.
        self._runs_at: torch.Tensor | None = None
        if t == 1:
            if k and self.n:
                # An index lies outside [0, n) exactly when its floor quotient by n is not 0; sorted, the first
                # and the last tell (one kernel and a reduction, where two comparisons and an or took three).
                bad = torch.div(self.sorted[:: max(k - 1, 1)], self.n, rounding_mode="floor").any()
            else:  # no entries: none out of range; entries of a tensor of no rows: all of them
                bad = torch.full((), bool(k), dtype=torch.bool, device=device)
            self.stats = torch.stack((bad, self.starts.sum()))  # promoted to int64
        else:
            runs = torch.zeros(k + 1, dtype=torch.int64, device=device)
            torch.cumsum(self.starts, 0, out=runs[1:])
            cut = torch.searchsorted(self.sorted, meta[: t + 1])
            self.stats = torch.cat((bad.view(1), torch.diff(runs.index_select(0, cut))))  # promoted to int64

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A batch of one tensor, coalesced with no host read: its rows padded to the input's ``k``.

        Returns ``(indices, values, stats)``: ``[k]`` int64 indices and
        ``[k, r]`` rows of which the first ``count`` are the coalesced
        entries, the bits :meth:`finish` gives, the rest indices equal to
        the size (past every real one) with zero rows; and ``stats``, the
        device tensor ``[bad, count]`` (int64; ``bad`` is 1 when an index is
        out of range). The caller learns ``count`` later (it rides in the
        metadata record, where ``stats`` fills the fields ``error`` and
        ``count`` at once) and slices.
        """
        if self.count != 1:
            raise ValueError(f"padded() coalesces a batch of one tensor, not {self.count}")
        if self.k == 0:
            return self.sorted, self.vals, self.stats
        idx = self.padded_indices()  # the batch's size is the tensor's: pads indexed n
        return idx, _segment_sums(self.vals, offsets=self._runs_at), self.stats

    def padded_indices(self) -> torch.Tensor:
        """Before :meth:`finish`: the union's sorted unique indices, padded to ``k`` with the batch's size; no read.

        The indices an algorithm counts its record payload from before the
        host knows the union's size
        (:meth:`~colltune.algorithms.base.Algorithm.eager_payload`): the
        first ``u`` are :meth:`finish`'s union, in the same places, the rest
        past every real index. :meth:`finish` reuses the run positions found here.
        """
        if self._runs_at is None:
            self._runs_at = mask_positions(self.starts, self.k + 1)  # past the run count, position k
        return _run_heads(self.sorted, self._runs_at, self.at[-1])

    def finish(self, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the batch's union: its sorted unique int64 indices and their summed rows, tensor after tensor.

        The indices are in the batch's index space: for a batch of one, the
        tensor's own, so the union is its result; a caller takes tensors'
        in their own spaces through :meth:`span`. ``counts`` are the unique
        counts of :attr:`stats` as the host learned them; a batch with an
        index out of range is the caller's error to raise first. Nothing
        more is read or uploaded.
        """
        u, k = sum(counts), self.k
        if u == k:
            uniq, sums = self.sorted, self.vals + 0.0  # each from +0
        else:
            # The u runs' first rows, then k (their end).
            offs = mask_positions(self.starts, u + 1) if self._runs_at is None else self._runs_at[: u + 1]
            uniq, sums = self.sorted.index_select(0, offs[:u]), _segment_sums(self.vals, offsets=offs)
        #: The union in the batch's index space and its rows, and where each tensor's part starts.
        self.union, self.sums, self.parts = uniq, sums, offsets(counts)
        return uniq, sums

    def span(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After :meth:`finish`: tensors ``first..last`` (positions in the batch) as one, laid end to end from 0.

        The result is what concatenating their coalesced entries, each
        index shifted by its tensor's offset from ``first``'s, gives, in two ops.
        """
        lo, hi = self.parts[first], self.parts[last + 1]
        idx = self.union[lo:hi]
        return (idx - self.at[first] if self.at[first] else idx), self.sums[lo:hi]


def _coalesce_host(idx: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # NumPy's integer sort (vectorized quicksort) is several times faster on
    # the CPU than torch.sort, and sorting is most of a sparse call's compute.
    a = idx.numpy()
    if _increasing(a):
        return idx, vals
    union, sums = sum_by_index(a, vals)
    return torch.from_numpy(union), sums


#: Elements per step of :func:`_increasing`: its comparisons stay in the cache, and no temporary of ``k`` bytes.
_CHUNK = 1 << 16


def _increasing(a: np.ndarray) -> bool:
    """Whether ``a`` strictly increases (sorted, no duplicates), compared a chunk at a time."""
    k = a.size
    if k <= _CHUNK:
        return bool((a[1:] > a[:-1]).all())
    flags = np.empty(_CHUNK, dtype=bool)
    for lo in range(0, k - 1, _CHUNK):
        hi = min(lo + _CHUNK, k - 1)
        out = flags[: hi - lo]
        np.greater(a[lo + 1 : hi + 1], a[lo:hi], out=out)
        if not out.all():
            return False
    return True


def sum_by_index(idx: np.ndarray, vals: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """Return the sorted unique indices and, per index, the sum of its rows, added in list order.

    ``idx`` is int64 (``[K]``), ``vals`` a CPU tensor ``[K, r]``. Each sum is
    ``((0 + v_first) + v_next) + ...`` in the order the rows come in ``vals``.
    Nothing is shared with the inputs.

    A stable sort groups equal indices with their rows in list order; fp32
    and fp64 rows are then summed per group by ``embedding_bag`` (``sum``
    mode, the sorted positions as the bags' indices), which adds each bag
    from zero in that order, about 3x faster on embedding rows than
    ``index_add_`` (the same bits; tested, signed zeros and NaN included).
    Other dtypes use ``index_add_``, which on the CPU adds in the order of
    its index list.
    """
    if idx.size == 0:
        return idx.copy(), torch.zeros((0, vals.shape[1]), dtype=vals.dtype)
    if idx.size <= _SMALL_SUM and vals.dtype in (torch.float32, torch.float64) and vals.shape[1] > 0:
        return _sum_small(idx, vals.detach().contiguous().numpy())
    order, a = _sorted_order(idx)
    new = _run_starts(a)
    if vals.dtype in (torch.float32, torch.float64) and vals.shape[1] > 0:
        with torch.no_grad():
            out = torch.nn.functional.embedding_bag(
                torch.from_numpy(order), vals.contiguous(), torch.from_numpy(np.flatnonzero(new)), mode="sum"
            )
        return a[new], out
    inverse, groups = _group_of(order, new)
    out = torch.zeros((groups, vals.shape[1]), dtype=vals.dtype)
    out.index_add_(0, torch.from_numpy(inverse), vals)
    return a[new], out


def _run_starts(a: np.ndarray) -> np.ndarray:
    """Mark, in sorted ``a`` (non-empty), the first element of every run of equal values."""
    new = np.empty(a.size, dtype=bool)
    new[0] = True
    np.not_equal(a[1:], a[:-1], out=new[1:])
    return new


def _group_of(order: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, int]:
    """Return, per input position, the index of its run, and the run count.

    ``order`` sorts the input, ``new`` marks run starts.
    """
    seg = np.cumsum(new) - 1
    inverse = np.empty_like(seg)
    inverse[order] = seg
    return inverse, int(seg[-1]) + 1


#: Up to this many entries :func:`sum_by_index` and :func:`merge_host` stay
#: in NumPy: a few operations of a microsecond each, where the torch path
#: costs about 17 us in per-call overhead alone (measured on 7 to 257
#: entries: 3x faster when the indices are unique, 1.6x at 7 entries with
#: duplicates, even at 256, where ``np.add.at`` catches up with ``embedding_bag``).
_SMALL_SUM = 256


def _sum_small(idx: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """:func:`sum_by_index` of a few fp32 or fp64 rows, the same bits (each sum starts at +0)."""
    order = np.argsort(idx, kind="stable")
    a = idx[order]
    new = _run_starts(a)
    if new.all():
        out = vals[order]
        out += 0.0  # 0 + v: a lone -0.0 comes out +0.0, as from a sum
        return a, torch.from_numpy(out)
    inverse, groups = _group_of(order, new)
    out = np.zeros((groups, vals.shape[1]), dtype=vals.dtype)
    np.add.at(out, inverse, vals)  # unbuffered, in list order: ((0 + v_first) + v_next) + ...
    return a[new], torch.from_numpy(out)


def _sorted_order(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(order, idx[order])`` for a stable ascending sort of int64 ``idx``.

    When the indices leave room, each is shifted left and its position put
    in the low bits, and the keys are sorted as plain integers: NumPy's
    vectorized integer sort, several times faster than an argsort, and
    stable by construction (equal indices keep their positions' order).
    """
    n = idx.size
    shift = max(1, (n - 1).bit_length())
    if int(idx.min()) >= 0 and int(idx.max()) < (1 << (62 - shift)):
        key = np.left_shift(idx, shift)
        key |= np.arange(n, dtype=np.int64)
        key.sort()
        return key & ((1 << shift) - 1), key >> shift
    order = np.argsort(idx, kind="stable")
    return order, idx[order]


def pack(idx: torch.Tensor, vals: torch.Tensor, index_dtype: torch.dtype, value_dtype: torch.dtype) -> torch.Tensor:
    """Pack entries into one ``uint8`` tensor of shape ``[k, entry_bytes]``.

    Each row holds one index (``index_dtype``) followed by its value row
    (``value_dtype``), so a single collective moves indices and values
    together and any split along dimension 0 is a split between entries.
    """
    k = idx.numel()
    if k == 0:
        return torch.empty((0, entry_bytes(vals.shape[1], index_dtype, value_dtype)), dtype=torch.uint8,
                           device=vals.device)
    return torch.cat((_byte_rows(idx, index_dtype), _byte_rows(vals, value_dtype)), dim=1)


def _byte_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return ``[k]`` or ``[k, w]`` ``t`` in ``dtype`` as ``uint8`` ``[k, w * itemsize]`` (``w`` = 1 for ``[k]``),
    copied only where no byte view exists.

    A byte view needs a unit stride along the last dimension, which torch
    does not promise even of a tensor it calls contiguous (a dimension of
    size 0 or 1 may carry any stride: a one-element slice, zero-width rows),
    nor of sliced or expanded (stride 0) views: those are copied into
    row-major storage first. The view of a ``[k, w]`` tensor as ``uint8`` is
    already ``[k, w * itemsize]`` (one op); a ``[k]`` one takes a second.
    """
    t = t.to(dtype)
    if not t.is_contiguous() or t.stride(-1) != 1:
        t = torch.empty(t.shape, dtype=dtype, device=t.device).copy_(t)
    raw = t.view(torch.uint8)
    return raw if t.dim() == 2 else raw.view(t.shape[0], dtype.itemsize)


#: Rows of at least this many bytes travel point to point as separate index
#: and value messages, each received in place (struct of arrays); narrower
#: entries travel packed, and so do all entries of a collective gather
#: (:func:`gather_mode`). Packing costs a copy of every byte on each side, and
#: unpacking another; separate messages cost one more message per peer, which
#: pays off once the rows are most of the bytes (embedding rows).
SPLIT_MIN_ROW_BYTES = 32


def split_layout(row_numel: int, wire_dtype: torch.dtype) -> bool:
    """True when entries of ``row_numel`` values of ``wire_dtype`` travel as separate index and row messages."""
    return row_numel * wire_dtype.itemsize >= SPLIT_MIN_ROW_BYTES


def gather_mode(mode: str, row_numel: int, wire_dtype: torch.dtype, point_to_point: bool = True) -> str:
    """Resolve a gather knob (``auto``, ``p2p``, ``pad``, ``alltoall``) for entries of this width.

    Returns ``p2p`` when the entries move point to point, unpacked: asked
    for, or ``auto`` with rows of :data:`SPLIT_MIN_ROW_BYTES` or more where
    ``point_to_point`` allows it (:func:`~colltune.algorithms.schedule.p2p_gathers`:
    the host path, or a group inside one node). Otherwise the mode
    :meth:`~colltune.algorithms.comm.Comm.all_gather_v` takes: ``auto`` pads
    unless padding adds over a quarter.
    """
    if mode == "p2p" or (mode == "auto" and point_to_point and split_layout(row_numel, wire_dtype)):
        return "p2p"
    return mode


def offsets(counts: "list[int] | tuple[int, ...]") -> list[int]:
    """Return the prefix sums ``[0, c0, c0 + c1, ...]`` of ``counts``."""
    return [0, *accumulate(map(int, counts))]


def entry_bytes(row_numel: int, index_dtype: torch.dtype, value_dtype: torch.dtype) -> int:
    """Return the packed size of one entry in bytes."""
    return index_dtype.itemsize + row_numel * value_dtype.itemsize


def reinterpret(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View the bytes of ``buf`` (``uint8``), flattened, as ``dtype``, copying only when layout requires it."""
    flat = buf.reshape(-1)
    if flat.storage_offset() % dtype.itemsize:
        flat = flat.clone()
    return flat.view(dtype)


def unpack(
    buf: torch.Tensor, row_numel: int, index_dtype: torch.dtype, value_dtype: torch.dtype, strided: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Invert :func:`pack`: return int64 indices and ``[k, row_numel]`` values in ``value_dtype``.

    Where the entry's bytes allow it (each column a whole number of the
    dtype's elements from an aligned start), a column is read through a
    view of ``buf`` in its dtype and copied out once (the indices widened
    into fresh memory; one entry's, or int64 ones, cloned first). With ``strided``
    the values stay that view, not copied at all: for a caller that only
    gathers rows from them (a sort's order, a selection), never one that
    hands them out. Otherwise a column is copied out first.
    """
    k = buf.shape[0]
    isz = index_dtype.itemsize
    if _viewable(buf, isz):
        col = buf.view(index_dtype)[:, 0]
        if index_dtype == torch.int64 or k < 2:  # still a view; or one entry, whose stride a cast keeps
            col = col.clone(memory_format=torch.contiguous_format)
        idx = col.to(torch.int64)
    else:
        idx = reinterpret(buf[:, :isz], index_dtype).view(k).to(torch.int64)
    vsz = value_dtype.itemsize
    if isz % vsz == 0 and _viewable(buf, vsz):
        vals = buf.view(value_dtype)[:, isz // vsz :]
        if not strided:
            vals = vals.clone(memory_format=torch.contiguous_format)
    else:
        vals = reinterpret(buf[:, isz:], value_dtype).view(k, row_numel)
    return idx, vals


def _viewable(buf: torch.Tensor, itemsize: int) -> bool:
    """Whether ``uint8`` ``[k, e]`` ``buf`` has a view in a dtype of ``itemsize`` bytes: rows and start aligned."""
    return (buf.shape[1] % itemsize == 0 and buf.stride(1) == 1 and buf.stride(0) % itemsize == 0
            and buf.storage_offset() % itemsize == 0)


def merge_sources(
    sources: list[tuple[torch.Tensor, torch.Tensor]], size: int, row_numel: int, acc: torch.dtype, device: torch.device,
    parts: Parts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum coalesced sources into one coalesced result, adding in list order.

    Every source must have sorted unique int64 indices. The union of indices
    is returned (an index whose sum cancels to zero is kept), and each output
    row is ``((0 + v_0) + v_1) + ...`` over the sources that hold it, in list
    order, whatever the path taken, so every rank that merges the same list
    gets the same bits.

    On the host path a dense scratch of ``size`` rows serves sources dense
    enough that ``O(size)`` work is cheaper than sorting, else a sort of the
    concatenated indices; on the device path a stable sort of the
    concatenation and :func:`sum_sorted_runs` (no atomics).
    """
    sources = [(i, v) for i, v in sources if i.numel() > 0]
    if not sources:
        return (
            torch.empty(0, dtype=torch.int64, device=device),
            torch.empty((0, row_numel), dtype=acc, device=device),
        )
    if len(sources) == 1:  # each row 0 + v in acc, as v + 0.0 gives it (addition commutes), a fresh tensor
        i, v = sources[0]
        return i, v.to(acc) + 0.0
    total = sum(i.numel() for i, _ in sources)
    if on_host(device):
        return _merge_host(sources, size, total, acc)
    # Concatenated in list order, a stable sort keeps each index's rows in source order.
    cat, order = torch.sort(torch.cat([i for i, _ in sources]), stable=True)
    vals = torch.cat([v.to(acc) for _, v in sources]).index_select(0, order)
    return sum_sorted_runs(cat, vals, parts)


def _merge_host(
    sources: list[tuple[torch.Tensor, torch.Tensor]], size: int, total: int, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return merge_host_pieces([(i.numpy(), v.to(acc).numpy()) for i, v in sources], size)


def gather_rows(starts: Sequence[int], lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """The positions of the row runs ``[starts[j], starts[j] + lengths[j])``, laid end to end in order.

    One gather index (int64 on ``device``) that puts pieces scattered over a
    buffer into one run each, in a fixed number of kernels whatever the
    number of pieces, and with no host read: position ``x`` of piece ``j``
    is ``starts[j] - offsets(lengths)[j] + x``.
    """
    at, m = offsets(lengths), len(lengths)
    both = upload([*(s - a for s, a in zip(starts, at)), *lengths], device)  # the shifts and lengths, one copy
    return torch.repeat_interleave(both[:m], both[m:], output_size=at[-1]) + torch.arange(at[-1], device=device)


def merge_runs(
    idx: torch.Tensor, vals: torch.Tensor, at: list[int], size: int, acc: torch.dtype, parts: Parts | None = None,
    padded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_sources` of the runs ``[at[j], at[j+1])`` of one buffer (int64 ``idx``, ``[K, r]`` ``vals``).

    On the host path the buffer is merged in one pass, with no copy into
    sources; on the device path the buffer, already the sources laid end
    to end in list order, is sorted as it is. With ``padded`` the device
    path reads nothing: the result may be padded as
    :func:`sum_sorted_runs_padded`'s, its pad rows indexed ``size``.
    """
    if on_host(idx):
        return merge_host_pieces([(idx.numpy(), vals.to(acc).numpy())], size)
    if len(at) < 3 or idx.numel() == 0:  # one source or none: nothing to sort
        sources = [(idx[at[j] : at[j + 1]], vals[at[j] : at[j + 1]]) for j in range(len(at) - 1)]
        return merge_sources(sources, size, vals.shape[1], acc, idx.device, parts)
    cat, order = torch.sort(idx, stable=True)
    rows = vals.to(acc).index_select(0, order)
    if padded:
        return sum_sorted_runs_padded(cat, rows, size)
    return sum_sorted_runs(cat, rows, parts)


# --------------------------------------------------------------------------- host (NumPy) forms
#
# On the CPU a small call's time is its number of operations: a NumPy
# operation on a few hundred elements costs about a microsecond, a torch one
# several. The host forms below do the work of pack, unpack and merge on
# NumPy arrays that share memory with the tensors (no copies in or out).

#: On the host, merge through a dense scratch of ``size`` rows only when the
#: entries number more than ``size / _HOST_SCRATCH_RATIO``; below that a
#: stable sort of the concatenated (already sorted) runs is cheaper.
_HOST_SCRATCH_RATIO = 3
#: The largest ``[thresholds, n]`` bool mask :meth:`Magnitudes.counts` makes in one pass (64 MiB: 16
#: thresholds of 2^22 values at once; 2^26 values one threshold a pass, as before).
_COUNTS_MASK_BYTES = 64 << 20


def pack_host(idx: torch.Tensor, vals: torch.Tensor, index_dtype: torch.dtype, value_dtype: torch.dtype) -> np.ndarray:
    """Return :func:`pack` of CPU tensors as a NumPy ``uint8`` array ``[k, entry_bytes]``."""
    k = idx.numel()
    isz = index_dtype.itemsize
    v = vals.detach()
    if v.dtype != value_dtype:
        v = v.to(value_dtype)
    if value_dtype == torch.bfloat16:
        v = v.view(torch.int16)
    vb = v.numpy().reshape(k, vals.shape[1])
    out = np.empty((k, isz + vb.shape[1] * vb.itemsize), dtype=np.uint8)
    out[:, :isz] = idx.numpy().astype(_np_of(index_dtype), copy=False).reshape(k, 1).view(np.uint8)
    out[:, isz:] = np.ascontiguousarray(vb).view(np.uint8)
    return out


def unpack_host(
    buf: np.ndarray, row_numel: int, index_dtype: torch.dtype, value_dtype: torch.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Invert :func:`pack_host`: return int64 indices and ``[k, row_numel]`` values in the accumulation dtype.

    ``buf`` is ``uint8`` of shape ``[k, entry_bytes]`` (rows may be strided).
    fp16 and bf16 values are widened to fp32 exactly.
    """
    k = buf.shape[0]
    isz = index_dtype.itemsize
    # Copies (not views) of the strided byte columns: fresh arrays with plain strides.
    idx = buf[:, :isz].copy().view(_np_of(index_dtype)).reshape(k).astype(np.int64, copy=False)
    raw = buf[:, isz:].copy().view(np.uint16 if value_dtype == torch.bfloat16 else _np_of(value_dtype)).reshape(k, row_numel)
    if value_dtype == torch.bfloat16:
        vals = (raw.astype(np.uint32) << 16).view(np.float32)
    elif value_dtype == torch.float16:
        vals = raw.astype(np.float32)
    else:
        vals = raw
    return idx, vals


def merge_host_pieces(pieces: list[tuple[np.ndarray, np.ndarray]], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_host` of host sources given in list order; return tensors that own the result."""
    if len(pieces) == 1:
        idx, vals = pieces[0]
    else:
        idx = np.concatenate([i for i, _ in pieces])
        vals = np.concatenate([v for _, v in pieces])
    union, sums = merge_host(idx, vals, size)
    return torch.from_numpy(union), torch.from_numpy(sums)


def merge_host(idx: np.ndarray, vals: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Sum rank-ordered runs of sorted unique entries: return the sorted union and its rows.

    ``idx`` (int64) and ``vals`` (``[K, r]``, fp32 or fp64) are the
    concatenation, in list order, of sources that each hold sorted unique
    indices; every output row is ``((0 + v_0) + v_1) + ...`` in that order,
    as :func:`merge_sources` promises, whichever path runs. The result shares
    memory with neither input.
    """
    if 0 < idx.size <= _SMALL_SUM and vals.dtype in (np.float32, np.float64) and vals.shape[1] > 0:
        union, sums = _sum_small(idx, vals)
        return union, sums.numpy()
    plain = vals.flags.c_contiguous and all(st % vals.itemsize == 0 for st in vals.strides)
    t_vals = torch.from_numpy(vals if plain else vals.copy())
    if idx.size and size <= _HOST_SCRATCH_RATIO * idx.size:
        # Dense scratch: O(size) work beats sorting when the entries are this many.
        t_idx = torch.from_numpy(idx)
        present = torch.zeros(size, dtype=torch.bool)
        scratch = fresh((size, t_vals.shape[1]), t_vals.dtype, "cpu").zero_()
        present[t_idx] = True
        scratch.index_add_(0, t_idx, t_vals)
        union = present.nonzero().view(-1)
        return union.numpy(), scratch.index_select(0, union).numpy()
    union, sums = sum_by_index(idx, t_vals)
    return union, sums.numpy()


# --------------------------------------------------------------------------- top-k selection


class Magnitudes:
    """``|acc|`` of one top-k call's local selection: count, select and rank it by threshold.

    A NaN's magnitude counts as +inf, the largest (``torch.topk`` also ranks
    NaN largest): a NaN is selected before any finite value, so a NaN in a
    gradient is delivered, and shows in the result, instead of staying in
    the residual forever. A value is selected at ``threshold`` when its magnitude is
    ``>= threshold``, or ``> 0`` for a threshold of 0. Of values tied at
    the ``k``-th largest, :meth:`top_k_indices` takes those at the lowest
    positions, so both paths select the same entries.

    On the host (fp32, fp64) the work runs in NumPy: its single-thread
    elementwise kernels (abs, compare, count, nonzero) are 2 to 4 times
    faster than torch's on 2^20 values here, and its introselect
    (``np.partition``) finds the k-th largest in about 1.5 ms where
    ``torch.topk`` takes 8 to 16 ms; both exact. Elsewhere, torch.
    """

    __slots__ = ("mag", "host")

    def __init__(self, acc: torch.Tensor) -> None:
        flat = acc.detach().reshape(-1)
        self.host = on_host(acc) and acc.dtype in (torch.float32, torch.float64)
        if self.host:
            self.mag = np.abs(flat.numpy())
            if self.mag.size and np.isnan(self.mag.max()):  # a max propagates NaN: one cheap pass finds any
                self.mag[np.isnan(self.mag)] = np.inf
        else:
            self.mag = torch.nan_to_num(flat.abs(), nan=math.inf, posinf=math.inf)

    def _held(self, threshold: "float | torch.Tensor") -> "float | torch.Tensor":
        """A threshold where this selection compares it: a float on the host, else left a tensor, on this device."""
        if not isinstance(threshold, torch.Tensor):
            return threshold
        return float(threshold) if self.host else upload(threshold, self.mag.device)

    def _mask(self, threshold: "float | torch.Tensor") -> Any:
        threshold = self._held(threshold)
        if isinstance(threshold, torch.Tensor):  # on the device: not read, the rule at 0 applied there
            return (self.mag >= threshold) & (self.mag > 0)
        return self.mag >= threshold if threshold > 0 else self.mag > 0

    def tensor(self) -> torch.Tensor:
        """The magnitudes as a flat tensor (sharing memory on the host)."""
        return torch.from_numpy(self.mag) if self.host else self.mag

    def mask(self, threshold: "float | torch.Tensor") -> torch.Tensor:
        """A bool tensor: which values are selected at ``threshold``."""
        return torch.from_numpy(self._mask(threshold)) if self.host else self._mask(threshold)

    def count(self, threshold: "float | torch.Tensor") -> int:
        """How many values are selected at ``threshold``."""
        if self.host:
            return int(np.count_nonzero(self._mask(threshold)))
        return int(torch.count_nonzero(self._mask(threshold)))

    def counts(self, thresholds: list[float]) -> "np.ndarray | torch.Tensor":
        """How many values are selected at each threshold: int64, on the host or, on the device path, left there.

        On the device no read: the caller reads them (or all-gathers them
        first) once. Positive thresholds are compared all at once, as a
        ``[thresholds, n]`` mask of at most :data:`_COUNTS_MASK_BYTES` per
        pass (two kernels a pass, not two per threshold); each threshold is
        rounded to the magnitudes' dtype first, as comparing with a Python
        float does, so the counts are those of :meth:`count`.
        """
        if self.host:
            return np.array([np.count_nonzero(self._mask(t)) for t in thresholds], dtype=np.int64)
        n = self.mag.numel()
        if len(thresholds) < 2 or min(thresholds) <= 0 or n == 0:  # a threshold of 0 selects the nonzero values
            return torch.stack([torch.count_nonzero(self._mask(t)) for t in thresholds])
        return self._counts_at_least(upload(torch.tensor(thresholds, dtype=torch.float64), self.mag.device))

    def _counts_at_least(self, thresholds: torch.Tensor) -> torch.Tensor:
        """How many magnitudes are at least each of float64 ``thresholds`` (rounded to the magnitudes' dtype), on the device."""
        th = thresholds.to(self.mag.dtype)
        per = max(1, _COUNTS_MASK_BYTES // max(self.mag.numel(), 1))
        parts = [(self.mag.unsqueeze(0) >= th[i : i + per].unsqueeze(1)).sum(1) for i in range(0, th.numel(), per)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def counts_around(
        self, threshold: "float | torch.Tensor", factors: list[float]
    ) -> "tuple[list[float] | torch.Tensor, np.ndarray | torch.Tensor]":
        """The thresholds ``threshold * f`` for each of ``factors``, and how many values each selects (:meth:`count`).

        Nothing is read: the counts are as :meth:`counts` leaves them. A
        ``threshold`` still on the device (a 0-dim tensor, as :meth:`top_k`
        and the exact global threshold leave it) makes the thresholds there
        too, as float64, for the caller to read with the counts
        (:meth:`read_around`). A threshold of 0 selects the nonzero values.
        """
        threshold = self._held(threshold)
        if not isinstance(threshold, torch.Tensor):
            cands = [threshold * f for f in factors]
            return cands, self.counts(cands)
        cands_t = threshold.double() * upload(torch.tensor(factors, dtype=torch.float64), self.mag.device)
        counts = self._counts_at_least(cands_t)
        # At 0 the rule is "above 0": the values at least 0 less the zeros (NaN counts as infinite, never 0).
        return cands_t, counts - torch.where(cands_t == 0, (self.mag == 0).sum(), 0)

    @staticmethod
    def around_row(cands: "list[float] | torch.Tensor", counts: "np.ndarray | torch.Tensor") -> "np.ndarray | torch.Tensor":
        """What :meth:`counts_around` returned as one int64 row to read or gather: the counts, then, for thresholds
        made on the device, their float64 bits."""
        return counts if isinstance(cands, list) else torch.cat((counts, cands.view(torch.int64)))

    @staticmethod
    def from_row(cands: "list[float] | torch.Tensor", row: np.ndarray) -> tuple[list[float], list[int]]:
        """The thresholds as floats and their counts, from a read :meth:`around_row` (int64, on the host)."""
        m = len(cands)
        return (cands if isinstance(cands, list) else row[m : 2 * m].view(np.float64).tolist()), row[:m].tolist()

    @staticmethod
    def read_around(
        cands: "list[float] | torch.Tensor", counts: "np.ndarray | torch.Tensor"
    ) -> tuple[list[float], list[int]]:
        """Read what :meth:`counts_around` returned: the thresholds as floats and their counts, in one read."""
        row = Magnitudes.around_row(cands, counts)
        return Magnitudes.from_row(cands, np.asarray(row.cpu() if isinstance(row, torch.Tensor) else row))

    def indices(self, threshold: "float | torch.Tensor", count: int | None = None) -> torch.Tensor:
        """Sorted int64 positions of the values selected at ``threshold``.

        With ``count`` (how many there are, as :meth:`count` said) the device
        path finds them without waiting for the device (:func:`mask_positions`).
        """
        if self.host:
            return torch.from_numpy(np.flatnonzero(self._mask(threshold)).astype(np.int64, copy=False))
        if count is not None:
            return mask_positions(self._mask(threshold), count)
        return self._mask(threshold).nonzero().view(-1)

    def top_k(self, k: int) -> "tuple[torch.Tensor, float | torch.Tensor]":
        """Sorted int64 positions of the ``k`` largest values (``1 <= k <= numel``), and the ``k``-th largest.

        Of values tied at the ``k``-th largest, those at the lowest positions
        complete ``k``. On the device path nothing is read: the ``k``-th
        largest stays there as a 0-dim tensor (a float on the host).
        """
        if self.host:
            th = np.partition(self.mag, self.mag.size - k)[self.mag.size - k]
            above = np.flatnonzero(self.mag > th)
            out = np.concatenate((above, np.flatnonzero(self.mag == th)[: k - above.size])).astype(np.int64, copy=False)
            out.sort()
            return torch.from_numpy(out), float(th)
        n = self.mag.numel()
        if k == n:
            return torch.arange(n, device=self.mag.device), self.mag.min()
        vals, pos = torch.topk(self.mag, k, sorted=False)
        th = vals.min()
        # Every value above the k-th largest is among torch.topk's k; which of those equal to it it keeps is
        # unspecified. So: the ones above it, then the first of the equal ones in the whole tensor, as many as
        # complete k (there are always enough), picked by a mask of static size: no count read back.
        above = vals > th
        tied = mask_positions(self.mag == th, k)
        keep = torch.cat((above, torch.arange(k, device=vals.device) < k - above.sum()))
        return torch.cat((pos, tied)).index_select(0, mask_positions(keep, k)).sort().values, th

    def top_k_indices(self, k: int) -> torch.Tensor:
        """Sorted int64 positions of the ``k`` largest values (``1 <= k <= numel``); ties: the lowest positions."""
        return self.top_k(k)[0]


def mask_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Return the sorted int64 positions of the first ``count`` set elements of 1-D bool ``mask``, with no host read.

    ``mask.nonzero()`` must learn its output size from the device first (a
    host sync); here the caller knows it, and ``torch.nonzero_static`` takes
    it: one pass over the mask, no running count written. Positions past the
    last set element are ``mask.numel()``.
    """
    return torch.nonzero_static(mask, size=count, fill_value=mask.numel()).view(-1)
