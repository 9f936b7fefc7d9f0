"""colltune on a CUDA device: exact, deterministic, fused equal to per-tensor, few host syncs.

One rank on NCCL (NCCL refuses two ranks on one GPU), and ranks sharing the
GPU over gloo (staged through host memory). Skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import tempfile

import pytest
import torch
import torch.distributed as dist

from colltune.algorithms import get, names

from ddp_cases import joined_sync_run, unused_layer_run
from harness import pool
from sparse_cases import DTYPES, RTOL

ALGORITHMS = [*names(), "auto"]
TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def nccl():
    """A one-rank NCCL group on this process's GPU."""
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def _input(seed, n, k, row_shape, dtype):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (k,), generator=g)
    vals = torch.randn((k, *row_shape), generator=g, dtype=torch.float64).to(dtype)
    return idx.cuda(), vals.cuda()


def _bits(t):
    return t.contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("row_shape", [(), (64,)])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_exact_against_a_dense_reference(nccl, algorithm, row_shape, dtype):
    import colltune

    n = 5000
    idx, vals = _input(1, n, 3000, row_shape, DTYPES[dtype])
    res = colltune.sparse_allreduce(idx, vals, size=n, algorithm=algorithm)
    ref = torch.zeros((n, *row_shape), dtype=torch.float64).index_add_(0, idx.cpu(), vals.double().cpu())
    mag = torch.zeros_like(ref).index_add_(0, idx.cpu(), vals.double().abs().cpu())
    got = res.to_dense().double().cpu()
    assert res.values.device.type == "cuda"
    assert torch.equal(res.indices.cpu(), idx.cpu().unique())
    assert ((got - ref).abs() <= RTOL[DTYPES[dtype]] * mag + 1e-30).all()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_twenty_identical_calls_give_one_bit_pattern(nccl, algorithm):
    import colltune

    idx, vals = _input(2, 1 << 16, 200_000, (16,), torch.float32)  # many duplicates per index
    patterns = {bytes(_bits(colltune.sparse_allreduce(idx, vals, size=1 << 16, algorithm=algorithm).values).numpy())
                for _ in range(20)}
    assert len(patterns) == 1


@pytest.mark.parametrize("fused", [False, True])
def test_an_async_call_from_a_side_stream_waits_for_its_inputs(nccl, fused):
    """The inputs are written on a side stream after a long kernel; the call runs on colltune's worker thread,
    whose stream must wait for them, and the caller's stream must wait for the result after ``wait()``."""
    import colltune

    n = 5000
    idx = torch.arange(0, n, 3, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        vals = torch.zeros(idx.numel(), 8, device="cuda")
        torch.cuda._sleep(200_000_000)  # about 0.1 s of spinning before the values are written
        vals.fill_(2.0)
        if fused:
            handle = colltune.sparse_allreduce_many([(idx, vals, n)], async_op=True)
            out = handle.wait()[0].values * 1.0
        else:
            out = colltune.sparse_allreduce(idx, vals, size=n, async_op=True).wait().values * 1.0
    torch.cuda.synchronize()
    assert bool((out == 2.0).all())


@pytest.mark.parametrize("algorithm", names())
def test_fused_equals_per_tensor_bit_for_bit(nccl, algorithm):
    import colltune

    tensors = [(*_input(10 + t, n, k, (64,), torch.float32), n) for t, (n, k) in enumerate([(77, 64), (1000, 900), (5, 9)])]
    fused = colltune.sparse_allreduce_many(tensors, algorithm=algorithm)
    for t, f in zip(tensors, fused):
        s = colltune.sparse_allreduce(*t, algorithm=algorithm)
        assert torch.equal(f.indices, s.indices) and torch.equal(_bits(f.values), _bits(s.values))


def _syncs(fn) -> int:
    """Host syncs of one call, counted as tools/gpu_call_bench.py counts them."""
    spec = importlib.util.spec_from_file_location("gpu_call_bench", TOOLS / "gpu_call_bench.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.count_syncs(fn, torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.parametrize("algorithm", [*names(), "auto"])
def test_host_syncs_per_call_at_p1(nccl, algorithm):
    import colltune

    idx, vals = _input(3, 1 << 20, 10_000, (64,), torch.float32)
    for _ in range(3):
        ran = colltune.sparse_allreduce(idx, vals, size=1 << 20, algorithm=algorithm, name="syncs").algorithm
    count = _syncs(lambda: colltune.sparse_allreduce(idx, vals, size=1 << 20, algorithm=algorithm, name="syncs"))
    # At least the coalesce's one read (a counter that saw nothing fails here), at most what the algorithm declares.
    assert 1 <= count <= get(ran).HOST_SYNCS["exact"], (ran, count)


@pytest.mark.parametrize("algorithm", names())
def test_topk_host_syncs_per_call_at_p1(nccl, algorithm):
    """A top-k call reads at most what the algorithm declares: steady, and refreshing Ok-Topk's thresholds (its exact
    local top-k and radix select read nothing, so a refresh reads less than a steady call)."""
    import colltune

    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(1 << 22, generator=g).cuda() for _ in range(2)]
    state = colltune.TopkState(density=1e-3, local_refresh=8, global_refresh=8)
    for step in range(6):
        colltune.topk_allreduce(grads[step % 2], state, algorithm=algorithm)
    steady = _syncs(lambda: colltune.topk_allreduce(grads[0], state, algorithm=algorithm))  # step 6
    colltune.topk_allreduce(grads[1], state, algorithm=algorithm)
    refresh = _syncs(lambda: colltune.topk_allreduce(grads[0], state, algorithm=algorithm))  # step 8
    assert steady <= get(algorithm).HOST_SYNCS["topk"] and refresh <= steady, (algorithm, steady, refresh)


def test_top_k_on_cuda_takes_the_hosts_entries_without_a_read():
    """Ties at the k-th largest go to the lowest positions on the GPU as on the host; the threshold stays there."""
    from colltune.algorithms.sparse import Magnitudes

    g = torch.Generator().manual_seed(6)
    acc = torch.randn(1 << 16, generator=g).round(decimals=1)  # many ties
    acc[::7] = 0.0
    host, dev = Magnitudes(acc), Magnitudes(acc.cuda())
    for k in (1, 100, 5000, 60000, 1 << 16):  # 60000: past the nonzero values, the k-th largest is 0
        (hidx, th), (didx, held) = host.top_k(k), dev.top_k(k)
        assert held.is_cuda and th == float(held) and torch.equal(hidx, didx.cpu()), k
    count = _syncs(lambda: dev.top_k(5000))
    assert count == 0, count


@pytest.mark.parametrize("algorithm", ["auto", "allgather", "dense"])
def test_a_fused_call_over_26_tables_reads_at_most_twice(nccl, algorithm):
    """The issue's fused budget, 2 host syncs for the whole list (1 measured at P = 1 on one H200)."""
    import colltune

    tables = [(*_input(20 + t, n, 2000, (64,), torch.float32), n) for t, n in enumerate([10**6] * 6 + [10**5] * 10 + [10**3] * 10)]
    for _ in range(3):
        colltune.sparse_allreduce_many(tables, algorithm=algorithm)
    count = _syncs(lambda: colltune.sparse_allreduce_many(tables, algorithm=algorithm))
    assert 1 <= count <= 2, count


def _gloo_on_cuda(rank, world_size, algorithm):
    import colltune

    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 3000, (2500,), generator=g).cuda()
    vals = torch.randn(2500, 8, generator=g).cuda()
    res = colltune.sparse_allreduce(idx, vals, size=3000, algorithm=algorithm)
    fused = colltune.sparse_allreduce_many([(idx, vals, 3000), (idx[:7] % 50, vals[:7, :3], 50)], algorithm=algorithm)
    return res.values.device.type, res.indices.cpu(), res.values.cpu(), fused[1].values.cpu()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_ranks_sharing_the_gpu_over_gloo(algorithm, world_size):
    out = pool(world_size).run(_gloo_on_cuda, algorithm)
    assert all(o[0] == "cuda" for o in out)
    for o in out[1:]:
        assert torch.equal(o[1], out[0][1]) and torch.equal(o[2].view(torch.int32), out[0][2].view(torch.int32))
        assert torch.equal(o[3], out[0][3])


def _wrappers_on_cuda(rank, world_size, algorithm, min_numel=1):
    """SparseGradSync and the DDP hook with CUDA tensors, ranks sharing the GPU over gloo."""
    import torch.nn as nn

    from colltune.train import ColltuneHookState, SparseGradSync, colltune_hook

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    rows, dim = 300, 8
    gens = [torch.Generator().manual_seed(r) for r in range(world_size)]
    ids = [(torch.rand(64, 4, generator=g) ** 3 * rows).long() for g in gens]  # skewed: ranks overlap
    coef = [torch.randn(64, dim, generator=g) for g in gens]
    torch.manual_seed(0)
    emb = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True).to(dev)
    (emb(ids[rank].to(dev)) * coef[rank].to(dev)).sum().backward()
    sync = SparseGradSync(emb, algorithm=algorithm)
    sync.synchronize()
    got = emb.weight.grad.to_dense().cpu()
    want = torch.zeros(rows, dim, dtype=torch.float64)
    for r in range(world_size):  # d/dW of sum(bag(ids) * coef): each looked-up row gets its sample's coefficients
        want.index_add_(0, ids[r].reshape(-1), coef[r].double().repeat_interleave(4, 0))
    want /= world_size

    tower = nn.Linear(16, 4).to(dev)
    plain = nn.parallel.DistributedDataParallel(tower, device_ids=[0])
    hooked = nn.parallel.DistributedDataParallel(nn.Linear(16, 4).to(dev), device_ids=[0])
    hooked.module.load_state_dict(tower.state_dict())
    state = ColltuneHookState(model=hooked, density=1.0, start_compression_iter=0, min_compress_numel=min_numel,
                              algorithm=algorithm)
    hooked.register_comm_hook(state, colltune_hook)
    x = torch.randn(32, 16, generator=gens[rank]).to(dev)
    grads = []
    for m in (plain, hooked):
        m(x).square().sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]).cpu())
    routes = sorted({d["route"] for d in state.decisions.values()})
    return (emb.weight.grad.device.type, got, want, *grads, routes)


@pytest.mark.parametrize("min_numel, routed", [(1, ["topk"]), (5, ["dense", "topk"])])
@pytest.mark.parametrize("algorithm", ["auto", "allgather", "oktopk"])
def test_training_wrappers_with_cuda_tensors_over_gloo(algorithm, min_numel, routed):
    """With ``min_numel`` 5 the bias (4 elements) stays dense beside the compressed weight: the bucket's Future
    joins an allreduce's and a top-k call's, and must make DDP's stream wait for both."""
    out = pool(2).run(_wrappers_on_cuda, algorithm, min_numel)
    for device, got, want, plain, hooked, routes in out:
        assert device == "cuda" and routes == routed  # the hook compressed (density 1 keeps every entry)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
        assert torch.allclose(hooked, plain, rtol=1e-5, atol=1e-6)  # density 1: top-k keeps every entry
    assert torch.equal(out[0][1], out[1][1]) and torch.equal(out[0][4], out[1][4])


def test_the_hook_gives_back_what_a_layer_no_rank_used_was_sent_on_cuda():
    """The give-back runs after DDP's finalize, on the GPU's stream: nothing top-k selected is lost."""
    for apart in pool(2).run(unused_layer_run, "cuda"):
        assert max(apart) < 1e-4, apart


def test_sync_trains_uneven_inputs_under_join_on_cuda():
    """SparseGradSync under Join beside DDP with CUDA tensors, ranks sharing the GPU over gloo: a joined rank
    shadows the last steps asynchronously; the model is the dense replay's and equal on both ranks."""
    for r in pool(2).run(joined_sync_run, {"mode": "async", "ddp": True, "device": "cuda"}, timeout=180):
        assert r["replicas"] == 0.0 and r["kept"] and r["steps"] == 5, r
        assert r["from_ref"] < 1e-5 and r["seen"] == 2 * r["steps"] and r["mine"] == r["rank"], r


def _online_on_cuda(rank, world_size):
    """``auto`` at one site, 70 calls: each call's time, from CUDA events, reaches every rank in a later record."""
    import colltune
    from colltune.select.selector import Selector

    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 5000, (800,), generator=g).cuda()
    vals = torch.randn(800, 8, generator=g).cuda()
    colltune.configure(selector=Selector(environ={}))  # online correction on (the suite turns it off)
    try:
        out = [colltune.sparse_allreduce(idx, vals, size=5000, name="online") for _ in range(70)]
    finally:
        colltune.configure()
    return [(r.algorithm, None if r.decision.measured_us is None else dict(r.decision.measured_us)) for r in out]


def test_online_correction_measures_cuda_calls_and_every_rank_agrees():
    a, b = pool(2).run(_online_on_cuda)
    assert a == b  # the same decisions and the same measured figures (the maximum over ranks) on both ranks
    measured = a[-1][1]
    assert measured and all(us > 0 for us in measured.values()), a[-1]


def test_profile_on_nccl_measures_the_host_terms(tmp_path):
    """``colltune profile --backend nccl`` times small calls alone and writes the NCCL model's host terms."""
    import subprocess
    import sys

    from colltune.model.cost_model import Network
    from colltune.model.profile import load_profile

    out = tmp_path / "nccl.yaml"
    argv = [sys.executable, "-m", "colltune.cli", "profile", "--backend", "nccl", "--world-size", "1", "--n", "2^12",
            "--density", "1e-2", "--repeats", "2", "--no-progress", "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = load_profile(out).meta
    assert meta["backend"] == "nccl" and meta.get("gpu"), meta
    assert meta["host_call_us"] + meta["host_kernel_us"] + meta["host_sync_us"] > 0, meta
    assert "small calls" in meta["host_source"]
    assert Network.of(meta).prices_host


def test_the_trace_splits_a_cuda_calls_host_time(tmp_path):
    """``tools/gpu_call_bench.py --trace``: per contender, its parts, and its launches as the timing row counts them."""
    import json
    import subprocess
    import sys

    traces, rows = tmp_path / "traces", tmp_path / "calls.json"
    argv = [sys.executable, str(TOOLS / "gpu_call_bench.py"), "--log-n", "12", "--density", "1e-2", "--rows", "0",
            "--rounds", "2", "--warmup", "1", "--trace", str(traces), "--json", str(rows)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (label, per), = json.loads((traces / "host.json").read_text())["inputs"].items()
    counted = json.loads(rows.read_text())["rows"][0]
    for name in ("densify+all_reduce", *names()):
        got = per[name]
        assert got["launches"] > 0 and got["aten_us"] > 0 and got["runtime_us"] > 0, (name, got)
        if name in ("densify+all_reduce", "dense", "allgather"):  # the same kernels every steady call
            assert got["launches"] == pytest.approx(counted[name]["launches"], abs=1), (name, got, counted[name])
        assert (traces / f"{label}-{name.replace('+', '-plus-')}.json.gz").stat().st_size > 0
