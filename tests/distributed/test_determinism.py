"""Deterministic on every device: the device code path, audited op by op on CPU tensors.

On CUDA an op that accumulates through atomics (``index_add_`` and its kin)
sums duplicates in an order set by thread scheduling: the same call gives
other bits on another run or another rank. Every call here runs on the device
code path under :class:`dispatch_audit.Audit`, which raises on any op PyTorch
lists as nondeterministic on CUDA that accumulates, and on any listed write
that writes a place twice. A call that passes the audit reduces in an order
fixed by its input, on CPU and CUDA alike. The tests also check what that
gives: the same bits on every repeat and every rank, and a fused call equal,
bit for bit, to the per-tensor calls with the same algorithm.

The audit's own teeth are tested first, so that a pass means something.
"""

from __future__ import annotations

import pytest
import torch
from dispatch_audit import Audit, NondeterministicOp, audit
from test_device_path import same_bits

from colltune.algorithms import names
from colltune.algorithms.sparse import device_path

from harness import pool
from sparse_cases import case, make_input

# ------------------------------------------------------------------ the audit itself


def test_audit_refuses_atomic_accumulation():
    out = torch.zeros(4)
    with pytest.raises(NondeterministicOp, match="atomics"), Audit():
        out.index_add_(0, torch.tensor([1, 1]), torch.ones(2))
    with pytest.raises(NondeterministicOp, match="atomics"), Audit():
        out.scatter_add_(0, torch.tensor([1, 2]), torch.ones(2))
    with pytest.raises(NondeterministicOp, match="atomics"), Audit():
        out.index_put_((torch.tensor([1, 2]),), torch.ones(2), accumulate=True)
    with pytest.raises(NondeterministicOp, match="floating point"), Audit():
        torch.cumsum(out, 0)


def test_audit_refuses_writes_to_one_place_twice_and_allows_unique_ones():
    out = torch.zeros(4, 2)
    with pytest.raises(NondeterministicOp, match="twice"), Audit():
        out.index_copy_(0, torch.tensor([3, 3]), torch.ones(2, 2))
    with pytest.raises(NondeterministicOp, match="twice"), Audit():
        out[torch.tensor([0, 0])] = 1.0
    with Audit() as a:
        out.index_copy_(0, torch.tensor([3, 1]), torch.ones(2, 2))
        out[torch.tensor([0, 2])] = 1.0
        torch.cumsum(torch.arange(4), 0)  # integer sums are exact in any order
    assert a.ops["index_copy_"] == 1 and a.n_syncs == 0


def test_audit_counts_host_syncs():
    t = torch.arange(6)
    with audit() as a:
        t.sum().item()
        (t > 2).nonzero()
        t[t > 2]
        t.tolist()
        torch.unique_consecutive(t)
        torch.sort(t)  # no sync: output sizes known
    assert a.syncs == {"_local_scalar_dense": 1, "nonzero": 1, "index(bool mask)": 1, "Tensor.tolist": 1,
                       "unique_consecutive": 1}, a.syncs


# ------------------------------------------------------------------ the algorithms, audited

_CASES = [
    case(seed=3, size=300, row_shape=(), dtype="float32"),
    case(seed=4, size=2000, row_shape=(8,), dtype="bfloat16"),
    case(seed=5, size=40, row_shape=(2, 3), dtype="float16", pattern="cancel"),
    case(seed=6, size=500, row_shape=(4,), dtype="float64", pattern="identical"),
]
_REPEATS = 3


def _audited_calls(rank, world_size, algorithm, cases):
    import colltune

    out = []
    with device_path():
        for c in cases:
            c = dict(c, counts=[[5, 120, 0, 77][(rank + j) % 4] for j in range(world_size)])
            idx, vals = make_input(c, rank, world_size)
            bits = []
            for _ in range(_REPEATS):
                with Audit():
                    res = colltune.sparse_allreduce(idx, vals, size=c["size"], algorithm=algorithm, name="audited")
                bits.append((res.indices, res.values))
            out.append(bits)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("algorithm", [*names(), "auto"])
def test_every_algorithm_reduces_deterministically_on_the_device_path(algorithm, world_size):
    per_rank = pool(world_size).run(_audited_calls, algorithm, _CASES)
    for j in range(len(_CASES)):
        first_idx, first_vals = per_rank[0][j][0]
        for rank_bits in per_rank:
            for idx, vals in rank_bits[j]:  # every repeat, every rank: the same bits
                assert torch.equal(idx, first_idx) and same_bits(vals, first_vals), (algorithm, j)


def _audited_topk(rank, world_size, algorithm):
    import colltune
    from colltune.algorithms.state import TopkState

    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(4000, generator=g).round(decimals=1) for _ in range(4)]  # ties and equal magnitudes
    out = []
    with device_path():
        state = TopkState(density=0.01)
        for grad in grads:
            with Audit():
                res = colltune.topk_allreduce(grad, state, algorithm=algorithm)
            out.append(res.to_dense())
    return out


@pytest.mark.parametrize("algorithm", names())
def test_topk_reduces_deterministically_on_the_device_path(algorithm):
    per_rank = pool(2).run(_audited_topk, algorithm)
    for a, b in zip(*per_rank):
        assert same_bits(a, b), algorithm


def _fused_and_single(rank, world_size, algorithm):
    import colltune

    g = torch.Generator().manual_seed(10 + rank)
    tensors = []
    for t in range(7):
        n = [77, 1000, 5, 64, 300, 2, 4096][t]
        row = [(64,), (3,), (), (64,), (3,), (), (64,)][t]
        dtype = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float64,
                 torch.float32][t]
        k = [64, 500, 9, 0, 40, 3, 700][t]
        tensors.append((torch.randint(0, n, (k,), generator=g), torch.randn((k, *row), generator=g).to(dtype), n))
    with device_path():
        with Audit():
            fused = colltune.sparse_allreduce_many(tensors, algorithm=algorithm)
        single = [colltune.sparse_allreduce(*t, algorithm=algorithm) for t in tensors]
    return [(f.indices, f.values, s.indices, s.values) for f, s in zip(fused, single)]


@pytest.mark.parametrize("algorithm", names())
def test_fused_call_equals_the_per_tensor_calls_bit_for_bit_on_the_device_path(algorithm):
    per_rank = pool(3).run(_fused_and_single, algorithm)
    for rank_out in per_rank:
        for t, (fi, fv, si, sv) in enumerate(rank_out):
            assert torch.equal(fi, si) and same_bits(fv, sv), (algorithm, t)
    for t, (fi, fv, _, _) in enumerate(per_rank[0]):
        for other in per_rank[1:]:
            assert torch.equal(fi, other[t][0]) and same_bits(fv, other[t][1]), (algorithm, t)
