"""Device tensors on gloo: collectives staged through host memory give the bits of the unstaged calls.

gloo's transport cannot read or write CUDA memory in point-to-point calls
(``writev ... Bad address``), so :class:`colltune.algorithms.comm.Comm`
stages device tensors through host buffers on gloo (:attr:`Comm.staged`).
There is no GPU here: :func:`colltune.algorithms.comm.staging` stages CPU
tensors as CUDA tensors would be, and :func:`colltune.algorithms.sparse.device_path`
sends them down the code CUDA tensors take. Every rank runs each call
twice on the same input, in a fresh group each time (so the eager slot,
boundaries and decisions start alike), once without staging and once with
it; the parent checks the same bits and the same counted traffic, and that
the staged run staged its collectives (:func:`~colltune.algorithms.comm.staged_calls`).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colltune.algorithms.comm import staged_calls, stages, staging
from colltune.algorithms.sparse import device_path

from harness import pool

#: Sparse inputs: (rows, entries per rank, row shape). The last two outgrow the eager slot (up to 128 KiB).
_CASES = [(1000, 40, (4,)), (200_000, 5000, (8,)), (50_000, 3000, ())]
#: Knobs beyond the defaults, per algorithm: every gather mode and both balances run staged.
_KNOBS = {
    "allgather": [{"mode": "p2p"}, {"mode": "pad"}, {"mode": "alltoall"}],
    "oktopk": [{"gather_mode": "p2p"}, {"gather_mode": "alltoall"}, {"balance": False}],
}


def _bytes_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two tensors hold the same dtype, shape and bytes (-0.0 and NaN compared as bits)."""
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


# ------------------------------------------------------------------ the predicate, one process


def test_predicate_stages_device_tensors_on_gloo_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with staging(False):
        assert stages("gloo", cuda) and stages("gloo", torch.device("cuda", 1)) and stages("GLOO", cuda)
        assert not stages("nccl", cuda) and not stages("gloo", cpu) and not stages("nccl", cpu)
        assert not stages("cpu:gloo,cuda:nccl", cuda) and not stages("cpu:gloo,cuda:nccl", cpu)
        assert stages("cpu:gloo,cuda:gloo", cuda)
        with staging():  # the test hook: CPU tensors on gloo are staged as CUDA tensors are
            assert stages("gloo", cpu) and stages("cpu:gloo,cuda:nccl", cpu)
            assert not stages("nccl", cpu) and not stages("nccl", cuda)
            with staging(False):
                assert not stages("gloo", cpu)
            assert stages("gloo", cpu)
        assert not stages("gloo", cpu)


def _comm_flags(rank, world_size):
    from colltune.algorithms.comm import Comm

    before = staged_calls()
    flags = {
        "cuda": Comm(None, torch.device("cuda")).staged,  # made without touching the device
        "cuda_direct": Comm(None, torch.device("cuda")).direct,
        "cpu": Comm(None, torch.device("cpu")).staged,
    }
    with staging():
        flags["forced_cpu"] = Comm(None, torch.device("cpu")).staged
    comm = Comm(None, torch.device("cpu"))
    comm.all_gather(torch.arange(3) + rank)
    comm.all_to_all(torch.arange(world_size), [1] * world_size, [1] * world_size)
    flags["unstaged_calls_staged"] = staged_calls() != before
    return flags


def test_comm_stages_cuda_on_gloo_and_nothing_else():
    for flags in pool(3).run(_comm_flags):
        assert flags == {"cuda": True, "cuda_direct": False, "cpu": False, "forced_cpu": True,
                         "unstaged_calls_staged": False}, flags


# ------------------------------------------------------------------ the primitives, staged and not


def _primitives(comm, rank, p):
    """Run every primitive of ``comm`` on rank-dependent data; return what each gave."""
    g = torch.Generator().manual_seed(rank)
    rec = {"gather": comm.all_gather(torch.randn(3, 2, generator=g)[:, 1:])}  # a non-contiguous input
    send = [(rank + j) % 3 for j in range(p)]
    rec["a2a"] = comm.all_to_all(torch.arange(sum(send), dtype=torch.int32) + 1000 * rank, send,
                                 [(j + rank) % 3 for j in range(p)])
    counts = [2 + 5 * (j % 2) for j in range(p)]
    mine = torch.randn(counts[rank], 3, generator=g, dtype=torch.float64)
    for mode in ("pad", "alltoall"):
        rec["gather_v", mode] = torch.cat(comm.all_gather_v(mine, counts, mode))
        rec["gather_flat", mode] = comm.all_gather_flat(mine, counts, mode)
    # Point to point: received in place into slices of one buffer, sent from a strided view.
    at = [sum(counts[:j]) for j in range(p + 1)]
    rows = torch.zeros(at[-1], 3, dtype=torch.float64)
    rows[at[rank] : at[rank + 1]] = mine
    ptr = rows.data_ptr()
    comm.all_gather_rows((rows,), at, 1)
    rec["rows"], rec["rows_in_place"] = rows, rows.data_ptr() == ptr
    box = torch.full((p, 4), -1.0)
    strided = torch.arange(8.0).view(4, 2)[:, 0] + 10 * rank
    peers = [j for j in range(p) if j != rank]
    for work in comm.exchange([(strided, j, 7) for j in peers], [(box[j], j, 7) for j in peers] + [(box[:0], rank)]):
        work.wait()
    rec["exchange"] = box
    rec["sum"] = comm.all_reduce(torch.randn(17, generator=g))
    return rec


def _run_primitives_staged_and_not(rank, world_size):
    from colltune.algorithms.comm import Comm

    out = {}
    for path in (False, True):  # host path (direct at P >= 3) and device path
        with device_path(path):
            for staged in (False, True):
                with staging(staged):
                    comm = Comm(None, torch.device("cpu"))
                    before = staged_calls()
                    rec = _primitives(comm, rank, world_size)
                    after = staged_calls()
                rec["staged"] = {k: after.get(k, 0) - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
                rec["flag"], rec["direct"], rec["traffic"] = comm.staged, comm.direct, comm.traffic.as_dict()
                out[path, staged] = rec
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_staged_primitives_give_the_same_data_in_place(world_size):
    out = pool(world_size).run(_run_primitives_staged_and_not)
    for rank, o in enumerate(out):
        for path in (False, True):
            plain, staged = o[path, False], o[path, True]
            where = f"rank {rank} {'device' if path else 'host'} path"
            assert not plain["flag"] and staged["flag"] and plain["staged"] == {}, where
            # A direct Comm (host path, P >= 3) builds its gathers and all_to_all on exchange.
            want = {"exchange"} if staged["direct"] else {"all_gather", "all_to_all", "exchange"}
            assert set(staged["staged"]) == want, (where, staged["staged"])
            assert staged["rows_in_place"] and staged["traffic"] == plain["traffic"], where
            for key in plain:
                if isinstance(plain[key], torch.Tensor):
                    assert _bytes_equal(plain[key], staged[key]), (where, key)
            want = torch.full((world_size, 4), -1.0)
            for j in range(world_size):
                if j != rank:
                    want[j] = torch.arange(0.0, 8.0, 2.0) + 10 * j
            assert torch.equal(staged["exchange"], want), where


# ------------------------------------------------------------------ the front door, staged and not


def _staged_total() -> int:
    return sum(staged_calls().values())


def _sparse_input(rank: int, case: tuple) -> tuple[torch.Tensor, torch.Tensor, int]:
    size, k, row = case
    g = torch.Generator().manual_seed(1000 * len(row) + k + rank)
    shared = torch.randint(0, size, (k // 2,), generator=torch.Generator().manual_seed(k))  # overlap across ranks
    idx = torch.cat((shared[: k // 4 + rank], torch.randint(0, size, (k - k // 4 - rank,), generator=g)))
    return idx, torch.randn((k,) + row, generator=g), size


def _sparse_calls(rank, group):
    """Every algorithm (with its knob variants) and ``auto`` through ``sparse_allreduce``, then fused calls."""
    import colltune
    from colltune import algorithms

    out = []
    for case in _CASES:
        idx, vals, size = _sparse_input(rank, case)
        for algorithm in (*algorithms.names(), "auto"):
            for knobs in [None, *_KNOBS.get(algorithm, [])]:
                before = _staged_total()
                res = colltune.sparse_allreduce(idx, vals, size, algorithm=algorithm, knobs=knobs, group=group)
                out.append((f"{case} {algorithm} {knobs}", res.algorithm, res.indices, res.values, res.traffic.as_dict(),
                            _staged_total() - before))
    items = [_sparse_input(rank, case) for case in _CASES]
    for algorithm in (*algorithms.names(), "auto"):
        before = _staged_total()
        results = colltune.sparse_allreduce_many(items, algorithm=algorithm, group=group, name="tables")
        for j, res in enumerate(results):
            out.append((f"fused {algorithm} {j}", res.algorithm, res.indices, res.values, res.traffic.as_dict(),
                        _staged_total() - before))
    return out


def _topk_calls(rank, group):
    """``topk_allreduce`` with ``TopkState(density=0.01)``, a few steps per algorithm (residuals carried)."""
    import colltune
    from colltune import algorithms
    from colltune.algorithms.state import TopkState

    out = []
    for algorithm in ("auto", *algorithms.names()):
        state = TopkState(density=0.01)
        for step in range(5):
            g = torch.Generator().manual_seed(100 * rank + step)
            before = _staged_total()
            res = colltune.topk_allreduce(torch.randn(300, 40, generator=g), state, group=group, algorithm=algorithm)
            staged = _staged_total() - before
            where = f"topk {algorithm} step {step}"
            out.append((where, res.algorithm, res.indices, res.values, res.traffic.as_dict(), staged))
            out.append((where + " residual", res.algorithm, None, state.residual.clone(), None, staged))
    return out


def _run_front_door_staged_and_not(rank, world_size):
    out = {}
    with device_path():
        for staged in (False, True):
            group = dist.new_group()  # fresh per-group state (eager slot, boundaries, decisions) for both runs
            with staging(staged):
                out[staged] = _sparse_calls(rank, group) + _topk_calls(rank, group)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_staged_front_door_gives_the_unstaged_bits(world_size):
    out = pool(world_size).run(_run_front_door_staged_and_not, timeout=300)
    for rank, o in enumerate(out):
        plain, staged = o[False], o[True]
        assert [c[0] for c in plain] == [c[0] for c in staged]
        for p, s in zip(plain, staged):
            where = f"P={world_size} rank {rank} {p[0]}"
            # Every call exchanges its metadata record in an all_gather at least: staged, or not at all.
            assert p[5] == 0 and s[5] >= 1, f"{where}: {p[5]} collectives staged unstaged, {s[5]} staged"
            assert p[1] == s[1], f"{where}: algorithm {p[1]} unstaged, {s[1]} staged"
            assert _bytes_equal(p[2], s[2]) and _bytes_equal(p[3], s[3]), f"{where}: results differ"
            assert p[4] == s[4], f"{where}: traffic counted differently"
