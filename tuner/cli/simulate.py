"""``colltune simulate``: what colltune would do on a cluster, at each world size, before you rent it.

No process group is needed. The cluster is the NCCL profile shipped for
``--backend nccl`` (DGX H100 nodes), or ``--profile FILE``, with its layout
changed by ``--gpu``, ``--gpus-per-node`` and ``--nic-gbps`` (an NCCL
profile prices its collectives with NCCL's tuning model on that layout);
a measured profile is priced by its learned model, faded into its analytic
model outside what it measured. The workload is one call: every rank holds
``round(density * numel)`` entries whose index sets overlap by
``overlap``; ``--topk`` prices top-k of a dense tensor of ``numel``
elements instead.

Input: options only::

    colltune simulate --numel 2^24 --density 1e-3 --overlap 0.5 -P 8 64 512 1024
    colltune simulate --nodes 64 --gpus-per-node 8 --gpu a100 --nic-gbps 200 --numel 1e6 --row-shape 64 --density 1e-3
    colltune simulate --topk --numel 3.4e8 --density 1e-3 -P 32 64 128 256 --gpus-per-node 1 --plot bert.png
    colltune simulate ... --json

Output: per world size, the nodes and ranks per node priced, each
algorithm's predicted time and the bytes one rank sends per call (it
receives as much), and the cost model's choice (policies and hysteresis are
not applied). On an NCCL profile every world size fills whole nodes of equal
size, or the command refuses it; a world size where the overlap cannot fit
in the rows is listed as not priced. ``--plot FILE`` draws time and bytes
against P and the decision map over density and P (PNG); ``--json`` prints
one object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import ClassVar

from colltune.cli.common import MAX_WORLD_SIZE, WORLD_BOUND, Command, UsageError, cluster_profile, parse_priced_ranks
from colltune.cli.explain import parse_numel, parse_unit

__all__ = ["SimulateCommand"]

#: World sizes simulated without ``--world-size`` or ``--nodes`` on a profile without nodes (gloo).
DEFAULT_WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
#: Nodes simulated without ``--world-size`` or ``--nodes`` on an NCCL profile: 1 to 128 full nodes.
DEFAULT_NODES = (1, 2, 4, 8, 16, 32, 64, 128)


class SimulateCommand(Command):
    """``colltune simulate``: each algorithm's predicted time and bytes per world size, and the choice."""

    name: ClassVar[str] = "simulate"
    help: ClassVar[str] = "predict each algorithm's time and bytes on a cluster, per world size, and the choice"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the options of ``simulate`` to ``parser``."""
        w = parser.add_argument_group("the call")
        w.add_argument("--numel", "--n", type=parse_numel, required=True, metavar="N", help="dense rows n, e.g. 2^24")
        w.add_argument("--density", type=parse_unit(True), required=True, metavar="D",
                       help="entries per rank over n, in (0, 1] (top-k: k / n)")
        w.add_argument("--overlap", type=parse_unit(False), default=0.0, metavar="O",
                       help="index overlap between ranks, 0 (disjoint, default) to 1 (identical)")
        w.add_argument("--row-shape", "--row-numel", dest="row_shape", type=parse_numel, nargs="+", default=[1],
                       metavar="D", help="shape of one row, as in the other commands (embedding width; default 1); "
                       "--row-numel R is the same as --row-shape R")
        w.add_argument("--dtype", choices=("float32", "float64", "float16", "bfloat16"), default="float32")
        w.add_argument("--topk", action="store_true", help="top-k of a dense tensor of n elements (TopkA, Ok-Topk)")
        c = parser.add_argument_group("the cluster")
        c.add_argument("--world-size", "-P", type=parse_priced_ranks, nargs="+", metavar="P",
                       help=f"world sizes, each >= 2 and {WORLD_BOUND}; on an NCCL profile each a whole number of "
                       "nodes of --gpus-per-node ranks (default: 1 to 128 full nodes; "
                       f"{' '.join(map(str, DEFAULT_WORLD_SIZES))} on a gloo profile)")
        c.add_argument("--nodes", type=parse_priced_ranks, metavar="N",
                       help=f"one world size: N x --gpus-per-node, the product {WORLD_BOUND}")
        c.add_argument("--gpus-per-node", type=parse_priced_ranks, metavar="G",
                       help=f"ranks per node, {WORLD_BOUND} (default: the profile's)")
        c.add_argument("--gpu", help="GPU generation of an NCCL profile: v100, a100, h100 (default: the profile's)")
        c.add_argument("--nic-gbps", type=float, metavar="X", help="inter-node bandwidth per GPU, Gbit/s")
        c.add_argument("--profile", metavar="FILE", help="profile (default: the one shipped for --backend)")
        c.add_argument("--backend", choices=("gloo", "nccl"), default="nccl", help="whose shipped profile (default nccl)")
        o = parser.add_argument_group("output")
        o.add_argument("--plot", metavar="FILE", help="draw times, bytes and the decision map (PNG)")
        o.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

    def run(self, args: argparse.Namespace) -> int:
        """Print the simulation (and draw it); return 0."""
        from colltune.offline.simulate import MAP_DENSITIES, Workload, decision_map, format_points, plot, simulate
        from colltune.select.selector import model_for_profile

        profile, label, _ = cluster_profile(args)
        rpn = profile.meta.get("ranks_per_node") if profile.meta.get("backend") == "nccl" else None
        sizes = _world_sizes(args, rpn)
        workload = Workload(args.numel, args.density, args.overlap, 1 if args.topk else math.prod(args.row_shape), args.dtype,
                            "topk" if args.topk else "exact")
        model = model_for_profile(profile, label)
        label = f"{model.kind} ({label})"
        points = simulate(model, workload, sizes, ranks_per_node=rpn)
        if args.json:
            print(json.dumps({"workload": dataclasses.asdict(workload), "cost_model": label,
                              "points": [pt.as_dict() for pt in points]}, indent=1))
        else:
            print(format_points(points, workload, label))
        if args.plot:
            choices = decision_map(model, workload, sizes, MAP_DENSITIES, ranks_per_node=rpn)
            plot(points, args.plot, workload, label, choices)
            if not args.json:
                print(f"wrote {args.plot}")
        return 0


def _world_sizes(args: argparse.Namespace, rpn: int | None) -> list[int]:
    if args.nodes is not None:
        if args.world_size:
            raise UsageError("give either --nodes (with --gpus-per-node) or --world-size, not both")
        p = args.nodes * (rpn or 1)
        if p > MAX_WORLD_SIZE:
            per_node = f"--gpus-per-node {args.gpus_per_node}" if args.gpus_per_node else f"{rpn} ranks per node"
            raise UsageError(f"--nodes {args.nodes} x {per_node} is {p} ranks, but the world size must be "
                             f"{WORLD_BOUND}; lower --nodes to at most {MAX_WORLD_SIZE // (rpn or 1)}")
        return [p]
    sizes = sorted(set(args.world_size or _default_sizes(rpn)))
    if sizes[0] < 2:
        raise UsageError(f"--world-size must be at least 2, got {sizes[0]}")
    return sizes


def _default_sizes(rpn: int | None) -> list[int]:
    """The world sizes priced without ``--world-size``: full nodes of an NCCL profile, else :data:`DEFAULT_WORLD_SIZES`."""
    if rpn is None:
        return list(DEFAULT_WORLD_SIZES)
    return [n * rpn for n in DEFAULT_NODES if 2 <= n * rpn <= MAX_WORLD_SIZE]
