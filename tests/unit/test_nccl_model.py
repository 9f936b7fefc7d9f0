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
- Tree pattern factor x0.85 when the tree graph is NCCL_TOPO_PATTERN_TREE (tuning.cc line 185): one GPU
  per node (search.cc line 897) and every sm90 multi-node tree (search.cc lines 963-966)
- NVLS / NVLS_TREE (Simple only, tuning.cc line 172): baseLat 0; hwLat NVLINK 25 / 25, NET 18 / 14
  (lines 69, 77); busBw = nChannels * min(bwIntra, bwInter) for NVLS (line 175), nChannels * min(bwIntra,
  bwInter, or bwInter/2 beyond 2 nodes) for NVLS_TREE (line 176); algBw = busBw * 5/6 (line 216);
  latency NVLS = 25 (line 259), NVLS_TREE = 25 + 2 log2i(nNodes) * 14 (line 262)

and the topology search outcome of colltune.model.nccl.topology_search
(checked in test_search_outcome): one DGX A100 12 ch x 20 GB/s (CPU AMD); A100
multi-node ring 8 x 24, tree 8 x 24 inter, 30 intra; one DGX H100 12 x 30 (CPU
Intel); H100 multi-node 8 x 48 (ring and tree, the tree a chain); NVLS on one
DGX H100 8 ch x 40 intra / 60 inter, across DGX H100 nodes 8 x 40 / 48.
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
    #    = 39.0; sm90 chain *.85 = 33.15; *.5 = 16.575; correction ll[10] = 0.6 -> 9.945;
    #    lat 6.8 + 2*(7*0.6 + 1*5.0) = 25.2; time 25.2 + 65536/9945 = 31.7898
    ("h100", 2, "all_reduce", 64 * KiB, "tree", "ll", 31.7898),
    # 5. 2 x DGX A100: ring 8*24 = 192; LL128 min(192*.92, 8*20) = 160; algBw 160*16/30 = 85.333;
    #    lat 14.0 + (30-4)*max(1.9, 2.0 AMD) + 4*4.0 = 82.0; time 82.0 + 16777216/85333.3 = 278.608
    ("a100", 2, "all_reduce", 16 * MiB, "ring", "ll128", 278.608),
    # 6. 2 x DGX A100: tree bwIntra 30: 8*30 = 240; min(240*.92, 8*23.6) = 188.8; *.5 = 94.4;
    #    correction simple[22] = 0.9 -> 84.96; lat 0 + 2*(7*28 + 1*28) = 448; time 448 + 268435456/84960 = 3607.551
    ("a100", 2, "all_reduce", 256 * MiB, "tree", "simple", 3607.551),
    # 7. 8 x DGX H100: tree bwInter 48: 384; min(353.28, 8*36.0) = 288; LL128 min(288*120/128, 8*29.0) = 232;
    #    chain *.85 = 197.2; *.5 = 98.6; correction ll128[16] = 0.8 -> 78.88; lat 14.0 + 2*(7*1.25 + 3*8.5) = 82.5;
    #    time 82.5 + 4194304/78880 = 135.6732
    ("h100", 8, "all_reduce", 4 * MiB, "tree", "ll128", 135.6732),
    # 8. 8 x DGX H100: ring 384; algBw 384*64/126 = 195.048; lat 8.4 + (126-16)*max(3.4, 1.0*3) + 16*14 = 606.4,
    #    plateau (2^30/(16 ch * 64) >= 64) x1.4 = 848.96; time 848.96 + 1073741824/195047.6 = 6353.984
    ("h100", 8, "all_reduce", 1 * GiB, "ring", "simple", 6353.984),
    # 9. 8 x DGX A100: ring LL min(19.0 AMD N4, 192*.5) = 19.0; algBw 19*64/126 = 9.6508;
    #    lat 6.6 + 110*max(0.6, 2.0) + 16*2.7 = 269.8; time 269.8 + 1024/9650.8 = 269.9061
    ("a100", 8, "all_reduce", 1 * KiB, "ring", "ll", 269.9061),
    # 10. 128 x DGX H100: tree 288 (as 7); LL min(288/3.8, 20.4 Intel N4) = 20.4; chain *.85 = 17.34; *.5 = 8.67;
    #     correction ll[4] = 0.9 -> 7.803; lat 6.8 + 2*(7*0.6 + 7*5.0) = 85.2; time 85.2 + 1024/7803 = 85.3312
    ("h100", 128, "all_reduce", 1 * KiB, "tree", "ll", 85.3312),
    # 11. 128 x DGX H100: tree 288; chain *.85 = 244.8; Simple *.5 = 122.4; correction simple[20] = 0.8 -> 97.92;
    #     lat 0 + 2*(7*28 + 7*28) = 784; time 784 + 67108864/97920 = 1469.3430
    ("h100", 128, "all_reduce", 64 * MiB, "tree", "simple", 1469.3430),
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
    # 16. 2 x DGX H100: tree 331.2 (as 4), chain *.85 = 281.52, Simple *.5 = 140.76, no correction at 1 GiB
    #     (log2i = 24 >= 23); lat 2*(7*28 + 1*28) = 448; time 448 + 1073741824/140760 = 8076.1723
    ("h100", 2, "all_reduce", 1 * GiB, "tree", "simple", 8076.1723),
    # 17. DGX H100, NVLS: graph 8 ch x 40 intra / 60 inter; busBw 8*min(40, 60) = 320; algBw 320*5/6 = 266.667;
    #     lat 25; time 25 + 1073741824/266666.7 = 4051.5318
    ("h100", 1, "all_reduce", 1 * GiB, "nvls", "simple", 4051.5318),
    # 18. DGX H100, NVLS at 4 MiB: 25 + 4194304/266666.7 = 40.7286
    ("h100", 1, "all_reduce", 4 * MiB, "nvls", "simple", 40.7286),
    # 19. 2 x DGX H100, NVLS_TREE: graph 8 x 40 / 48; 8*min(40, 48) = 320; *5/6 = 266.667;
    #     lat 25 + 2*log2i(2)*14 = 53; time 53 + 1073741824/266666.7 = 4079.5318
    ("h100", 2, "all_reduce", 1 * GiB, "nvls_tree", "simple", 4079.5318),
    # 20. 8 x DGX H100, NVLS_TREE beyond 2 nodes: 8*min(40, 48/2) = 192; *5/6 = 160;
    #     lat 25 + 2*3*14 = 109; time 109 + 67108864/160000 = 528.4304
    ("h100", 8, "all_reduce", 64 * MiB, "nvls_tree", "simple", 528.4304),
    # 21. 128 x DGX H100, NVLS_TREE: 160 (as 20); lat 25 + 2*7*14 = 221; time 221 + 1048576/160000 = 227.5536
    ("h100", 128, "all_reduce", 1 * MiB, "nvls_tree", "simple", 227.5536),
    # 22. DGX H100 reduce_scatter of 64 MiB in all, NVLS (one node only): 25 + 67108864/266666.7 = 276.6582
    ("h100", 1, "reduce_scatter", 64 * MiB, "nvls", "simple", 276.6582),
]

# What NCCL picks among the pairs above, where the pick is part of the case (numbers as in HAND):
# 17: ring/simple 5275.58 (case 3) > nvls 4051.53; 18: ring/ll128 14 + 14*1.9 + 4194304/(331.2*8/14 * 1000)
# = 62.76 > nvls 40.73; 19: ring/simple (152.8 * 1.4 plateau) + 1073741824/204800 = 5456.80 > 4079.53;
# 20: ring/simple 848.96 + 67108864/195047.6 = 1193.03 and tree/simple 560 + 67108864/97920 = 1245.34 > 528.43;
# 21: tree/ll128 150.5 + 1048576/59160 = 168.22 < nvls_tree 227.55.
PICKS = [("h100", 1, 1 * GiB, "nvls"), ("h100", 1, 4 * MiB, "nvls"), ("h100", 2, 1 * GiB, "nvls_tree"),
         ("h100", 8, 64 * MiB, "nvls_tree"), ("h100", 128, 1 * MiB, "tree")]


@pytest.mark.parametrize("gpu,nodes,coll,nbytes,algo,proto,expected", HAND)
def test_hand_computed_cases(gpu: str, nodes: int, coll: str, nbytes: int, algo: str, proto: str,
                             expected: float) -> None:
    got = predict_all(coll, nbytes, Topology(nodes=nodes, gpus_per_node=8, gpu=gpu))[(algo, proto)]
    assert got == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("gpu,nodes,nbytes,algo", PICKS)
def test_hand_computed_picks(gpu: str, nodes: int, nbytes: int, algo: str) -> None:
    assert collective_choice("all_reduce", nbytes, Topology(nodes, 8, gpu)).algorithm == algo


def test_hand_cases_cover_the_grid() -> None:
    pairs = {(a, p) for a in ("tree", "ring") for p in nccl.PROTOCOLS} | {("nvls", "simple"), ("nvls_tree", "simple")}
    assert {(c[4], c[5]) for c in HAND} >= pairs
    assert {c[1] for c in HAND} >= {1, 2, 8, 128}
    assert min(c[3] for c in HAND) == 1 * KiB and max(c[3] for c in HAND) == 1 * GiB


# NVLS graphs (search.cc v2.21.5-1 ncclTopoCompute, lines 893-1024): a DGX H100 GPU has 18 NVLinks of 20.6
# (topo.h SM90_NVLINK_BW) = 370.8 GB/s into the NVSwitch; with c channels of speed s a head GPU carries (c+1)s.
# One node: start at 50 (60 * 8 > 370.8 * 8/7), 7 * 50 > 370.8 allows 6 < 8 channels; 40: 9 * 40 = 360 fits 8;
# pass 2 raises bwInter 40 -> 50 -> 60. Across nodes (one channel per NIC, PCIe path 48): 48 fits 6, 45 fits 7,
# 42 fits 7, 40 fits 8 = one per GPU; pass 2 raises bwInter to 42, 45, 48 (the NIC path's limit).
@pytest.mark.parametrize("gpu,nodes,ring,tree,comm,chain,nvls", [
    ("a100", 1, (12, 20.0, 20.0), (12, 20.0, 20.0), 24, False, None),
    ("a100", 2, (8, 24.0, 24.0), (8, 30.0, 24.0), 16, False, None),
    ("a100", 128, (8, 24.0, 24.0), (8, 30.0, 24.0), 16, False, None),
    ("h100", 1, (12, 30.0, 30.0), (12, 30.0, 30.0), 24, False, (8, 40.0, 60.0)),
    ("h100", 2, (8, 48.0, 48.0), (8, 48.0, 48.0), 16, True, (8, 40.0, 48.0)),
    ("h100", 8, (8, 48.0, 48.0), (8, 48.0, 48.0), 16, True, (8, 40.0, 48.0)),
])
def test_search_outcome(gpu: str, nodes: int, ring: tuple, tree: tuple, comm: int, chain: bool,
                        nvls: tuple | None) -> None:
    found = nccl.topology_search(Topology(nodes=nodes, gpus_per_node=8, gpu=gpu))
    assert (found.ring.channels, found.ring.bw_intra, found.ring.bw_inter) == ring
    assert (found.tree.channels, found.tree.bw_intra, found.tree.bw_inter) == tree
    assert found.comm_channels == comm and found.tree_is_chain is chain
    assert (None if found.nvls is None else (found.nvls.channels, found.nvls.bw_intra, found.nvls.bw_inter)) == nvls


def test_the_tree_is_a_chain_on_sm90_across_nodes_and_with_one_gpu_per_node() -> None:
    # search.cc v2.21.5-1 line 897 (one GPU per node, any generation); lines 963-966 (sm90, more than one node)
    assert nccl.topology_search(Topology(4, 1, "a100")).tree_is_chain
    assert nccl.topology_search(Topology(4, 4, "h100")).tree_is_chain
    assert not nccl.topology_search(Topology(4, 8, "a100")).tree_is_chain
    assert not nccl.topology_search(Topology(1, 8, "h100")).tree_is_chain


# NCCL's own prediction printed with NCCL_DEBUG_SUBSYS=TUNING on 8-GPU H100 nodes
# (https://github.com/NVIDIA/nccl/issues/1453): "16 Bytes -> Algo 0 proto 0 time 25.201847" and
# "524288 Bytes -> Algo 5 proto 2 time 59.553600" (Algo 0 = Tree, 5 = NVLS_TREE; proto 0 = LL, 2 = Simple).
# Tree/LL: lat 6.8 + 2*(7*0.6 + log2i(3)*5.0) = 25.2 (3 nodes; with 2 the LL cap would be 39.0, not 20.4);
# bw min(C*48*.92, C*36)/3.8 >= 20.4 for C >= 3, so 20.4 (Intel N4); chain *.85 = 17.34; *.5 = 8.67;
# correction ll[0] = 1.0; time 25.2 + 16/8670 = 25.2018455 (without the .85: 25.2015686).
# NVLS_TREE: the printed time needs 4 NVLS channels (a node with 4 NICs: one channel per NIC) at 48 GB/s:
# bw min(48, 48/2) = 24; 4*24*5/6 = 80; lat 25 + 2*log2i(3)*14 = 53; time 53 + 524288/80000 = 59.5536.
NCCL_PRINTED_3X8 = nccl.SearchResult(ring=nccl.Graph(8, 24.0, 24.0), tree=nccl.Graph(8, 24.0, 24.0),
                                     tree_is_chain=True, comm_channels=16, nvls=nccl.Graph(4, 48.0, 48.0))


def test_times_nccl_printed_on_three_h100_nodes() -> None:
    modelled = Topology(3, 8, "h100")
    assert predict_all("all_reduce", 16, modelled)[("tree", "ll")] == pytest.approx(25.201847, rel=1e-6)
    assert collective_choice("all_reduce", 16, modelled).algorithm == "tree"
    recorded = Topology(3, 8, "h100", search=NCCL_PRINTED_3X8)  # the graphs NCCL's search found there
    assert predict_all("all_reduce", 16, recorded)[("tree", "ll")] == pytest.approx(25.201847, rel=1e-6)
    assert predict_all("all_reduce", 524288, recorded)[("nvls_tree", "simple")] == pytest.approx(59.5536, rel=1e-6)
    assert collective_choice("all_reduce", 524288, recorded).algorithm == "nvls_tree"
    disabled = Topology(3, 8, "h100", nvls=False, search=NCCL_PRINTED_3X8)  # NCCL_NVLS_ENABLE=0
    assert ("nvls_tree", "simple") not in predict_all("all_reduce", 524288, disabled)


# --------------------------------------------------------------------------- NVLS gating

@pytest.mark.parametrize("topo", [
    Topology(1, 8, "a100"),                       # sm80: search.cc line 893
    Topology(1, 2, "h100"),                       # 2 GPUs: nvls.cc line 241
    Topology(2, 8, "h100", intra_link="pcie"),    # no NVSwitch: search.cc line 893
    Topology(2, 8, "h100", nvls=False),           # no multicast support (or NCCL_NVLS_ENABLE=0)
])
def test_no_nvls_where_nccl_finds_none(topo: Topology) -> None:
    assert nccl.topology_search(topo).nvls is None
    assert not {a for a, _ in predict_all("all_reduce", 1 * GiB, topo)} & {"nvls", "nvls_tree"}


@pytest.mark.parametrize("dtype,op,ok", [
    ("float32", "sum", True), ("bfloat16", "sum", True), ("float16", "sum", True), ("int64", "sum", True),
    ("float64", "sum", True), ("uint8", "sum", False), ("int8", "sum", False), ("float32", "max", False),
    ("bfloat16", "max", True), ("int32", "min", True), ("float32", "avg", False), ("float32", "prod", False),
])
def test_nvls_needs_a_type_and_op_the_switch_reduces(dtype: str, op: str, ok: bool) -> None:
    # include/device.h ncclNvlsSupported, v2.21.5-1 lines 423-440
    assert nccl.nvls_supported(dtype, op) is ok
    for nodes, algo in ((1, "nvls"), (4, "nvls_tree")):
        table = predict_all("all_reduce", 1 * GiB, Topology(nodes, 8, "h100"), dtype=dtype, op=op)
        assert ((algo, "simple") in table) is ok


def test_nvls_runs_gathers_and_scatters_on_one_node_only() -> None:
    one, two = Topology(1, 8, "h100"), Topology(2, 8, "h100")
    assert ("nvls", "simple") in predict_all("all_gather", 1 * GiB, one)
    assert ("nvls", "simple") in predict_all("reduce_scatter", 1 * GiB, one)
    assert ("nvls", "simple") not in predict_all("all_gather", 1 * GiB, one, dtype="uint8")
    assert ("nvls", "simple") in predict_all("all_gather", 1 * GiB, one, op="avg")  # all_gather reduces nothing
    for coll in ("all_gather", "reduce_scatter", "broadcast"):
        assert not {a for a, _ in predict_all(coll, 1 * GiB, two)} & {"nvls", "nvls_tree"}
    assert not {a for a, _ in predict_all("broadcast", 1 * GiB, one)} & {"nvls", "nvls_tree"}
    # on one DGX H100 Ring stays faster for all_gather at every size: LL below 4.6 MB, LL128 and Simple above
    assert all(collective_choice("all_gather", 1 << k, one).algorithm == "ring" for k in range(10, 31))


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
# The same 8 H100 80GB HBM3 on one node, NCCL 2.24.3 (NVLS by default), all_reduce_perf -g 8 out-of-place busbw:
# results/nccl/nccl_allreduce_20260224_223444.txt of https://github.com/ZiyanIshani/vpbenchmarking
H100_1X8 = [(64 * MiB, 357.44), (128 * MiB, 399.19), (256 * MiB, 422.38), (512 * MiB, 436.40),
            (1 * GiB, 468.53), (2 * GiB, 474.62), (4 * GiB, 477.12), (8 * GiB, 479.72)]
PUBLISHED += [(f"H100 1x8 {n >> 20} MiB", Topology(1, 8, "h100"), n, bw, nccl.ALGORITHMS,
               "https://github.com/ZiyanIshani/vpbenchmarking") for n, bw in H100_1X8]


@pytest.mark.parametrize("label,topo,nbytes,published,algorithms,source", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_bus_bandwidth_matches_published_measurements(label: str, topo: Topology, nbytes: int, published: float,
                                                      algorithms: tuple[str, ...], source: str) -> None:
    assert nbytes >= 64 * MiB
    ratio = _busbw(nbytes, topo, algorithms) / published
    assert 0.75 <= ratio <= 1.25, f"{label}: model/published = {ratio:.2f} ({source})"


def test_one_dgx_h100_reaches_nvidias_nvls_figure() -> None:
    # NVIDIA (sjeaugey) on 8 H100: "allreduce uses NVLink SHARP by default ... On 8 GPUs, you should reach a peak
    # busBw of ~480GB/s (algbw ~275GB/s)" (https://github.com/NVIDIA/nccl-tests/issues/212); measured 479.72
    # at 8 GiB (H100_1X8). Model: algBw 266.7, busBw 266.7 * 14/8 = 466.7 at the limit; 466.3 at 8 GiB.
    topo = Topology(1, 8, "h100")
    assert collective_choice("all_reduce", 8 * GiB, topo).algorithm == "nvls"
    for published in (480.0, 479.72):
        assert 0.9 <= _busbw(8 * GiB, topo) / published <= 1.1
    assert 0.9 <= _busbw(1 * GiB, topo) / 468.53 <= 1.1


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
    assert all_send == pytest.approx(22.4 + 64 * MiB / (1000 * 0.96 * 50 / 8))  # 96% of line rate
    assert one_sends == pytest.approx(22.4 + 64 * MiB / (1000 * 12.0))  # capped by the GPU's PCIe link


# Published point-to-point figures (nccl-tests alltoall_perf), model against each within the stated tolerance.
def _alltoall_busbw(total_bytes: int, topo: Topology) -> float:
    """nccl-tests' alltoall bus bandwidth of the model's time: (bytes per rank / time) * (P-1)/P, GB/s."""
    p = topo.world_size
    return total_bytes / (1000.0 * nccl.all_to_all_time_us(total_bytes // p, topo)) * (p - 1) / p


@pytest.mark.parametrize("gpu,published", [("h100", 48.5), ("a100", 24.0)])
@pytest.mark.parametrize("nodes", [2, 8, 32])
def test_alltoall_reaches_one_nic_per_gpu(gpu: str, published: float, nodes: int) -> None:
    # NVIDIA: "Alltoall cannot aggregate the bandwidth of multiple NICs, so the performance you should see is the
    # performance of a single NIC"; "CX-7 NICs at NDR rate (400Gbps) should achieve up to 48-49GB/s per NIC"
    # (https://github.com/NVIDIA/nccl-tests/issues/267); HDR: "24 (what we see ourselves in general on perfect
    # setups)" (https://github.com/NVIDIA/nccl-tests/issues/160). A rank's bytes to other nodes over the time of a
    # 1 GiB-per-rank all-to-all: within 5%.
    topo = Topology(nodes, 8, gpu)
    total = 1 * GiB
    remote = total // topo.world_size * (topo.world_size - 8)
    per_nic = remote / (1000.0 * nccl.all_to_all_time_us(total // topo.world_size, topo))
    assert per_nic == pytest.approx(published, rel=0.05)
    # NVIDIA's rule for the busBw this gives: nodes/(nodes-1) x the network bandwidth per GPU
    # (https://github.com/NVIDIA/nccl-tests/issues/130), with nccl-tests' (P-1)/P: within 5%.
    p = topo.world_size
    assert _alltoall_busbw(total, topo) == pytest.approx(nodes / (nodes - 1) * published * (p - 1) / p, rel=0.05)


def test_alltoall_on_two_a100_nodes_with_four_hdr_nics() -> None:
    # 2 nodes of 8 A100 with 4 x 200 Gb/s NICs each (100 Gb/s per GPU), NCCL 2.18.6, alltoall_perf -b 4G -e 4G:
    # busbw 19.83 GB/s (https://github.com/NVIDIA/nccl/issues/1138). Model: 0.96 * 12.5 = 12 GB/s per rank across
    # nodes, half the peers remote: algbw about 24, busbw about 22.5; within 25%.
    ratio = _alltoall_busbw(4 * GiB, Topology(2, 8, "a100", nic_gbps=100.0)) / 19.83
    assert 0.75 <= ratio <= 1.25, ratio


def test_p2p_within_a_dgx_h100_matches_nvidias_nvlink_figure() -> None:
    # NVIDIA: "NCCL can get an effective NVLink bandwidth of 370GB/s, which you can observe as BusBw when running
    # non-allreduce operations" (https://github.com/NVIDIA/nccl-tests/issues/212); the model's 12 x 30: within 5%.
    topo = Topology(1, 8, "h100")
    bw = 1 * GiB / (1000.0 * (nccl.p2p_time_us(1 * GiB, topo, inter_node=False) - 11.8))
    assert bw == pytest.approx(370.0, rel=0.05)


def test_measured_p2p_figures_replace_the_defaults() -> None:
    measured = nccl.P2P(intra_latency_us=5.0, intra_GBps=300.0, inter_latency_us=30.0, inter_GBps=40.0)
    topo = Topology(4, 8, "h100", p2p=measured)
    assert nccl.p2p_time_us(1 * MiB, topo) == pytest.approx(30.0 + 1 * MiB / 40e3)
    assert nccl.p2p_time_us(1 * MiB, topo, inter_node=False) == pytest.approx(5.0 + 1 * MiB / 300e3)
    # one sender of the node gets the node's measured 8 * 40 GB/s, up to the larger of 40 and PCIe's 48
    assert nccl.p2p_time_us(1 * MiB, topo, senders_per_node=1) == pytest.approx(30.0 + 1 * MiB / 48e3)
    # all-to-all: the measured latency is the first round's, each further round one NCCL hop (14 us across nodes);
    # 24 remote peers, 8 at once (16 p2p channels, 2 per network peer): 3 rounds
    rounds = 3
    assert nccl.all_to_all_time_us(1 * MiB, topo) == pytest.approx(30.0 + (rounds - 1) * 14.0 + 24 * MiB / 40e3)
    partial = Topology(4, 8, "h100", p2p=nccl.P2P(inter_GBps=40.0))  # the other figures keep their defaults
    assert nccl.p2p_time_us(1 * MiB, partial) == pytest.approx(22.4 + 1 * MiB / 40e3)
    assert nccl.p2p_time_us(1 * MiB, partial, inter_node=False) == nccl.p2p_time_us(
        1 * MiB, Topology(4, 8, "h100"), inter_node=False)


def test_p2p_figures_read_from_a_profile_mapping() -> None:
    got = nccl.P2P.from_meta({"intra_node": {"latency_us": 11, "bandwidth_GBps": 350.5},
                              "inter_node": {"bandwidth_GBps": 45}})
    assert got == nccl.P2P(intra_latency_us=11.0, intra_GBps=350.5, inter_GBps=45.0)
    for bad, key in (({"cross_node": {}}, "cross_node"), ({"inter_node": {"latency": 1}}, "inter_node"),
                     ({"inter_node": {"bandwidth_GBps": 0}}, "bandwidth_GBps"),
                     ({"intra_node": {"latency_us": -1}}, "latency_us"), ([], "meta.p2p")):
        with pytest.raises(ColltuneValueError, match=key):
            nccl.P2P.from_meta(bad)


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
    ({"nvls": 1}, "nvls"), ({"search": "8 x 48"}, "search"), ({"p2p": {"inter_node": {}}}, "p2p"),
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
    with pytest.raises(ColltuneValueError, match="`dtype`"):
        predict_all("all_reduce", 1024, topo, dtype="fp32")
    with pytest.raises(ColltuneValueError, match="`op`"):
        collective_time_us("all_reduce", 1024, topo, op="mean")
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
