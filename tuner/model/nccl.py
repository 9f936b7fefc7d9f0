"""NCCL's own tuning model: the time NCCL predicts for a collective, and the algorithm it picks.

For every collective call NCCL fills a table of predicted times, one per
algorithm and protocol, and runs the pair with the smallest (``enqueue.cc``
``topoGetAlgoInfo``). This module computes the same table, with the formulas
of ``src/graph/tuning.cc`` of one NCCL release and its constants read as data
from ``profiles/nccl-tuning.yaml`` (release, file and array named beside each
value). Pure Python: no torch, no GPU.

The table (NCCL v2.21.5-1, ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``)
-----------------------------------------------------------------------------

With ``P`` ranks on ``N`` nodes, a graph of ``C`` channels of ``bw`` GB/s each
(``bwIntra`` on at most 2 nodes, ``bwInter`` beyond), for each pair::

    busBw = C * bw, then per pair:
      Ring/LL      min(llMaxBw, busBw * 0.5)
      Ring/LL128   min(busBw * 0.92 (0.7 with one rank per node), C * perChMaxRingLL128Bw)
      Tree/*       min(busBw * 0.92, C * perChMaxTreeBw), then
      Tree/LL      min(busBw / 3.8, llMaxBw)
      Tree/LL128   min(busBw * (7/9 on one node, 120/128 beyond), C * perChMaxTreeLL128Bw)
      Tree         * 0.85 when the tree graph is a plain chain (NCCL_TOPO_PATTERN_TREE:
                   one GPU per node, and every sm90 tree across nodes)
      NVLS/Simple       C_nvls * min(bwIntra, bwInter) of the NVLS graph
      NVLS_TREE/Simple  C_nvls * min(bwIntra, bwInter, or bwInter / 2 beyond 2 nodes)
    algBw = busBw * P / nsteps (Ring), busBw * 5/6 (NVLS, NVLS_TREE) or busBw * 0.5 (Tree)

    latency (Ring)  = baseLat + (nsteps - nInterSteps) * max(intraLat, netOverhead)
                      + nInterSteps * interLat
    latency (Ring, broadcast) = baseLat + hwLat of one hop
    latency (Tree)  = baseLat + 2 * ((P/N - 1) * intraLat + log2i(N) * interLat)
    latency (NVLS)  = NVLink hop (25 us); (NVLS_TREE) = 25 + 2 * log2i(N) * 14 us

    time_us = latency * (1.9 before Ampere, else 1.4, for multi-node Ring/Simple
              all_reduce of at least 64 bytes per channel and rank)
              + nBytes / (1000 * algBw * treeCorrectionFactor[log2i(nBytes >> 6)])

where ``nsteps`` is ``2(P-1)`` for all_reduce, ``P-1`` for all_gather and
reduce_scatter, ``P`` for broadcast, and ``nInterSteps`` is ``2N`` (0 on one
node), ``N-1`` and ``N``; ``intraLat`` is the NVLink (or PCI) hop latency,
``interLat`` the network's, and ``netOverhead`` 1 us per network step on Intel
hosts, 2 us on AMD, three times that for Simple. Tree runs only all_reduce;
all_gather, reduce_scatter and broadcast run on Ring. LL128 needs NVLink (or
one GPU per node) inside the node.

NVLink SHARP (NVLS, NVLS_TREE) runs where NCCL enables it: NVSwitch nodes of
sm90 or later with 3 or more GPUs each and multicast support
(:attr:`Topology.nvls`), for an element type and operation the switch reduces
(:func:`nvls_supported`: sum of 32/64-bit integers and of 16/32/64-bit
floats; min and max of the integers and 16-bit floats). NVLS runs
all_reduce, all_gather and reduce_scatter on one node (across nodes it needs
CollNet); NVLS_TREE runs all_reduce across nodes. Its graph has up to one
channel per GPU (a DGX H100: 8 channels of 40 GB/s, so 320 GB/s of busBw,
266.7 of algBw, about 467 GB/s of nccl-tests bus bandwidth).

``nbytes``: NCCL's ``nBytes`` (``src/include/info.h`` ``ncclInfoSetDerived``)
----------------------------------------------------------------------------

- ``all_reduce``, ``broadcast``: the bytes of the buffer (count x element size);
- ``all_gather``: the bytes of the gathered *output* on one rank, i.e. each
  rank's contribution times the world size;
- ``reduce_scatter``: the bytes of the *input* on one rank, i.e. each rank's
  reduced share times the world size.

The topology search, modelled
-----------------------------

NCCL's bandwidths come from its topology search (``search.cc``
``ncclTopoCompute``): the number of channels and the GB/s per channel it can
route through the node. This module replays that search on a model of a DGX
node (an NVSwitch or PCIe fabric, one NIC per GPU, the figures of
:class:`Topology`) with NCCL's own speed arrays, stop rules, channel doubling
(``ncclTopoDupChannels``) and second pass; see :func:`topology_search`. It
finds, for example, 12 channels x 20 GB/s on one DGX A100, 12 x 30 on one DGX
H100, 8 x 24 and 8 x 48 across DGX A100 and H100 nodes. The NICs are modelled
per GPU (``nic_gbps``), a path to the NIC never beats the GPU's PCIe link, and
the tree graph gets the ring's channel count as in ``init.cc``.

Point-to-point and all-to-all (not in NCCL's tuner; colltune's model)
-----------------------------------------------------------------------

NCCL's tuner has no entry for send/recv. Here one message costs one Ring/Simple
step, ``p2p latency = baseLat(Ring, Simple) + hwLat(link, Ring, Simple)`` (plus
the NIC's latency twice across nodes), and moves at:

- within a node, the GPU's share of the fabric: the single-node ring graph's
  ``C * bw`` (240 GB/s on a DGX A100, 360 on a DGX H100, where NVIDIA measures
  370);
- across nodes, ``min(PCIe, 0.96 * node NIC bandwidth / senders)``: the node's
  NICs (``gpus_per_node * nic_gbps / 8`` GB/s) at the 96% of line rate NCCL's
  send/recv reaches (48 GB/s per NDR NIC, 24 per HDR, as NVIDIA measures),
  shared by the ranks of the node that send across nodes at once, never more
  than the GPU's PCIe link.

Measured figures (:class:`P2P`, a profile's ``meta.p2p``) replace any of these.

``all_to_all`` sends ``nbytes_per_peer`` to each of the other ranks, every rank
at once, NVLink and network in parallel: ``max(T_intra, T_inter)`` with ``T =
baseLat + ceil(peers / W) * hop + peers * nbytes_per_peer / bandwidth`` over
the ``gpus_per_node - 1`` local and ``P - gpus_per_node`` remote peers, where
``W`` is the number of peers NCCL serves at once (its p2p channels over its
channels per peer, ``paths.cc`` ``ncclTopoComputeP2pChannels``).

Left out: CollNet (needs SHARP switches, and with it NVLS across nodes), the
per-size channel and thread tuning, NCCL_ALGO/NCCL_PROTO and tuner plugins.

Example:
    >>> topo = Topology(nodes=16, gpus_per_node=8, gpu="h100")
    >>> round(collective_time_us("all_reduce", 4 << 20, topo), 1)
    152.7
    >>> choice = collective_choice("all_reduce", 4 << 20, topo)
    >>> choice.algorithm, choice.protocol
    ('tree', 'll128')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml

from colltune.algorithms.errors import ColltuneValueError
from colltune.model import yamlsafe

__all__ = [
    "COLLECTIVES",
    "ALGORITHMS",
    "PROTOCOLS",
    "DATA_FILE",
    "DTYPES",
    "OPS",
    "P2P",
    "Topology",
    "Graph",
    "SearchResult",
    "Choice",
    "Tuning",
    "load_tuning",
    "topology_search",
    "predict_all",
    "collective_choice",
    "collective_time_us",
    "nvls_supported",
    "p2p_time_us",
    "all_to_all_time_us",
]

#: The collectives priced with NCCL's tuning table.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
#: NCCL's algorithms modelled here, in NCCL's order (tuning.cc ``ncclAlgoStr``: Tree, Ring, then NVLS and
#: NVLS_TREE after the CollNet pair, which is left out).
ALGORITHMS = ("tree", "ring", "nvls", "nvls_tree")
#: NCCL's protocols, in NCCL's order.
PROTOCOLS = ("ll", "ll128", "simple")
#: The data file, in the shipped profiles folder.
DATA_FILE = "nccl-tuning.yaml"

_LINKS = ("nvlink", "pcie")
_CPUS = ("intel", "amd", "other")
_EPS = 1e-9


# --------------------------------------------------------------------------- the data file

_PROTO = {"ll": "number", "ll128": "number", "simple": "number"}
_ALGO = {"tree": _PROTO, "ring": _PROTO}
_NODES = {"n1": "number", "n2": "number", "n4": "number"}
_RELEASE = {
    "base_latency_us": _ALGO,
    "hw_latency_us": {"nvlink": _ALGO, "pci": _ALGO, "net": _ALGO},
    "net_overhead_us": {"intel": "number", "amd": "number", "other": "number"},
    "net_overhead_simple_factor": "number",
    "net_latency_us": "number",
    "ll_max_bw_multi_node": {"intel": {"n2": "number", "n4": "number"}, "amd": {"n2": "number", "n4": "number"}},
    "factors": {k: "number" for k in (
        "ring_ll", "ring_ll128", "ring_ll128_one_rank_per_node", "tree", "tree_ll_divisor", "tree_ll128_one_node",
        "tree_ll128_multi_node", "tree_simple_pattern", "ring_plateau_volta", "ring_plateau", "ring_plateau_min_bytes")},
    "tree_correction_factor": {"ll": ("numbers", 23), "ll128": ("numbers", 23), "simple": ("numbers", 23)},
    "search": {
        "max_channels": "int", "max_comm_channels": "int", "speed_intra": ("numbers", 0),
        "speed_inter": ("numbers", 0), "speed_intra_sm90": ("numbers", 0), "speed_inter_sm90": ("numbers", 0),
        "lower_speed_min_ratio": "number", "dup_min_bw": "number", "dup_sm90_bw": "number",
        "dup_sm90_channels": "int", "sm90_multi_node_dup_bw": "number", "fallback_bw": "number"},
    "nvls": {
        "hw_latency_us": {"nvlink": "number", "net": "number"}, "tree_hw_latency_us": {"nvlink": "number", "net": "number"},
        "bw_ratio": "number", "min_gpus_per_node": "int", "min_compute_capability": "int"},
}
_GENERATION = {
    "compute_capability": "int", "system": "text", "nvlink_links": "int", "nvlink_link_bw": "number",
    "pcie_bw": "number", "nic_gbps": "number", "cpu": "text", "ll_max_bw_one_node": "number",
    "ring_ll128_max_bw_per_channel": _NODES, "tree_ll128_max_bw_per_channel": _NODES,
    "tree_max_bw_per_channel": _NODES,
}
_SOURCE = {"repository": "text", "release": "text", "files": ("texts", 0)}


def _bad(where: str, problem: str, fix: str) -> ColltuneValueError:
    return ColltuneValueError(f"{where}: {problem}; {fix}", argument="path")


def _check(value: Any, spec: Any, where: str) -> None:
    """Check ``value`` against ``spec`` (a dict of exact keys, "number", "int", "text" or a list spec)."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise _bad(where, f"must be a mapping, got {type(value).__name__}", "write it as `key: value` lines")
        unknown = sorted(set(map(str, value)) - set(spec))
        missing = sorted(set(spec) - set(map(str, value)))
        if unknown or missing:
            raise _bad(where, f"unknown keys {unknown}, missing keys {missing}",
                       f"the keys must be exactly {sorted(spec)}")
        for key, sub in spec.items():
            _check(value[key], sub, f"{where}.{key}")
        return
    if isinstance(spec, tuple):
        kind, length = spec
        if not isinstance(value, list) or not value or (length and len(value) != length):
            raise _bad(where, f"must be a non-empty list{f' of {length} values' if length else ''}, got {value!r:.60}",
                       "copy the array from the cited NCCL file")
        for i, item in enumerate(value):
            _check(item, "text" if kind == "texts" else "number", f"{where}[{i}]")
        return
    ok = {"text": isinstance(value, str) and value != "",
          "int": isinstance(value, int) and not isinstance(value, bool) and value > 0,
          "number": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and value >= 0}[spec]
    if not ok:
        kind = {"int": "positive integer", "number": "finite number >= 0", "text": "non-empty string"}[spec]
        raise _bad(where, f"must be a {kind}, got {value!r:.60}",
                   "fix the value (see the NCCL file cited beside it)")


@dataclass(frozen=True)
class Tuning:
    """The validated content of the data file.

    Attributes:
        path: the file read.
        source: the NCCL repository, release tag and files the values come from.
        release: the release-wide tables (latencies, factors, search constants).
        generations: per GPU generation ("v100", "a100", "h100"...), its rows
            of NCCL's tables and its DGX node figures.
    """

    path: str
    source: dict[str, Any]
    release: dict[str, Any]
    generations: dict[str, dict[str, Any]]


def _default_path() -> Path:
    package = Path(__file__).resolve().parent.parent
    for folder in (package / "profiles", package.parent / "profiles"):
        if (folder / DATA_FILE).is_file():
            return folder / DATA_FILE
    return package.parent / "profiles" / DATA_FILE


@lru_cache(maxsize=8)
def load_tuning(path: str | None = None) -> Tuning:
    """Read and validate NCCL's tuning constants (cached per path).

    Args:
        path: the YAML file; ``None`` reads the shipped ``profiles/nccl-tuning.yaml``.

    Returns:
        The validated tables.

    Raises:
        ColltuneValueError: the file is unreadable, not YAML, over the limits
            of :mod:`colltune.model.yamlsafe`, or a key is missing, unknown or
            of the wrong kind; the message names the file and the key.
    """
    where = str(path) if path is not None else str(_default_path())
    try:
        data = yamlsafe.load(yamlsafe.read_bytes(where).decode("utf-8"))
    except (OSError, UnicodeDecodeError, yamlsafe.YamlLimitError) as exc:
        raise _bad(where, f"cannot read NCCL's tuning constants ({exc})",
                   "pass the path of a colltune-nccl-tuning file, e.g. profiles/nccl-tuning.yaml") from None
    except yaml.YAMLError as exc:
        raise _bad(where, f"not valid YAML ({exc})", "fix the syntax at the line named") from None
    if not isinstance(data, dict) or data.get("format") != "colltune-nccl-tuning" or data.get("version") != 1:
        raise _bad(where, "`format` must be colltune-nccl-tuning and `version` 1", "is this the right file?")
    _check(data, {"format": "text", "version": "int", "source": _SOURCE, "release": _RELEASE,
                  "generations": {str(k): _GENERATION for k in data.get("generations") or {}}}, where)
    if not data["generations"]:
        raise _bad(f"{where}.generations", "no GPU generation is defined", "add one section per generation")
    for name, gen in data["generations"].items():
        if gen["cpu"] not in _CPUS:
            raise _bad(f"{where}.generations.{name}.cpu", f"must be one of {_CPUS}, got {gen['cpu']!r}",
                       "name the host CPU vendor of that system")
    return Tuning(where, data["source"], data["release"], data["generations"])


# --------------------------------------------------------------------------- the topology


_P2P_LEVELS = ("intra_node", "inter_node")
_P2P_FIGURES = ("latency_us", "bandwidth_GBps")


@dataclass(frozen=True)
class P2P:
    """Measured point-to-point figures that replace the defaults of :func:`p2p_time_us` (``None`` keeps one).

    A profile carries them as ``meta.p2p`` (see :meth:`from_meta`); ``colltune
    profile`` measures them on the user's cluster.

    Attributes:
        intra_latency_us: the fixed cost of one message to a peer on the same node, microseconds.
        intra_GBps: a rank's bandwidth to the other GPUs of its node, GB/s, shared by its messages in flight.
        inter_latency_us: the fixed cost of one message to a peer on another node, microseconds.
        inter_GBps: a rank's bandwidth to other nodes while every rank of its node sends
            across nodes at once (an all-to-all), GB/s.
    """

    intra_latency_us: float | None = None
    intra_GBps: float | None = None
    inter_latency_us: float | None = None
    inter_GBps: float | None = None

    @classmethod
    def from_meta(cls, value: Any, where: str = "meta.p2p") -> "P2P":
        """Read ``{intra_node: {latency_us, bandwidth_GBps}, inter_node: {...}}`` (every key optional).

        Raises:
            ColltuneValueError: a key is unknown or a figure is not a finite
                number (latency >= 0, bandwidth > 0); the message names the key.
        """
        figures: dict[str, float] = {}
        if not isinstance(value, dict):
            raise ColltuneValueError(f"{where}: must be a mapping of {_P2P_LEVELS}, got {value!r:.60}.",
                                     argument="p2p")
        for level, entry in value.items():
            if level not in _P2P_LEVELS or not isinstance(entry, dict) or set(map(str, entry)) - set(_P2P_FIGURES):
                raise ColltuneValueError(f"{where}.{level}: the levels are {_P2P_LEVELS}, each a mapping of "
                                         f"{_P2P_FIGURES}; got {entry!r:.60}.", argument="p2p")
            for name, number in entry.items():
                numeric = isinstance(number, (int, float)) and not isinstance(number, bool) and math.isfinite(number)
                if not numeric or not (number >= 0 if name == "latency_us" else number > 0):
                    raise ColltuneValueError(f"{where}.{level}.{name}: must be a finite number "
                                             f"{'>= 0' if name == 'latency_us' else '> 0'}, got {number!r:.60}.",
                                             argument="p2p")
                short = "latency_us" if name == "latency_us" else "GBps"
                figures[f"{level.split('_')[0]}_{short}"] = float(number)
        return cls(**figures)


@dataclass(frozen=True)
class Topology:
    """A homogeneous GPU cluster: ``nodes`` nodes of ``gpus_per_node`` GPUs, one rank per GPU.

    Attributes:
        nodes: number of nodes (>= 1).
        gpus_per_node: ranks per node (>= 1).
        gpu: GPU generation, a section of ``profiles/nccl-tuning.yaml``
            (``"v100"``, ``"a100"``, ``"h100"``).
        nic_gbps: inter-node bandwidth per GPU in Gbit/s; ``None`` takes the
            generation's DGX figure (50, 200, 400).
        intra_link: the fabric inside a node, ``"nvlink"`` (NVSwitch) or ``"pcie"``.
        cpu: host CPU vendor (``"intel"``, ``"amd"``, ``"other"``), which sets
            NCCL's per-step network overhead; ``None`` takes the generation's DGX CPU.
        nvls: the GPUs support NVLink SHARP multicast (NCCL's ``nvlsSupport``:
            CUDA 12.1 driver and fabric manager, ``NCCL_NVLS_ENABLE`` not 0).
            NCCL still uses NVLS only on NVSwitch nodes of sm90 or later with
            3 or more GPUs per node; ``False`` models ``NCCL_NVLS_ENABLE=0``.
        search: the graphs NCCL's topology search found on this cluster (what
            ``NCCL_DEBUG_SUBSYS=GRAPH`` prints); ``None`` replays the search on
            the modelled node (:func:`topology_search`).
        p2p: measured point-to-point figures that replace the defaults of
            :func:`p2p_time_us` and :func:`all_to_all_time_us`; ``None`` keeps them.

    Raises:
        ColltuneValueError: a field is out of range or unknown; the message names it.
    """

    nodes: int
    gpus_per_node: int
    gpu: str
    nic_gbps: float | None = None
    intra_link: Literal["nvlink", "pcie"] = "nvlink"
    cpu: Literal["intel", "amd", "other"] | None = None
    nvls: bool = True
    search: SearchResult | None = None
    p2p: P2P | None = None

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ColltuneValueError(f"Topology `{name}` must be an integer >= 1, got {value!r}.", argument=name)
        known = sorted(load_tuning().generations)
        if self.gpu not in known:
            raise ColltuneValueError(f"Topology `gpu` must be one of {known}, got {self.gpu!r}; add a section to "
                                     f"profiles/{DATA_FILE} for another generation.", argument="gpu")
        nic = self.nic_gbps
        if nic is not None and (isinstance(nic, bool) or not isinstance(nic, (int, float)) or not math.isfinite(nic)
                                or nic <= 0):
            raise ColltuneValueError(f"Topology `nic_gbps` must be a number > 0 (Gbit/s per GPU) or None, got "
                                     f"{nic!r}.", argument="nic_gbps")
        if self.intra_link not in _LINKS:
            raise ColltuneValueError(f"Topology `intra_link` must be one of {_LINKS}, got {self.intra_link!r}.",
                                     argument="intra_link")
        if self.cpu is not None and self.cpu not in _CPUS:
            raise ColltuneValueError(f"Topology `cpu` must be one of {_CPUS} or None, got {self.cpu!r}.",
                                     argument="cpu")
        self._check_overrides()

    def _check_overrides(self) -> None:
        for name, kind in (("nvls", bool), ("search", SearchResult), ("p2p", P2P)):
            value = getattr(self, name)
            if not isinstance(value, kind) and not (value is None and name != "nvls"):
                raise ColltuneValueError(f"Topology `{name}` must be a {kind.__name__}"
                                         f"{'' if name == 'nvls' else ' or None'}, got {value!r:.60}.", argument=name)

    @property
    def world_size(self) -> int:
        """Total number of ranks, ``nodes * gpus_per_node``."""
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class _Node:
    """The figures of one node that NCCL's search reads (GB/s as NCCL counts them)."""

    nodes: int
    gpus: int
    cc: int
    fabric_bw: float  # a GPU's bandwidth into the node's fabric: NVLink total, or its PCIe link
    nic_bw: float  # per GPU
    pcie_bw: float
    cpu: str

    @property
    def nic_path_bw(self) -> float:
        return min(self.nic_bw, self.pcie_bw)


def _node(topo: Topology) -> _Node:
    gen = load_tuning().generations[topo.gpu]
    fabric = gen["nvlink_links"] * gen["nvlink_link_bw"] if topo.intra_link == "nvlink" else gen["pcie_bw"]
    nic = (topo.nic_gbps if topo.nic_gbps is not None else gen["nic_gbps"]) / 8.0
    return _Node(topo.nodes, topo.gpus_per_node, gen["compute_capability"], fabric, nic, gen["pcie_bw"],
                 topo.cpu or gen["cpu"])


# --------------------------------------------------------------------------- the topology search


@dataclass(frozen=True)
class Graph:
    """One graph of NCCL's topology search: ``channels`` channels of ``bw_intra``/``bw_inter`` GB/s."""

    channels: int
    bw_intra: float
    bw_inter: float


@dataclass(frozen=True)
class SearchResult:
    """What NCCL's topology search finds for a topology, as modelled.

    Attributes:
        ring: the ring graph (``graphs[NCCL_ALGO_RING]``).
        tree: the tree graph (``graphs[NCCL_ALGO_TREE]``), with the ring's channel count.
        tree_is_chain: the tree graph's pattern is NCCL_TOPO_PATTERN_TREE,
            which costs Tree 15% of its bandwidth (tuning.cc line 185): with
            one GPU per node (search.cc line 897), and on sm90 across nodes,
            where the balanced tree finds no perfect graph and the search
            falls back to the simpler tree (search.cc lines 963-966).
        comm_channels: the communicator's collective channels after
            ``ncclTopoPostset`` doubles them.
        nvls: the NVLS graph (``graphs[NCCL_ALGO_NVLS]``, shared by NVLS_TREE),
            or ``None`` where NCCL finds none (no NVSwitch, before sm90, 2
            GPUs or fewer per node, or no multicast support).
    """

    ring: Graph
    tree: Graph
    tree_is_chain: bool
    comm_channels: int
    nvls: Graph | None = None


def _capacity(node: _Node, bw_inter: float, bw_intra: float) -> int:
    """Channels the node can route at these speeds: NIC and PCIe paths, and each GPU's fabric bandwidth."""
    if node.nodes == 1:
        return int(node.fabric_bw / bw_intra + _EPS)
    if bw_inter > node.nic_path_bw + _EPS:
        return 0
    channels = node.gpus * int(node.nic_path_bw / bw_inter + _EPS)
    if node.gpus > 1:
        # Each channel enters and leaves the node through the NIC of one GPU, so a
        # GPU's fabric link carries (G-1)/G of the channels, rotated over the NICs.
        channels = min(channels, int(node.fabric_bw / (bw_intra * (node.gpus - 1) / node.gpus) + _EPS))
    return channels


def _speeds(node: _Node) -> list[float]:
    search = load_tuning().release["search"]
    key = "speed_intra" if node.nodes == 1 else "speed_inter"
    return [float(s) for s in search[key + ("_sm90" if node.cc >= 90 else "")]]


def _first_speed(speeds: list[float], max_bw: float, total_bw: float, min_channels: int) -> int:
    i = 0
    while (speeds[i] > max_bw + _EPS or speeds[i] * min_channels > total_bw + _EPS) and i < len(speeds) - 1:
        i += 1
    return i


def _ring_pass1(node: _Node, speeds: list[float]) -> tuple[int, float] | None:
    """Pass 1 of ncclTopoCompute for the ring: from the fastest speed down, keep the most bandwidth."""
    search = load_tuning().release["search"]
    max_bw = node.fabric_bw if node.nodes == 1 else node.nic_path_bw
    i = _first_speed(speeds, max_bw, node.fabric_bw, 1)
    best: tuple[int, float] | None = None
    while True:
        speed = speeds[i]
        n = min(search["max_channels"], _capacity(node, speed, speed))
        copied = n >= 1 and (best is None or n * speed > best[0] * best[1] + _EPS)
        if copied:
            best = (n, speed)
        if best is not None and ((copied and n == search["max_channels"]) or best[0] * best[1] >= node.fabric_bw - _EPS):
            return best  # a perfect solution, or all the GPU's bandwidth is used
        if i < len(speeds) - 1 and (best is None or speeds[i + 1] / best[1] > search["lower_speed_min_ratio"]):
            i += 1
            continue
        return best


def _dup_channels(node: _Node, channels: int, speed: float) -> tuple[int, float]:
    """ncclTopoDupChannels: double the channels at half the speed on fast links."""
    search = load_tuning().release["search"]
    if speed < search["dup_min_bw"]:
        return channels, speed
    if node.cc > 80 and speed < search["dup_sm90_bw"] and channels > search["dup_sm90_channels"]:
        return channels, speed
    dup = min(2 * channels, search["max_channels"])
    return dup, speed / math.ceil(dup / channels)


def _search_ring(node: _Node) -> Graph:
    speeds = _speeds(node)
    search = load_tuning().release["search"]
    found = _ring_pass1(node, speeds)
    if found is None:
        return Graph(1, search["fallback_bw"], search["fallback_bw"])
    channels, speed = _dup_channels(node, *found)
    # Pass 2: the same channel count (at least) at higher speeds.
    j = next((k for k, s in enumerate(speeds) if s <= speed + _EPS), len(speeds) - 1)
    while j > 0:
        more = min(search["max_channels"], _capacity(node, speeds[j - 1], speeds[j - 1]))
        if more < channels:
            break
        channels, speed, j = more, speeds[j - 1], j - 1
    return Graph(channels, speed, speed)


def _search_tree(node: _Node, channels: int) -> Graph:
    """The tree graph, searched for exactly the ring's channel count (init.cc), then a faster intra-node speed."""
    speeds = _speeds(node)
    search = load_tuning().release["search"]
    max_bw = node.fabric_bw if node.nodes == 1 else node.nic_path_bw
    total = node.fabric_bw * node.gpus / (node.gpus - 1) if node.gpus > 1 else node.fabric_bw
    i = _first_speed(speeds, max_bw, total, channels)
    while i < len(speeds) and _capacity(node, speeds[i], speeds[i]) < channels:
        i += 1
    if i == len(speeds):
        return Graph(1, search["fallback_bw"], search["fallback_bw"])
    inter = intra = speeds[i]
    while i > 0 and intra < 2 * inter - _EPS and _capacity(node, inter, speeds[i - 1]) >= channels:
        i -= 1
        intra = speeds[i]
    return Graph(channels, intra, inter)


def _nvls_channels(node: _Node, speed: float) -> int:
    """NVLS channels that fit at ``speed`` (search.cc v2.21.5-1 ``ncclTopoSearchTryNvls``, lines 337-368).

    Each channel pulls ``speed`` from every GPU to the NVSwitch and back,
    twice from its head GPU; the heads differ, so with ``c`` channels a head
    carries ``(c + 1) * speed`` of its fabric link. Across nodes each channel
    also takes its head's NIC, one channel per NIC (lines 557, 576).
    """
    channels = min(node.gpus, int(node.fabric_bw / speed + _EPS) - 1)
    if node.nodes > 1 and speed > node.nic_path_bw + _EPS:
        return 0
    return max(0, channels)


def _search_nvls(node: _Node) -> Graph | None:
    """The NVLS graph of ncclTopoCompute (search.cc v2.21.5-1 lines 893-902, 922, 991-994, 1021-1024).

    Pass 1 goes down NCCL's speed array from the fastest speed the GPU's
    path allows and keeps the most channels (then the most ``channels *
    bwInter``), up to one per GPU; one node needs all of them. Pass 2 keeps
    ``bwIntra`` and raises ``bwInter`` while the NICs carry it and it is
    under twice ``bwIntra``. NVLS channels are never doubled (line 837).
    """
    search = load_tuning().release["search"]
    speeds = _speeds(node)
    # One node: minChannels = maxChannels = GPUs; the start speed must fit them all (line 922).
    need = node.gpus if node.nodes == 1 else 1
    max_bw = node.fabric_bw if node.nodes == 1 else node.nic_path_bw
    i = _first_speed(speeds, max_bw, node.fabric_bw * node.gpus / (node.gpus - 1), need)
    best: tuple[int, float] | None = None
    while True:
        n = _nvls_channels(node, speeds[i])
        if n >= need and (best is None or n > best[0] or n * speeds[i] > best[0] * best[1] + _EPS):
            best = (n, speeds[i])
        if best is not None and (best[0] == node.gpus or best[0] * best[1] >= node.fabric_bw - _EPS):
            break
        if i < len(speeds) - 1 and (best is None or speeds[i + 1] / best[1] > search["lower_speed_min_ratio"]):
            i += 1
            continue
        break
    if best is None:
        return None
    channels, intra = best
    inter, j = intra, speeds.index(intra)
    while j > 0 and inter < 2 * intra - _EPS and (node.nodes == 1 or speeds[j - 1] <= node.nic_path_bw + _EPS):
        j -= 1
        inter = speeds[j]
    return Graph(channels, intra, inter)


def _nvls_graph(node: _Node, topo: Topology) -> Graph | None:
    """The NVLS graph where NCCL enables NVLS, else None.

    v2.21.5-1: transport/nvls.cc ncclNvlsInit line 241 (more than 2 GPUs),
    lines 249-256 (multicast support); search.cc line 893 (an NVSwitch, sm90).
    """
    gate = load_tuning().release["nvls"]
    if (not topo.nvls or topo.intra_link != "nvlink" or node.cc < gate["min_compute_capability"]
            or node.gpus < gate["min_gpus_per_node"]):
        return None
    return _search_nvls(node)


@lru_cache(maxsize=1024)
def topology_search(topo: Topology) -> SearchResult:
    """Replay NCCL's topology search (``search.cc`` ``ncclTopoCompute``) on a model of the topology's nodes.

    The ring search starts at the fastest speed of NCCL's speed array that
    the GPU's path allows and keeps the graph with the most ``channels *
    speed``, going to slower speeds while they are above 0.49 of the best;
    it stops early when 16 channels fit or all the GPU's fabric bandwidth is
    used. Fast graphs are then doubled to twice the channels at half the
    speed, and a second pass raises the speed while the channels still fit.
    The tree is searched for the ring's channel count, then its intra-node
    speed raised up to twice the inter-node one. A channel fits when every
    GPU's fabric link (NVLink total or PCIe), every NIC and every GPU-to-NIC
    PCIe path has its speed left.

    Args:
        topo: the cluster.

    NVLS (sm90 NVSwitch nodes of 3 or more GPUs) searches up to one channel
    per GPU, each pulling from every GPU and twice from its head, across nodes
    one per NIC; then raises the inter-node speed (:func:`_search_nvls`).

    Returns:
        The ring, tree and NVLS graphs and the communicator's channel count;
        ``topo.search`` when the topology records what NCCL found.
    """
    if topo.search is not None:
        return topo.search
    node = _node(topo)
    search = load_tuning().release["search"]
    ring = _search_ring(node)
    tree = _search_tree(node, ring.channels)
    comm = min(search["max_comm_channels"], 2 * ring.channels)
    # connect.cc: sm90 multi-node fast rings are doubled once more while under 16 channels.
    if node.cc == 90 and node.nodes > 1 and ring.bw_intra > search["sm90_multi_node_dup_bw"] and comm < 16:
        comm = min(search["max_comm_channels"], 2 * comm)
    # The balanced tree needs two GPUs of the node to reach one NIC within the
    # PCIe switch (PATH_PIX); with a NIC per GPU it finds no perfect graph, and
    # on sm90 the search then keeps the simpler tree (search.cc v2.21.5-1 lines
    # 963-966); with one GPU per node the pattern is the tree (line 897).
    chain = node.gpus == 1 or (node.cc >= 90 and node.nodes > 1)
    return SearchResult(ring, tree, chain, comm, _nvls_graph(node, topo))


# --------------------------------------------------------------------------- NCCL's tuning table


def _steps(coll: str, ranks: int, nodes: int) -> tuple[int, int]:
    """``(nsteps, nInterSteps)`` of ncclTopoTuneModel."""
    if coll == "all_reduce":
        return 2 * (ranks - 1), (2 * nodes if nodes > 1 else 0)
    if coll in ("all_gather", "reduce_scatter"):
        return ranks - 1, nodes - 1
    return ranks, nodes


def _log2i(value: int) -> int:
    """NCCL's log2i: the floor of log2, 0 for 0."""
    return max(0, value.bit_length() - 1)


def _nodes_index(nodes: int) -> str:
    return "n1" if nodes == 1 else "n2" if nodes == 2 else "n4"


def _bus_bandwidth(topo: Topology, algo: str, proto: str) -> float:
    """``busBw`` of one (algorithm, protocol) pair, with NCCL's per-protocol caps and factors."""
    tuning, node, found = load_tuning(), _node(topo), topology_search(topo)
    gen, f = tuning.generations[topo.gpu], tuning.release["factors"]
    graph = found.ring if algo == "ring" else found.tree
    idx = _nodes_index(topo.nodes)
    if topo.nodes == 1:
        ll_max = gen["ll_max_bw_one_node"]
    else:
        ll_max = tuning.release["ll_max_bw_multi_node"]["amd" if node.cpu == "amd" else "intel"][idx]
    bus = graph.channels * (graph.bw_intra if topo.nodes <= 2 else graph.bw_inter)
    ppn = topo.world_size / topo.nodes
    if algo == "ring" and proto == "ll":
        bus = min(ll_max, bus * f["ring_ll"])
    if algo == "ring" and proto == "ll128":
        factor = f["ring_ll128_one_rank_per_node"] if ppn < 2 else f["ring_ll128"]
        bus = min(bus * factor, graph.channels * gen["ring_ll128_max_bw_per_channel"][idx])
    if algo == "tree":
        bus = min(bus * f["tree"], graph.channels * gen["tree_max_bw_per_channel"][idx])
    if algo == "tree" and proto == "ll":
        bus = min(bus / f["tree_ll_divisor"], ll_max)
    if algo == "tree" and proto == "ll128":
        factor = f["tree_ll128_one_node"] if topo.nodes == 1 else f["tree_ll128_multi_node"]
        bus = min(bus * factor, graph.channels * gen["tree_ll128_max_bw_per_channel"][idx])
    if algo == "tree" and found.tree_is_chain:
        bus *= f["tree_simple_pattern"]
    return float(bus)


def _latency(topo: Topology, coll: str, algo: str, proto: str) -> float:
    """``comm->latencies[coll][algo][proto]`` of ncclTopoTuneModel."""
    rel = load_tuning().release
    node = _node(topo)
    hw = rel["hw_latency_us"]
    intra_hw = "nvlink" if topo.intra_link == "nvlink" and topo.gpus_per_node > 1 else "pci"
    base = rel["base_latency_us"][algo][proto]
    intra = hw[intra_hw][algo][proto]
    inter = hw["net"][algo][proto] + rel["net_latency_us"] * (2 if proto == "simple" else 1)
    nsteps, ninter = _steps(coll, topo.world_size, topo.nodes)
    if algo == "tree":
        return float(base + 2 * ((topo.gpus_per_node - 1) * intra + _log2i(topo.nodes) * inter))
    if coll == "broadcast":
        # Rings that share their channels (sameChannels) pay one hop.
        return float(base + hw[intra_hw if topo.nodes == 1 else "net"][algo][proto])
    overhead = 0.0
    if topo.nodes > 1:
        overhead = rel["net_overhead_us"][node.cpu] * (rel["net_overhead_simple_factor"] if proto == "simple" else 1)
    return float(base + (nsteps - ninter) * max(intra, overhead) + ninter * inter)


def _nvls_pair(topo: Topology, algo: str) -> tuple[float, float]:
    """``(latency_us, algBw GB/s)`` of NVLS or NVLS_TREE with the Simple protocol (tuning.cc v2.21.5-1).

    busBw = nChannels * min(bwIntra, bwInter) for NVLS (line 175), nChannels
    * min(bwIntra, bwInter, or bwInter / 2 beyond 2 nodes) for NVLS_TREE
    (line 176), times 5/6 to algBw (line 216). Latency (lines 258-263): NVLS
    pays one NVLink hop; NVLS_TREE one NVLink hop plus 2 log2i(nNodes)
    network hops (and twice the NIC's latency on each). This release applies
    no NVLS efficiency factor and no NVLS bandwidth cap (``nvlsEfficiency``
    and ``perChMaxNVLSTreeBws`` first appear in v2.28.3-1).
    """
    rel = load_tuning().release
    nv, graph = rel["nvls"], topology_search(topo).nvls
    assert graph is not None
    if algo == "nvls":
        bw = min(graph.bw_intra, graph.bw_inter)
        latency = nv["hw_latency_us"]["nvlink"]
    else:
        bw = min(graph.bw_intra, graph.bw_inter if topo.nodes <= 2 else graph.bw_inter / 2)
        inter = nv["tree_hw_latency_us"]["net"] + 2 * rel["net_latency_us"]
        latency = nv["tree_hw_latency_us"]["nvlink"] + 2 * _log2i(topo.nodes) * inter
    return float(latency), float(graph.channels * bw * nv["bw_ratio"])


def _nvls_algorithms(topo: Topology, coll: str) -> tuple[str, ...]:
    """The NVLS algorithms NCCL enables for ``coll`` on ``topo`` (before the dtype and op check).

    NVLS runs all_reduce on one node, and all_gather and reduce_scatter on one
    node (tuning.cc lines 168-169; enqueue.cc lines 1503-1505: across nodes it
    needs CollNet, left out here); NVLS_TREE runs all_reduce across nodes
    (tuning.cc line 284 disables it on one node).
    """
    if not topo.nvls or topology_search(topo).nvls is None or coll == "broadcast":
        return ()
    if topo.nodes == 1:
        return ("nvls",)
    return ("nvls_tree",) if coll == "all_reduce" else ()


@lru_cache(maxsize=1024)
def _table(topo: Topology, coll: str) -> dict[tuple[str, str], tuple[float, float]]:
    """``(latency_us, algBw GB/s)`` of every pair NCCL enables for ``coll`` on ``topo``."""
    ll128_ok = topo.intra_link == "nvlink" or topo.gpus_per_node == 1
    nsteps, _ = _steps(coll, topo.world_size, topo.nodes)
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for algo in ALGORITHMS:
        if algo in ("nvls", "nvls_tree"):
            if algo in _nvls_algorithms(topo, coll):
                out[(algo, "simple")] = _nvls_pair(topo, algo)
            continue
        if algo == "tree" and coll != "all_reduce":
            continue
        for proto in PROTOCOLS:
            if proto == "ll128" and not ll128_ok:
                continue
            ratio = topo.world_size / nsteps if algo == "ring" else 0.5
            bw = _bus_bandwidth(topo, algo, proto) * ratio
            if bw > 0:
                out[(algo, proto)] = (_latency(topo, coll, algo, proto), bw)
    return out


# --------------------------------------------------------------------------- predictions


@dataclass(frozen=True)
class Choice:
    """NCCL's pick for one call, and why.

    Attributes:
        algorithm: ``"tree"``, ``"ring"``, ``"nvls"`` or ``"nvls_tree"``.
        protocol: ``"ll"``, ``"ll128"`` or ``"simple"``.
        latency_us: the latency term, corrections included.
        bandwidth_GBps: the algorithm bandwidth of the bytes term, GB/s
            (``time = latency + nbytes / (1000 * bandwidth)``).
        time_us: the predicted time, the smallest of the table.
    """

    algorithm: str
    protocol: str
    latency_us: float
    bandwidth_GBps: float
    time_us: float


#: The element types NCCL reduces, by the names torch gives them.
DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32", "float64")
#: The reduction operations (all_gather and broadcast always pass ``sum``).
OPS = ("sum", "prod", "max", "min", "avg")
# include/device.h ncclNvlsSupported, v2.21.5-1 lines 423-440: sum on 32- and 64-bit integers, 16-bit and
# 32/64-bit floats; min and max (ncclDevMinMax) on the integers and 16-bit floats; nothing on 8-bit types,
# prod, or avg (PreMulSum, SumPostDiv).
_NVLS_OPS = {
    "sum": frozenset({"int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32", "float64"}),
    "max": frozenset({"int32", "uint32", "int64", "uint64", "float16", "bfloat16"}),
    "min": frozenset({"int32", "uint32", "int64", "uint64", "float16", "bfloat16"}),
}


def nvls_supported(dtype: str, op: str = "sum") -> bool:
    """Return whether NCCL runs NVLS for this element type and operation (``ncclNvlsSupported``).

    NCCL checks the user's type and operation before it prices the call
    (enqueue.cc v2.21.5-1 line 773), for all_gather too (with ``sum``).
    """
    return dtype in _NVLS_OPS.get(op, frozenset())


def _check_call(coll: str, nbytes: int, topo: Topology, dtype: str = "float32", op: str = "sum") -> None:
    if coll not in COLLECTIVES:
        raise ColltuneValueError(f"`coll` must be one of {COLLECTIVES}, got {coll!r}.", argument="coll")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ColltuneValueError(f"`nbytes` must be an integer >= 0, got {nbytes!r}.", argument="nbytes")
    if not isinstance(topo, Topology):
        raise ColltuneValueError(f"`topo` must be a Topology, got {type(topo).__name__}.", argument="topo")
    if dtype not in DTYPES:
        raise ColltuneValueError(f"`dtype` must be one of {DTYPES}, got {dtype!r}.", argument="dtype")
    if op not in OPS:
        raise ColltuneValueError(f"`op` must be one of {OPS}, got {op!r}.", argument="op")


def _terms(coll: str, nbytes: int, topo: Topology, dtype: str = "float32",
           op: str = "sum") -> dict[tuple[str, str], tuple[float, float]]:
    """``(latency_us, bandwidth GB/s)`` per pair after ncclTopoGetAlgoTime's per-size corrections."""
    _check_call(coll, nbytes, topo, dtype, op)
    if topo.world_size == 1:
        return {("ring", "simple"): (0.0, math.inf)}  # NCCL runs a local copy and predicts nothing
    rel = load_tuning().release
    f = rel["factors"]
    found = topology_search(topo)
    log_size = _log2i(nbytes >> 6)
    plateau = (topo.nodes > 1 and coll == "all_reduce"
               and nbytes // (found.comm_channels * topo.world_size) >= f["ring_plateau_min_bytes"])
    cc = load_tuning().generations[topo.gpu]["compute_capability"]
    nvls_ok = nvls_supported(dtype, op if coll in ("all_reduce", "reduce_scatter") else "sum")
    out = {}
    for (algo, proto), (lat, bw) in _table(topo, coll).items():
        if algo in ("nvls", "nvls_tree") and not nvls_ok:
            continue
        if algo == "tree" and log_size < len(rel["tree_correction_factor"][proto]):
            bw *= rel["tree_correction_factor"][proto][log_size]
        if algo == "ring" and proto == "simple" and plateau:
            lat *= f["ring_plateau_volta"] if cc < 80 else f["ring_plateau"]
        out[(algo, proto)] = (lat, bw)
    return out


def predict_all(coll: str, nbytes: int, topo: Topology, *, dtype: str = "float32",
                op: str = "sum") -> dict[tuple[str, str], float]:
    """Return NCCL's predicted time of every (algorithm, protocol) pair it would consider.

    Args:
        coll: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"broadcast"``.
        nbytes: NCCL's ``nBytes``: the buffer of all_reduce and broadcast; the
            whole gathered output of all_gather and the whole input of
            reduce_scatter on one rank (per-rank share times world size).
        topo: the cluster.
        dtype: the element type (one of :data:`DTYPES`); with ``op`` it
            decides whether NCCL may use NVLS (:func:`nvls_supported`).
        op: the reduction (one of :data:`OPS`); all_gather and broadcast
            ignore it, as NCCL passes ``sum`` for them.

    Returns:
        ``{(algorithm, protocol): time_us}``; Tree only for all_reduce, LL128
        only with NVLink (or one GPU) per node, NVLS (one node: all_reduce,
        all_gather, reduce_scatter) and NVLS_TREE (all_reduce across nodes)
        only with the Simple protocol on NVSwitch nodes of sm90 or later. On
        one rank, ``{("ring", "simple"): 0.0}``.

    Raises:
        ColltuneValueError: an argument is out of range; the message names it.
    """
    return {pair: lat + nbytes / (1000.0 * bw)
            for pair, (lat, bw) in _terms(coll, nbytes, topo, dtype, op).items()}


def collective_choice(coll: str, nbytes: int, topo: Topology, *, dtype: str = "float32",
                      op: str = "sum") -> Choice:
    """Return the (algorithm, protocol) NCCL picks for one call, with its latency, bandwidth and time.

    NCCL scans Tree, Ring, NVLS, NVLS_TREE and, in each, LL then LL128 then
    Simple, and keeps the first strictly smallest time (enqueue.cc
    ``topoGetAlgoInfo``); so does this. Arguments as :func:`predict_all`.
    """
    # min() keeps the first of equal times, as NCCL's strict comparison does.
    choices = [Choice(algo, proto, lat, bw, lat + nbytes / (1000.0 * bw))
               for (algo, proto), (lat, bw) in _terms(coll, nbytes, topo, dtype, op).items()]
    return min(choices, key=lambda c: c.time_us)


def collective_time_us(coll: str, nbytes: int, topo: Topology, *, dtype: str = "float32",
                       op: str = "sum") -> float:
    """Return NCCL's predicted time of one collective in microseconds: the minimum of :func:`predict_all`.

    Args:
        coll: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"broadcast"``.
        nbytes: NCCL's ``nBytes``: for all_reduce and broadcast the bytes of
            the buffer (count x element size); for all_gather the bytes of the
            gathered output on one rank (each rank's input x world size); for
            reduce_scatter the bytes of the input on one rank (each rank's
            output x world size).
        topo: the cluster.
        dtype: the element type; NVLS needs one NCCL reduces on the switch
            (:func:`nvls_supported`).
        op: the reduction, ``"sum"`` unless the call says otherwise.

    Raises:
        ColltuneValueError: an argument is out of range; the message names it.
    """
    return collective_choice(coll, nbytes, topo, dtype=dtype, op=op).time_us


# --------------------------------------------------------------------------- point to point


#: The share of a NIC's line rate (NCCL counts Gbit/s / 8) that NCCL's send/recv reaches: NVIDIA measures
#: 48-49 GB/s per 400 Gb/s NDR NIC in alltoall_perf (https://github.com/NVIDIA/nccl-tests/issues/267) and
#: 24 GB/s per 200 Gb/s HDR NIC "on perfect setups" (https://github.com/NVIDIA/nccl-tests/issues/160):
#: 48 / 50 = 24 / 25 = 0.96.
P2P_NIC_EFFICIENCY = 0.96


def _p2p_latency(topo: Topology, link: str, rounds: int = 1) -> float:
    """One message's latency over ``link`` ("nvlink", "pci", "net"), then one more hop per further round.

    The first message costs the measured latency of the level when
    ``topo.p2p`` gives one, else NCCL's Ring/Simple base latency plus one
    hop (tuning.cc v2.21.5-1 baseLat line 57, hwLat lines 67, 71, 75); each
    further round of peers one hop.
    """
    rel = load_tuning().release
    hop = rel["hw_latency_us"][link]["ring"]["simple"] + (2 * rel["net_latency_us"] if link == "net" else 0.0)
    measured = None
    if topo.p2p is not None:
        measured = topo.p2p.inter_latency_us if link == "net" else topo.p2p.intra_latency_us
    first = measured if measured is not None else rel["base_latency_us"]["ring"]["simple"] + hop
    return float(first + (rounds - 1) * hop)


def _intra_bw(topo: Topology) -> float:
    """A GPU's bandwidth to the other GPUs of its node: measured, else the one-node ring graph's ``channels * bw``."""
    if topo.p2p is not None and topo.p2p.intra_GBps is not None:
        return topo.p2p.intra_GBps
    ring = topology_search(replace(topo, nodes=1, search=None)).ring
    return ring.channels * ring.bw_intra


def _net_bw(topo: Topology, senders: int) -> float:
    """A rank's share of the node's NICs when ``senders`` ranks of the node send across nodes at once.

    By default the node's NICs at :data:`P2P_NIC_EFFICIENCY` of their line
    rate, never more than the GPU's PCIe link; a measured figure (every rank
    sending) scales the same way, capped by the larger of it and PCIe.
    """
    node = _node(topo)
    if topo.p2p is not None and topo.p2p.inter_GBps is not None:
        measured = topo.p2p.inter_GBps
        return min(max(node.pcie_bw, measured), measured * node.gpus / senders)
    return min(node.pcie_bw, P2P_NIC_EFFICIENCY * node.gpus * node.nic_bw / senders)


def _check_count(name: str, value: int, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ColltuneValueError(f"`{name}` must be an integer {span}, got {value!r}.", argument=name)


def p2p_time_us(nbytes: int, topo: Topology, peers_in_flight: int = 1, inter_node: bool = True, *,
                senders_per_node: int | None = None) -> float:
    """Return the time of one send of ``nbytes`` while ``peers_in_flight`` such sends leave this rank at once.

    ``time = p2p latency + peers_in_flight * nbytes / (1000 * bandwidth)``:
    the sends share the rank's bandwidth and finish together. By default the
    latency is one Ring/Simple step of NCCL's table (base 8.4 us + one hop:
    14 us across nodes, 3.4 us over NVLink, 5.7 us over PCIe in v2.21.5-1).
    Bandwidth within a node is the GPU's fabric share (:func:`topology_search`
    of one node: channels x speed; 360 GB/s on a DGX H100, where NVIDIA
    measures 370, nccl-tests#212); across nodes it is ``min(PCIe, 0.96 *
    gpus_per_node * nic_gbps / 8 / senders_per_node)``: the node's NICs at the
    share of line rate NCCL reaches (:data:`P2P_NIC_EFFICIENCY`) shared by the
    ranks that send across nodes at once, never more than the GPU's PCIe
    link. ``topo.p2p`` replaces any of these with measured figures.

    Args:
        nbytes: bytes of one send (>= 0).
        topo: the cluster.
        peers_in_flight: sends this rank has in flight at once (>= 1).
        inter_node: the peer is on another node (needs ``topo.nodes >= 2``);
            otherwise on the same node (needs ``gpus_per_node >= 2``).
        senders_per_node: ranks of the node sending across nodes at once;
            ``None`` means all of them (the collective case).

    Raises:
        ColltuneValueError: an argument is out of range; the message names it.
    """
    _check_count("nbytes", nbytes, 0)
    _check_count("peers_in_flight", peers_in_flight, 1)
    if not isinstance(topo, Topology):
        raise ColltuneValueError(f"`topo` must be a Topology, got {type(topo).__name__}.", argument="topo")
    if inter_node:
        if topo.nodes < 2:
            raise ColltuneValueError("`inter_node` is True, which needs a topology of 2 or more nodes; pass "
                                     "inter_node=False for a peer on the same node.", argument="inter_node")
        senders = topo.gpus_per_node if senders_per_node is None else senders_per_node
        _check_count("senders_per_node", senders, 1, topo.gpus_per_node)
        return _p2p_latency(topo, "net") + peers_in_flight * nbytes / (1000.0 * _net_bw(topo, senders))
    if topo.gpus_per_node < 2:
        raise ColltuneValueError("`inter_node` is False, which needs gpus_per_node >= 2: with one GPU per node "
                                 "every peer is on another node.", argument="inter_node")
    link = "nvlink" if topo.intra_link == "nvlink" else "pci"
    return _p2p_latency(topo, link) + peers_in_flight * nbytes / (1000.0 * _intra_bw(topo))


def _next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _peers_at_once(topo: Topology) -> int:
    """Peers NCCL serves at once: p2p channels over channels per peer (paths.cc ncclTopoComputeP2pChannels)."""
    gen = load_tuning().generations[topo.gpu]
    channels = min(topology_search(topo).comm_channels, load_tuning().release["search"]["max_comm_channels"])
    per_peer = channels
    if topo.gpus_per_node > 1:  # a local peer: 2 per NVLink's worth of path bandwidth, 2 over PCIe
        links = int(_node(topo).fabric_bw / gen["nvlink_link_bw"] + _EPS) if topo.intra_link == "nvlink" else 1
        per_peer = min(per_peer, 2 * max(1, links))
    if topo.nodes > 1:  # a network peer: 2, halved while 2 * nRanks > 4 * p2p channels
        net = 2
        while net * topo.world_size > channels * 4 and net > 1:
            net //= 2
        per_peer = min(per_peer, net)
    return max(1, _next_pow2(channels) // _next_pow2(per_peer))


def all_to_all_time_us(nbytes_per_peer: int, topo: Topology) -> float:
    """Return the time of an all-to-all in which every rank sends ``nbytes_per_peer`` to each other rank.

    ``max(T_intra, T_inter)``, NVLink and network working in parallel, each
    ``T = baseLat + ceil(peers / W) * hop + peers * nbytes_per_peer / (1000 *
    bandwidth)`` (Ring/Simple base latency 8.4 us once, one hop per round of
    ``W`` peers: 3.4 us over NVLink, 14 us across nodes; a measured latency
    in ``topo.p2p`` replaces the first round's ``baseLat + hop``) over the
    ``gpus_per_node - 1`` peers on the node (fabric bandwidth) and the
    ``world_size - gpus_per_node`` peers on other nodes (the rank's share of
    the node's NICs when every rank sends, see :func:`p2p_time_us`). ``W`` is
    the number of peers NCCL serves at once: its p2p channels over its
    channels per peer. A self copy and zero-byte peers cost nothing extra.

    Args:
        nbytes_per_peer: bytes sent to each peer (>= 0).
        topo: the cluster.

    Raises:
        ColltuneValueError: an argument is out of range; the message names it.
    """
    _check_count("nbytes_per_peer", nbytes_per_peer, 0)
    if not isinstance(topo, Topology):
        raise ColltuneValueError(f"`topo` must be a Topology, got {type(topo).__name__}.", argument="topo")
    at_once = _peers_at_once(topo)
    times = [0.0]
    local, remote = topo.gpus_per_node - 1, topo.world_size - topo.gpus_per_node
    if local:
        link = "nvlink" if topo.intra_link == "nvlink" else "pci"
        times.append(_p2p_latency(topo, link, math.ceil(local / at_once))
                     + local * nbytes_per_peer / (1000.0 * _intra_bw(topo)))
    if remote:
        times.append(_p2p_latency(topo, "net", math.ceil(remote / at_once))
                     + remote * nbytes_per_peer / (1000.0 * _net_bw(topo, topo.gpus_per_node)))
    return max(times)
