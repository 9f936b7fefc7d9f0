"""Point-to-point figures of the cluster a profile is made on: latency and bandwidth, within and across nodes.

The NCCL model prices point-to-point steps and all-to-all from defaults
(NCCL's per-step latency, the node's NVLink fabric, 96% of the NICs' line
rate; :mod:`colltune.model.nccl`); a profile's ``meta.p2p`` replaces them
with these figures (:class:`colltune.model.nccl.P2P`). :func:`measure_p2p`
runs on every rank of a process group at once and returns, on every rank::

    {"intra_node": {"latency_us": ..., "bandwidth_GBps": ...},   # ranks of one node
     "inter_node": {"latency_us": ..., "bandwidth_GBps": ...}}   # only when the group spans 2+ nodes

How each figure is taken (ranks pair up; a rank left without a partner
waits at the barriers):

- **latency**: a ping-pong of one small message (:data:`SMALL_BYTES`)
  between partners, :data:`PING_REPS` round trips after
  :data:`WARMUP` untimed ones; half a round trip is one message.
- **bandwidth**: every paired rank sends :data:`LARGE_BYTES` to its
  partner and receives as much at the same time, :data:`STREAM_REPS`
  times; bytes sent over the time. Across nodes every rank of a node
  sends across at once, as an all-to-all loads the NICs, which is what
  the model's ``inter_node`` figure means.

Partners within a node: its ranks in order, two by two. Across nodes:
nodes two by two, and within a pair of nodes the ranks of the same local
index. Each figure is the median over the pairs measured (the same on
every rank: the ranks' figures are all-gathered).
"""

from __future__ import annotations

import hashlib
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from colltune.algorithms.sparse import upload
from colltune.offline.bench import sync_device

__all__ = ["measure_p2p", "measure_into_profile", "partners", "SMALL_BYTES", "LARGE_BYTES", "PING_REPS", "STREAM_REPS", "WARMUP"]

#: The latency's message: 8 bytes.
SMALL_BYTES = 8
#: The bandwidth's message: 64 MiB on a GPU, where smaller ones do not reach the links' rate; 8 MiB on
#: CPU ranks (gloo over TCP saturates well below it).
LARGE_BYTES = {"cuda": 64 << 20, "cpu": 8 << 20}
#: Timed round trips of the latency's ping-pong.
PING_REPS = 50
#: Timed transfers of the bandwidth's stream.
STREAM_REPS = 5
#: Untimed round trips or transfers before each measurement (connections, buffers, NCCL's channels).
WARMUP = 3


def partners(nodes: list[int], rank: int) -> tuple[int | None, int | None]:
    """Return ``rank``'s partner within its node and across nodes (``None``: it has none).

    Args:
        nodes: each rank's node id, in rank order (ranks with equal ids share a node).
        rank: this rank.
    """
    order = list(dict.fromkeys(nodes))  # node ids in order of their first rank
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    mine = members[nodes[rank]]
    i = mine.index(rank)
    intra = mine[i ^ 1] if (i ^ 1) < len(mine) else None
    j = order.index(nodes[rank])
    other = order[j ^ 1] if (j ^ 1) < len(order) else None
    inter = members[other][i] if other is not None and i < len(members[other]) else None
    return intra, inter


def _node_ids(group: Any, device: torch.device) -> list[int]:
    """Every rank's node id: a digest of its host name, all-gathered."""
    digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=8).digest()
    mine = upload([int.from_bytes(digest, "big", signed=True)], device)
    out = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    return [int(x) for x in out.tolist()]


def _timed(step: Any, reps: int, device: torch.device) -> float:
    """Seconds that ``reps`` runs of ``step`` take, after :data:`WARMUP` untimed ones (the device drained around)."""
    for _ in range(WARMUP):
        step()
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    sync_device(device)
    return time.perf_counter() - t0


def _ping(peer: int | None, lead: bool, device: torch.device, group: Any) -> float | None:
    """One message's latency to ``peer`` in microseconds (half a round trip), or ``None`` without a peer."""
    if peer is None:
        return None
    buf = torch.zeros(SMALL_BYTES, dtype=torch.uint8, device=device)
    gpeer = dist.get_global_rank(group, peer) if group is not None else peer

    def round_trip() -> None:
        if lead:
            dist.send(buf, gpeer, group=group)
            dist.recv(buf, gpeer, group=group)
        else:
            dist.recv(buf, gpeer, group=group)
            dist.send(buf, gpeer, group=group)

    return _timed(round_trip, PING_REPS, device) / (2 * PING_REPS) * 1e6


def _stream(peer: int | None, nbytes: int, device: torch.device, group: Any) -> float | None:
    """GB/s this rank sends to ``peer`` while receiving as much from it, or ``None`` without a peer."""
    if peer is None:
        return None
    out = torch.ones(nbytes, dtype=torch.uint8, device=device)
    into = torch.empty(nbytes, dtype=torch.uint8, device=device)
    gpeer = dist.get_global_rank(group, peer) if group is not None else peer

    def transfer() -> None:
        ops = [dist.P2POp(dist.isend, out, gpeer, group), dist.P2POp(dist.irecv, into, gpeer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return nbytes * STREAM_REPS / _timed(transfer, STREAM_REPS, device) / 1e9


def _median_over_ranks(value: float | None, device: torch.device, group: Any) -> float | None:
    """The median of the ranks' figures (``None`` ones left out), the same on every rank."""
    mine = upload([-1.0 if value is None else value], device, torch.float64)
    out = torch.empty(dist.get_world_size(group), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    got = [x for x in out.tolist() if x >= 0]
    return statistics.median(got) if got else None


def measure_p2p(group: Any = None, device: torch.device | None = None,
                large_bytes: int | None = None) -> dict[str, dict[str, float]]:
    """Measure point-to-point latency and bandwidth within and across nodes; every rank of ``group`` must call it.

    Args:
        group: the process group (``None``: the default group).
        device: where the messages live (default: the current CUDA device on
            NCCL, else the CPU).
        large_bytes: the bandwidth's message (default :data:`LARGE_BYTES` for the device).

    Returns:
        ``meta.p2p`` of a profile (see the module docstring): ``intra_node``
        when some node holds 2 or more ranks, ``inter_node`` when the group
        spans 2 or more nodes; the same on every rank.
    """
    if device is None:
        nccl = "nccl" in str(dist.get_backend(group)).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    nbytes = large_bytes or LARGE_BYTES["cuda" if device.type == "cuda" else "cpu"]
    rank = dist.get_rank(group)
    intra, inter = partners(_node_ids(group, device), rank)
    out: dict[str, dict[str, float]] = {}
    for level, peer in (("intra_node", intra), ("inter_node", inter)):
        dist.barrier(group=group)
        lat = _median_over_ranks(_ping(peer, peer is not None and rank < peer, device, group), device, group)
        dist.barrier(group=group)
        bw = _median_over_ranks(_stream(peer, nbytes, device, group), device, group)
        if lat is not None and bw is not None:
            out[level] = {"latency_us": round(lat, 2), "bandwidth_GBps": round(bw, 3)}
    return out


def _p2p_rank(rank: int, world_size: int, large_bytes: int | None) -> dict[str, dict[str, float]]:
    return measure_p2p(large_bytes=large_bytes)


def measure_into_profile(path: str, world_size: int, backend: str = "gloo", large_bytes: int | None = None,
                         timeout: float = 600.0, profile: Any = None) -> dict[str, dict[str, float]] | None:
    """Measure the point-to-point figures and write them into the profile at ``path`` as ``meta.p2p``.

    Locally on ``world_size`` fresh ranks of ``backend``; under ``torchrun``
    on the running ranks (every rank calls this; rank 0 writes). ``profile``
    is the one ``path`` holds when the caller has it in memory (else it is
    read). Returns the figures on the rank that wrote them, else ``None``.
    """
    from colltune.model.profile import load_profile, save_profile
    from colltune.offline import launch

    if launch.in_torchrun():
        figures = launch.run_here(_p2p_rank, large_bytes, backend=backend)
        if launch.torchrun_rank()[0] != 0:
            return None
    else:
        figures = launch.run_local(_p2p_rank, world_size, large_bytes, backend=backend, timeout=timeout)[0]
    profile = profile if profile is not None else load_profile(path)
    profile.meta["p2p"] = figures
    save_profile(profile, path)
    return figures
