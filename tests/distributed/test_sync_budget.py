"""Host synchronizations and ops per call on the device code path, counted on CPU tensors.

Each host synchronization stops the host until the GPU drains its queue (and,
inside a backward pass, stops it queuing the next kernels), and each op is at
least one kernel launch. :mod:`dispatch_audit` counts both on the device code
path, the ops CUDA runs, so these ceilings hold on every machine. They are the
counts each algorithm declares (``HOST_SYNCS``, which an NCCL profile's host
cost multiplies), steady state (after the first call at a call site), at
P = 2 and 3: a change that adds a sync fails here. Where they stand above
the GPU issue's budget (dense 2, allgather 2, Ok-Topk 3, top-k 3, a fused call
2), the extra reads are named in the README's "On GPUs" section.
"""

from __future__ import annotations

import pytest
import torch
from dispatch_audit import audit

from colltune.algorithms import get, names
from colltune.algorithms.sparse import device_path

from harness import pool

#: Host syncs per steady-state call, at most: what each algorithm declares (and the cost model prices).
SYNC_CEILING = {name: get(name).HOST_SYNCS["exact"] for name in names()} | {"auto": get("allgather").HOST_SYNCS["exact"]}
#: A top-k call; Ok-Topk's includes a second read of its global selection when no nudged threshold fits.
TOPK_SYNC_CEILING = {name: get(name).HOST_SYNCS["topk"] for name in names()}
#: The team's budget for a steady top-k call: one whose reused thresholds still fit (the call audited below).
TOPK_SYNC_BUDGET = 3
#: A fused call, whatever the number of tensors.
FUSED_SYNC_CEILING = 2


def _single_calls(rank, world_size, algorithm, row_shape, k):
    import colltune

    g = torch.Generator().manual_seed(rank)
    n = 1 << 14
    idx = torch.randint(0, n, (k,), generator=g)
    vals = torch.randn((k, *row_shape), generator=g)
    with device_path():
        for _ in range(3):
            colltune.sparse_allreduce(idx, vals, size=n, algorithm=algorithm, name="budget")
        with audit() as a:
            colltune.sparse_allreduce(idx, vals, size=n, algorithm=algorithm, name="budget")
    return a.n_syncs, dict(a.syncs), a.n_ops


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("algorithm", [*names(), "auto"])
@pytest.mark.parametrize("row_shape,k", [((), 40), ((16,), 900)])
def test_host_syncs_per_call_stay_within_the_ceiling(algorithm, world_size, row_shape, k):
    for syncs, which, _ in pool(world_size).run(_single_calls, algorithm, row_shape, k):
        assert syncs <= SYNC_CEILING[algorithm], (algorithm, which)


#: Ops per steady-state call at P = 2, at most: half of what the GPU issue counted (80, 96 and 198) for the
#: algorithms it counted. Each is host time on a GPU (dispatch), and each op that is not a view a kernel launch.
OPS_CEILING = {"dense": 40, "allgather": 48, "oktopk": 99}


@pytest.mark.parametrize("algorithm", sorted(OPS_CEILING))
@pytest.mark.parametrize("row_shape,k", [((), 3000), ((16,), 900)])
def test_ops_per_call_are_half_what_they_were(algorithm, row_shape, k):
    for _, _, ops in pool(2).run(_single_calls, algorithm, row_shape, k):
        assert ops <= OPS_CEILING[algorithm], (algorithm, row_shape, ops)


def _dense_calls(rank, world_size, wire):
    import colltune

    g = torch.Generator().manual_seed(rank)
    n = 1 << 12
    full = (torch.arange(n), torch.randn((n, 16), generator=g).to(torch.bfloat16))  # every row: no presence test
    part = (torch.randint(0, n, (900,), generator=g), torch.randn((900, 16), generator=g).to(torch.bfloat16))
    out = {}
    with device_path():
        for label, (idx, vals) in (("full", full), ("part", part)):
            for _ in range(3):
                colltune.sparse_allreduce(idx, vals, size=n, algorithm="dense", knobs={"wire": wire}, name=label)
            with audit() as a:  # strict: a nondeterministic write on the densify or extract path raises
                colltune.sparse_allreduce(idx, vals, size=n, algorithm="dense", knobs={"wire": wire}, name=label)
            out[label] = (a.n_syncs, dict(a.syncs), a.n_ops, dict(a.collectives))
    return out


@pytest.mark.parametrize("wire", ["accum", "value"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_dense_reads_the_union_size_only_when_some_row_may_be_missing(world_size, wire):
    for out in pool(world_size).run(_dense_calls, wire):
        full, part = out["full"], out["part"]
        assert full[0] <= SYNC_CEILING["dense"] - 1, full[1]  # the record only: it says every row is present
        assert part[0] <= SYNC_CEILING["dense"], part[1]
        assert full[2] < part[2], (full[2], part[2])  # no fill, copy, presence test or gather
        for syncs, which, ops, collectives in (full, part):  # one all_reduce: values and union together
            assert sum(v for k, v in collectives.items() if "allreduce" in k) == 1, collectives


def _topk_calls(rank, world_size, algorithm):
    import colltune
    from colltune.algorithms.state import TopkState

    g = torch.Generator().manual_seed(rank)
    state = TopkState(density=1e-3)
    with device_path():
        for step in range(8):
            grad = torch.randn(1 << 15, generator=g)
            if step < 7:
                colltune.topk_allreduce(grad, state, algorithm=algorithm)
        with audit() as a:
            colltune.topk_allreduce(grad, state, algorithm=algorithm)
    return a.n_syncs, dict(a.syncs)


@pytest.mark.parametrize("algorithm", names())
def test_topk_host_syncs_stay_within_the_ceiling(algorithm):
    for syncs, which in pool(2).run(_topk_calls, algorithm):
        assert syncs <= min(TOPK_SYNC_CEILING[algorithm], TOPK_SYNC_BUDGET), (algorithm, which)


def _oktopk_topk_misses(rank, world_size):
    import colltune
    from colltune.algorithms.state import TopkState

    g = torch.Generator().manual_seed(rank)
    state = TopkState(density=1e-3, local_refresh=16, global_refresh=16)
    out = {}
    with device_path():
        for step in range(17):
            grad = torch.randn(1 << 15, generator=g)
            case = {5: "steady", 7: "local miss", 11: "both miss", 16: "refresh"}.get(step)
            if case == "local miss":  # the reused local threshold 30x too high: no nudge of it fits
                state.local_threshold = state.local_threshold * 30
            if case == "both miss":  # the gradient 30x larger: neither reused threshold fits
                grad = grad * 30
            with audit() as a:
                colltune.topk_allreduce(grad, state, algorithm="oktopk")
            if case is not None:
                out[case] = (a.n_syncs, dict(a.syncs), sum(a.collectives.values()))
    return out


def test_oktopk_topk_reads_its_exact_thresholds_with_later_reads():
    """A missed local threshold costs no read (the exact k largest are taken on the device, their threshold read
    with the next call's counts); a missed global one costs one (the exact one is found on the device by the radix
    select's four all_reduces, then its counts are read); a refresh of both reads only the record and the counts."""
    for out in pool(2).run(_oktopk_topk_misses):
        assert out["local miss"][0] <= TOPK_SYNC_BUDGET, out["local miss"]
        assert out["both miss"][0] <= TOPK_SYNC_CEILING["oktopk"] == TOPK_SYNC_BUDGET + 1, out["both miss"]
        steady = out["steady"][2]
        assert out["local miss"][2] == steady, out  # and no collective more
        assert out["both miss"][2] > steady and out["refresh"][2] > steady, out  # the radix select ran
        assert out["refresh"][0] <= 2, out["refresh"]


def _fused_calls(rank, world_size, tables, algorithm="allgather"):
    import colltune

    g = torch.Generator().manual_seed(rank)
    tensors = [(torch.randint(0, 500 + 37 * t, (60,), generator=g), torch.randn(60, 8, generator=g), 500 + 37 * t)
               for t in range(tables)]
    with device_path():
        for _ in range(3):
            colltune.sparse_allreduce_many(tensors, algorithm=algorithm, name="budget")
        with audit() as a:
            colltune.sparse_allreduce_many(tensors, algorithm=algorithm, name="budget")
    return a.n_syncs, dict(a.syncs), a.n_ops


def test_a_fused_call_does_its_local_work_once_for_the_whole_list():
    few, many = pool(2).run(_fused_calls, 2)[0], pool(2).run(_fused_calls, 26)[0]
    assert few[0] <= FUSED_SYNC_CEILING and many[0] <= FUSED_SYNC_CEILING, (few[1], many[1])
    assert many[0] == few[0], (few[1], many[1])  # syncs do not grow with the tables
    assert many[2] <= 1.5 * few[2], (few[2], many[2])  # nor, beyond views, do the ops


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("algorithm", names())
def test_a_fused_bucket_reads_its_tensors_sizes_with_the_algorithms_last_read(algorithm, world_size):
    """A bucket's cut reads nothing (each tensor's share comes with the algorithm's last read), and an
    algorithm's payload (Ok-Topk's counts per region, hashpart's per owner) rides in the fused record as in a
    single call's, so no bucket exchanges counts of its own."""
    for syncs, which, _ in pool(world_size).run(_fused_calls, 26, algorithm):
        assert syncs <= FUSED_SYNC_CEILING, (algorithm, which)


def _bad_range_on_one_rank(rank, world_size):
    import colltune
    from colltune.algorithms.errors import ColltuneValueError, RemoteInputError

    tensors = [(torch.tensor([1, 2]), torch.ones(2, 4), 10) for _ in range(5)]
    if rank == 1:
        tensors[3] = (torch.tensor([1, 10]), torch.ones(2, 4), 10)
    out = []
    with device_path():
        for call in (lambda: colltune.sparse_allreduce_many(tensors),
                     lambda: colltune.sparse_allreduce(*tensors[3])):
            try:
                call()
                out.append("ok")
            except RemoteInputError as exc:  # the peer names the argument at fault (set on the host)
                out.append("remote " + str(exc))
            except ColltuneValueError as exc:
                out.append(str(exc))
        good = colltune.sparse_allreduce_many([(torch.tensor([1, 2]), torch.ones(2, 4), 10)] * 2)
    out.append(good[1].values.sum().item())
    return out


def test_an_index_out_of_range_is_found_by_the_one_read_and_named():
    first, second = pool(2).run(_bad_range_on_one_rank)
    assert first[0].startswith("remote") and "rank 1: invalid argument 'tensors'" in first[0], first
    assert first[1].startswith("remote") and "rank 1: invalid argument 'indices'" in first[1], first
    assert "tensors[3]" in second[0] and "index 10" in second[0], second
    assert "index 10" in second[1], second
    assert first[2] == second[2] == 16.0  # the group stays usable


def _one_rank_calls(rank, world_size):
    import colltune

    g = torch.Generator().manual_seed(5)
    n = 1 << 14
    idx, vals = torch.randint(0, n, (900,), generator=g), torch.randn((900, 16), generator=g)
    tables = [(torch.randint(0, 500 + t, (300,), generator=g), torch.randn((300, 16), generator=g), 500 + t)
              for t in range(26)]
    out = {}
    with device_path():
        for algorithm in ("dense", "allgather"):
            calls = {"single": lambda: colltune.sparse_allreduce(idx, vals, size=n, algorithm=algorithm, name="one"),
                     "fused": lambda: colltune.sparse_allreduce_many(tables, algorithm=algorithm, name="one")}
            for label, call in calls.items():
                with device_path(False):
                    want = call()  # the host path's bits, which the device path's equal
                for _ in range(3):
                    call()
                with audit() as a:
                    got = call()
                same = all(torch.equal(x.indices, y.indices) and torch.equal(x.values, y.values) for x, y in zip(
                    got if isinstance(got, list) else [got], want if isinstance(want, list) else [want]))
                out[f"{algorithm} {label}"] = (a.n_syncs, dict(a.syncs), same)
    return out


def test_one_rank_reads_only_the_coalesce():
    """At P = 1 each result is the rank's own coalesced rows: their count is known, so dense and a fused
    call's cut read nothing more than the coalesce's one read (what one GPU measures)."""
    (out,) = pool(1).run(_one_rank_calls)
    for what, (syncs, which, same) in out.items():
        assert syncs == 1, (what, which)
        assert same, what
