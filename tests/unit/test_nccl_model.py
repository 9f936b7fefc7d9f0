"""NCCL's tuning model (colltune.model.nccl): hand-computed cases, published measurements, sanity.

The hand-computed table follows NVIDIA/nccl v2.21.5-1, src/graph/tuning.cc
(ncclTopoTuneModel, ncclTopoGetAlgoTime), with the constants of
profiles/nccl-tuning.yaml. Constants used below (tuning.cc arrays):

- baseLat  Tree {LL 6.8, LL128 14.0, Simple 0}, Ring {LL 6.6, LL128 14.0, Simple 8.4}
- hwLat NVLINK Tree {0.6, 1.25, 28}, Ring {0.6, 1.9, 3.4}; NET Tree {5.0, 8.5, 28}, Ring {2.7, 4.0, 14.0}
- netOverhead (getNetOverhead): Intel 1.0, AMD 2.0 us; x3 for Simple; IB latencyInter 0
- llMaxBws: one node A100 87.7, H100 141.0; multi-node Intel {N2 39.0, N4 20.4}, AMD {N2 22.5, N4 19.0}
- perChMaxRingLL128Bws A100 20.0, H100 36.7; perChMaxTreeLL128Bws A100 20.0, H100 {36.7, 36.7, 29.0};
  perChMaxTreeBws A100 {24.0, 23.6, 17.8}, H100 {38.7, 41.4, 36.0}
- treeCorrectionFactor[proto][log2i(nBytes >> 6)]; ring plateau x1.4 (Ampere and later)

and the topology search outcome of colltune.model.nccl.topology_search
(checked in test_search_outcome): one DGX A100 12 ch x 20 GB/s (CPU AMD); A100
multi-node ring 8 x 24, tree 8 x 24 inter, 30 intra; one DGX H100 12 x 30 (CPU
Intel); H100 multi-node 8 x 48 (ring and tree).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from colltune.algorithms.errors import ColltuneValueError
from colltune.model import nccl
from colltune.model.nccl import Topology, collective_choice, collective_time_us, predict_all

ROOT = Path(__file__).resolve().parents[2]
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# (gpu, nodes, coll, nbytes, algorithm, protocol, expected us); 8 GPUs per node in every case.
HAND = [
    # 1. DGX A100, 8 ranks: busBw 12*20 = 240; LL min(87.7, 240*.5) = 87.7; algBw 87.7*8/14 = 50.114
    #    lat 6.6 + 14 steps * 0.6 = 15.0; time 15.0 + 1024/(1000*50.114) = 15.0204
    ("a100", 1, "all_reduce", 1 * KiB, "ring", "ll", 15.0204),
    # 2. DGX A100: tree min(240*.92, 12*24.0) = 220.8; LL128 min(220.8*7/9, 12*20) = 171.733; *.5 = 85.867;
    #    correction ll128[log2i(2^14) = 14] = 0.6 -> 51.52; lat 14.0 + 2*(7*1.25 + 0) = 31.5;
    #    time 31.5 + 1048576/51520 = 51.8528
    ("a100", 1, "all_reduce", 1 * MiB, "tree", "ll128", 51.8528),
    # 3. DGX H100: busBw 12*30 = 360; algBw 360*8/14 = 205.714; lat 8.4 + 14*3.4 = 56.0 (one node: no plateau);
    #    time 56.0 + 1073741824/205714.3 = 5275.5783
    ("h100", 1, "all_reduce", 1 * GiB, "ring", "simple", 5275.5783),
    # 4. 2 x DGX H100: tree bwIntra 48: 8*48 = 384; min(384*.92, 8*41.4) = 331.2; LL min(331.2/3.8, 39.0 Intel N2)
    #    = 39.0; *.5 = 19.5; correction ll[10] = 0.6 -> 11.7; lat 6.8 + 2*(7*0.6 + 1*5.0) = 25.2;
    #    time 25.2 + 65536/11700 = 30.8014
    ("h100", 2, "all_reduce", 64 * KiB, "tree", "ll", 30.8014),
    # 5. 2 x DGX A100: ring 8*24 = 192; LL128 min(192*.92, 8*20) = 160; algBw 160*16/30 = 85.333;
    #    lat 14.0 + (30-4)*max(1.9, 2.0 AMD) + 4*4.0 = 82.0; time 82.0 + 16777216/85333.3 = 278.608
    ("a100", 2, "all_reduce", 16 * MiB, "ring", "ll128", 278.608),
    # 6. 2 x DGX A100: tree bwIntra 30: 8*30 = 240; min(240*.92, 8*23.6) = 188.8; *.5 = 94.4;
    #    correction simple[22] = 0.9 -> 84.96; lat 0 + 2*(7*28 + 1*28) = 448; time 448 + 268435456/84960 = 3607.551
    ("a100", 2, "all_reduce", 256 * MiB, "tree", "simple", 3607.551),
    # 7. 8 x DGX H100: tree bwInter 48: 384; min(353.28, 8*36.0) = 288; LL128 min(288*120/128, 8*29.0) = 232;
    #    *.5 = 116; correction ll128[16] = 0.8 -> 92.8; lat 14.0 + 2*(7*1.25 + 3*8.5) = 82.5;
    #    time 82.5 + 4194304/92800 = 127.6972
    ("h100", 8, "all_reduce", 4 * MiB, "tree", "ll128", 127.6972),
    # 8. 8 x DGX H100: ring 384; algBw 384*64/126 = 195.048; lat 8.4 + (126-16)*max(3.4, 1.0*3) + 16*14 = 606.4,
    #    plateau (2^30/(16 ch * 64) >= 64) x1.4 = 848.96; time 848.96 + 1073741824/195047.6 = 6353.984
    ("h100", 8, "all_reduce", 1 * GiB, "ring", "simple", 6353.984),
    # 9. 8 x DGX A100: ring LL min(19.0 AMD N4, 192*.5) = 19.0; algBw 19*64/126 = 9.6508;
    #    lat 6.6 + 110*max(0.6, 2.0) + 16*2.7 = 269.8; time 269.8 + 1024/9650.8 = 269.9061
    ("a100", 8, "all_reduce", 1 * KiB, "ring", "ll", 269.9061),
    # 10. 128 x DGX H100: tree 288 (as 7); LL min(288/3.8, 20.4 Intel N4) = 20.4; *.5 = 10.2; correction ll[4] = 0.9
    #     -> 9.18; lat 6.8 + 2*(7*0.6 + 7*5.0) = 85.2; time 85.2 + 1024/9180 = 85.3115
    ("h100", 128, "all_reduce", 1 * KiB, "tree", "ll", 85.3115),
    # 11. 128 x DGX H100: tree 288; Simple *.5 = 144; correction simple[20] = 0.8 -> 115.2;
    #     lat 0 + 2*(7*28 + 7*28) = 784; time 784 + 67108864/115200 = 1366.5422
    ("h100", 128, "all_reduce", 64 * MiB, "tree", "simple", 1366.5422),
    # 12. 128 x DGX A100: ring LL128 160 (as 5); algBw 160*1024/2046 = 80.078; lat 14.0 + (2046-256)*2.0 + 256*4.0
    #     = 4618; time 4618 + 4194304/80078.2 = 4670.3776
    ("a100", 128, "all_reduce", 4 * MiB, "ring", "ll128", 4670.3776),
    # 13. 8 x DGX H100 all_gather of 8 MiB in all (128 KiB per rank): algBw 384*64/63 = 390.095;
    #     lat 8.4 + (63-7)*3.4 + 7*14 = 296.8 (plateau is all_reduce only); time 296.8 + 8388608/390095.2 = 318.304
    ("h100", 8, "all_gather", 8 * MiB, "ring", "simple", 318.304),
    # 14. DGX A100 reduce_scatter of 1 MiB in all: LL128 min(240*.92, 12*20) = 220.8; algBw 220.8*8/7 = 252.343;
    #     lat 14.0 + 7*1.9 = 27.3; time 27.3 + 1048576/252342.9 = 31.4554
    ("a100", 1, "reduce_scatter", 1 * MiB, "ring", "ll128", 31.4554),
    # 15. 128 x DGX H100 broadcast: LL min(20.4, 384*.5) = 20.4; algBw 20.4*1024/1024 = 20.4;
    #     lat 6.6 + one net hop 2.7 = 9.3; time 9.3 + 1048576/20400 = 60.7008
    ("h100", 128, "broadcast", 1 * MiB, "ring", "ll", 60.7008),
    # 16. 2 x DGX H100: tree 331.2 (as 4), Simple *.5 = 165.6, no correction at 1 GiB (log2i = 24 >= 23);
    #     lat 2*(7*28 + 1*28) = 448; time 448 + 1073741824/165600 = 6931.9482
    ("h100", 2, "all_reduce", 1 * GiB, "tree", "simple", 6931.9482),
]


@pytest.mark.parametrize("gpu,nodes,coll,nbytes,algo,proto,expected", HAND)
def test_hand_computed_cases(gpu: str, nodes: int, coll: str, nbytes: int, algo: str, proto: str,
                             expected: float) -> None:
    got = predict_all(coll, nbytes, Topology(nodes=nodes, gpus_per_node=8, gpu=gpu))[(algo, proto)]
    assert got == pytest.approx(expected, rel=0.01)


def test_hand_cases_cover_the_grid() -> None:
    assert {(c[4], c[5]) for c in HAND} >= {(a, p) for a in nccl.ALGORITHMS for p in nccl.PROTOCOLS}
    assert {c[1] for c in HAND} >= {1, 2, 8, 128}
    assert min(c[3] for c in HAND) == 1 * KiB and max(c[3] for c in HAND) == 1 * GiB


@pytest.mark.parametrize("gpu,nodes,ring,tree,comm", [
    ("a100", 1, (12, 20.0, 20.0), (12, 20.0, 20.0), 24),
    ("a100", 2, (8, 24.0, 24.0), (8, 30.0, 24.0), 16),
    ("a100", 128, (8, 24.0, 24.0), (8, 30.0, 24.0), 16),
    ("h100", 1, (12, 30.0, 30.0), (12, 30.0, 30.0), 24),
    ("h100", 8, (8, 48.0, 48.0), (8, 48.0, 48.0), 16),
])
def test_search_outcome(gpu: str, nodes: int, ring: tuple, tree: tuple, comm: int) -> None:
    found = nccl.topology_search(Topology(nodes=nodes, gpus_per_node=8, gpu=gpu))
    assert (found.ring.channels, found.ring.bw_intra, found.ring.bw_inter) == ring
    assert (found.tree.channels, found.tree.bw_intra, found.tree.bw_inter) == tree
    assert found.comm_channels == comm and not found.tree_is_chain


def test_choice_is_the_minimum_in_nccl_order() -> None:
    topo = Topology(nodes=16, gpus_per_node=8, gpu="h100")
    for nbytes in (1 * KiB, 1 * MiB, 64 * MiB, 1 * GiB):
        table = predict_all("all_reduce", nbytes, topo)
        choice = collective_choice("all_reduce", nbytes, topo)
        assert choice.time_us == min(table.values()) == collective_time_us("all_reduce", nbytes, topo)
        assert table[(choice.algorithm, choice.protocol)] == choice.time_us
        assert choice.time_us == pytest.approx(choice.latency_us + nbytes / (1000 * choice.bandwidth_GBps))
    assert set(predict_all("all_gather", 1 * MiB, topo)) == {("ring", p) for p in nccl.PROTOCOLS}


# --------------------------------------------------------------------------- published measurements

def _busbw(nbytes: int, topo: Topology, algorithms: tuple[str, ...] = nccl.ALGORITHMS) -> float:
    """nccl-tests' all_reduce bus bandwidth of the model's time: algbw * 2(P-1)/P, GB/s."""
    time = min(t for (a, _), t in predict_all("all_reduce", nbytes, topo).items() if a in algorithms)
    p = topo.world_size
    return nbytes / (1000.0 * time) * 2 * (p - 1) / p


# (label, topology, nbytes, published busbw GB/s, algorithms NCCL ran, source)
PUBLISHED = [
    # An HGX A100 node, all_reduce_perf -b 8 -e 4G -g 8: "result: 232.54GB/s" (the peak, at the largest sizes).
    ("A100 1x8", Topology(1, 8, "a100"), 4 * GiB, 232.54, nccl.ALGORITHMS,
     "https://github.com/NVIDIA/nccl-tests/issues/175"),
    # NVIDIA (AddyLaddy): "On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and we measure 192GB/s
    # AllReduce BusBW" (large sizes; the node count is not given: 4 nodes here, beyond the 2-node tree case).
    ("DGX A100 x4", Topology(4, 8, "a100"), 4 * GiB, 192.0, nccl.ALGORITHMS,
     "https://github.com/NVIDIA/nccl/issues/812"),
    # 3 servers of 8 A100 SXM4 40GB, 4 HDR 200 Gb/s NICs (100 Gb/s per GPU), Xeon Platinum 8358,
    # all_reduce_perf -b 8 -e 128M: "peak performance reaches about 96GB/s".
    ("A100 3x8, 4 HDR", Topology(3, 8, "a100", nic_gbps=100.0, cpu="intel"), 128 * MiB, 96.0, nccl.ALGORITHMS,
     "https://github.com/NVIDIA/nccl-tests/issues/119"),
    # NVIDIA (sjeaugey) on 8 H100: "NCCL can get an effective NVLink bandwidth of 370GB/s, which you can observe
    # as BusBw ... when running with NCCL_ALGO=RING" (large sizes).
    ("H100 1x8 Ring", Topology(1, 8, "h100"), 8 * GiB, 370.0, ("ring",),
     "https://github.com/NVIDIA/nccl-tests/issues/212"),
    # NVIDIA (AddyLaddy), 2 H100 nodes with NCCL_ALGO=RING: "For NDR @ 400Gbps you should see 46-48GB/s per NIC";
    # 8 NICs: 368 to 384, the middle 376.
    ("H100 2x8 Ring", Topology(2, 8, "h100"), 8 * GiB, 376.0, ("ring",),
     "https://github.com/NVIDIA/nccl-tests/issues/290"),
]
# 4 nodes of 8 H100 80GB HBM3, 8 x 400 Gb/s InfiniBand, NCCL 2.24.3, all_reduce_perf out-of-place busbw per size:
# results/nccl/nccl_multinode/nccl_allreduce_20260224_225706.txt of https://github.com/ZiyanIshani/vpbenchmarking
H100_4X8 = [(64 * MiB, 224.38), (128 * MiB, 275.26), (256 * MiB, 239.78), (512 * MiB, 290.67), (1 * GiB, 324.48),
            (2 * GiB, 328.11), (4 * GiB, 329.36), (8 * GiB, 330.93)]
PUBLISHED += [(f"H100 4x8 {n >> 20} MiB", Topology(4, 8, "h100"), n, bw, nccl.ALGORITHMS,
               "https://github.com/ZiyanIshani/vpbenchmarking") for n, bw in H100_4X8]


@pytest.mark.parametrize("label,topo,nbytes,published,algorithms,source", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_bus_bandwidth_matches_published_measurements(label: str, topo: Topology, nbytes: int, published: float,
                                                      algorithms: tuple[str, ...], source: str) -> None:
    assert nbytes >= 64 * MiB
    ratio = _busbw(nbytes, topo, algorithms) / published
    assert 0.75 <= ratio <= 1.25, f"{label}: model/published = {ratio:.2f} ({source})"


# --------------------------------------------------------------------------- sanity

SIZES = [1 << k for k in range(10, 31)]  # 1 KiB .. 1 GiB, powers of two


@pytest.mark.parametrize("coll", nccl.COLLECTIVES)
@pytest.mark.parametrize("topo", [Topology(1, 8, "a100"), Topology(2, 8, "h100"), Topology(128, 8, "h100"),
                                  Topology(16, 1, "v100"), Topology(4, 4, "a100", intra_link="pcie")])
def test_time_increases_with_size(coll: str, topo: Topology) -> None:
    times = [collective_time_us(coll, n, topo) for n in SIZES]
    assert all(b > a for a, b in zip(times, times[1:]))


@pytest.mark.parametrize("gpu", ["v100", "a100", "h100"])
def test_one_node_of_eight_beats_eight_nodes_of_one(gpu: str) -> None:
    for nbytes in (1 * MiB, 64 * MiB, 1 * GiB):
        inside = collective_time_us("all_reduce", nbytes, Topology(1, 8, gpu))
        spread = collective_time_us("all_reduce", nbytes, Topology(8, 1, gpu))
        assert inside < spread


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_tree_beats_ring_at_small_sizes_on_many_nodes(gpu: str) -> None:
    topo = Topology(128, 8, gpu)
    for nbytes in (1 * KiB, 64 * KiB, 1 * MiB):
        table = predict_all("all_reduce", nbytes, topo)
        tree = min(t for (a, _), t in table.items() if a == "tree")
        ring = min(t for (a, _), t in table.items() if a == "ring")
        assert tree < ring
        assert collective_choice("all_reduce", nbytes, topo).algorithm == "tree"


def test_one_rank_costs_nothing() -> None:
    assert collective_time_us("all_reduce", 1 * MiB, Topology(1, 1, "h100")) == 0.0


def test_pcie_nodes_have_no_ll128() -> None:
    table = predict_all("all_reduce", 1 * MiB, Topology(2, 8, "a100", intra_link="pcie"))
    assert not any(p == "ll128" for _, p in table)


# --------------------------------------------------------------------------- point to point, all-to-all

def test_p2p_formula() -> None:
    topo = Topology(8, 8, "h100")
    # one Ring/Simple step: 8.4 + 14 across nodes, min(PCIe 48, 8 * 400/8 / 8) = 48 GB/s
    assert nccl.p2p_time_us(1 * MiB, topo) == pytest.approx(8.4 + 14.0 + 1048576 / 48000)
    # two sends in flight share it
    assert nccl.p2p_time_us(1 * MiB, topo, peers_in_flight=2) == pytest.approx(22.4 + 2 * 1048576 / 48000)
    # within the node: 8.4 + 3.4, the one-node ring graph's 12 * 30 = 360 GB/s
    assert nccl.p2p_time_us(1 * MiB, topo, inter_node=False) == pytest.approx(11.8 + 1048576 / 360000)


def test_p2p_shares_the_node_nics() -> None:
    topo = Topology(4, 8, "v100")  # 50 Gb/s per GPU: 50 GB/s per node, PCIe Gen3 12 GB/s per GPU
    all_send = nccl.p2p_time_us(64 * MiB, topo)
    one_sends = nccl.p2p_time_us(64 * MiB, topo, senders_per_node=1)
    assert all_send == pytest.approx(22.4 + 64 * MiB / (1000 * 50 / 8))
    assert one_sends == pytest.approx(22.4 + 64 * MiB / (1000 * 12.0))  # capped by the GPU's PCIe link


def test_all_to_all_formula() -> None:
    # one DGX H100: 7 local peers served one at a time (24 p2p channels, 24 per NVLink peer):
    # 8.4 + 7 * 3.4 + 7 * 1024 / 360000
    assert nccl.all_to_all_time_us(1024, Topology(1, 8, "h100")) == pytest.approx(8.4 + 7 * 3.4 + 7 * 1024 / 360e3)
    topo = Topology(16, 8, "h100")
    big, small = nccl.all_to_all_time_us(1 * MiB, topo), nccl.all_to_all_time_us(1 * KiB, topo)
    # 120 remote peers at 48 GB/s per rank dominate at 1 MiB
    assert big > 120 * 1 * MiB / 48e3 and small < big
    assert nccl.all_to_all_time_us(0, Topology(1, 1, "a100")) == 0.0


# --------------------------------------------------------------------------- validation and the data file

@pytest.mark.parametrize("kwargs,field", [
    ({"nodes": 0}, "nodes"), ({"gpus_per_node": 2.0}, "gpus_per_node"), ({"gpu": "tpu"}, "gpu"),
    ({"nic_gbps": -1.0}, "nic_gbps"), ({"intra_link": "ethernet"}, "intra_link"), ({"cpu": "arm"}, "cpu"),
])
def test_topology_names_the_bad_field(kwargs: dict, field: str) -> None:
    args = {"nodes": 2, "gpus_per_node": 8, "gpu": "a100", **kwargs}
    with pytest.raises(ColltuneValueError, match=f"`{field}`") as info:
        Topology(**args)
    assert info.value.argument == field


def test_calls_name_the_bad_argument() -> None:
    topo = Topology(2, 8, "a100")
    with pytest.raises(ColltuneValueError, match="`coll`"):
        collective_time_us("all_to_all", 1024, topo)
    with pytest.raises(ColltuneValueError, match="`nbytes`"):
        predict_all("all_reduce", -1, topo)
    with pytest.raises(ColltuneValueError, match="`inter_node`"):
        nccl.p2p_time_us(1024, Topology(1, 8, "a100"))
    with pytest.raises(ColltuneValueError, match="`senders_per_node`"):
        nccl.p2p_time_us(1024, topo, senders_per_node=9)


def test_the_shipped_file_cites_its_release() -> None:
    tuning = nccl.load_tuning()
    assert tuning.source["release"] == "v2.21.5-1" and "src/graph/tuning.cc" in tuning.source["files"]
    assert set(tuning.generations) >= {"v100", "a100", "h100"}
    text = (ROOT / "profiles" / nccl.DATA_FILE).read_text()
    for array in ("baseLat", "hwLat", "llMaxBws", "perChMaxRingLL128Bws", "perChMaxTreeBws", "treeCorrectionFactor"):
        assert array in text


def _edited(tmp_path: Path, edit) -> str:
    data = yaml.safe_load((ROOT / "profiles" / nccl.DATA_FILE).read_text())
    edit(data)
    path = tmp_path / "tuning.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("edit,key", [
    (lambda d: d["release"]["factors"].update({"ring_l": 0.5}), "release.factors"),
    (lambda d: d["generations"]["a100"].pop("pcie_bw"), "generations.a100"),
    (lambda d: d["release"]["tree_correction_factor"]["ll"].pop(), "release.tree_correction_factor.ll"),
    (lambda d: d["release"]["base_latency_us"]["ring"].update(ll="fast"), "release.base_latency_us.ring.ll"),
    (lambda d: d["generations"]["h100"].update(cpu="arm"), "generations.h100.cpu"),
])
def test_the_loader_is_strict(tmp_path: Path, edit, key: str) -> None:
    with pytest.raises(ColltuneValueError, match=key.replace(".", r"\.")):
        nccl.load_tuning(_edited(tmp_path, edit))


def test_the_model_imports_without_torch() -> None:
    code = """
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked")
sys.meta_path.insert(0, _Block())
from colltune.model import nccl
print(nccl.collective_time_us("all_reduce", 1 << 20, nccl.Topology(2, 8, "h100")) > 0, "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"]
