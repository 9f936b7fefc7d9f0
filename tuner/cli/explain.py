"""``colltune explain``: what the selector would run for a call, each algorithm's predicted time, and why.

No process group is needed: the call is described by options, and every
rank is assumed to hold ``round(density * numel)`` entries whose index sets
overlap by ``overlap`` (0: disjoint, 1: identical; defined in :mod:`colltune.model.features`).

Input: options only::

    colltune explain --numel 2^20 --density 1e-2 --world-size 4 --overlap 0.5
    colltune explain --numel 1000000 --density 1e-3 --world-size 8 --overlap 0.9 \\
        --profile profiles/cpu-gloo.yaml --policy profiles/policies/example.yaml --name emb.weight
    colltune explain ... --backend nccl           # the profile shipped for NCCL clusters (DGX H100)
    colltune explain ... --backend nccl --gpu a100 --gpus-per-node 8 --nic-gbps 200
    colltune explain ... --json                   # the same as one JSON object

Output: the call's statistics, the cost model (learned or analytic, and the
profile it came from) and the policy; a table with one line per algorithm:
its predicted time, the (calibrated) alpha-beta time, the learned
correction factor and its largest term, the choice marked ``*``; then the
choice and why: the policy rule that pinned it, or the model's ranking and
the term that decided (the one that adds most to the runner-up's time over
the winner's). Example::

    call: n=1048576 rows x 1, float32, P=4, density 0.01, k_max=10486, K=41944, union 26215, overlap 0.50
    cost model: learned (cpu-gloo.yaml); policy: <default>

    algorithm     predicted     analytic correction  largest term
    --------------------------------------------------------------------------------
    dense          36.2 ms      30.1 ms      1.20x  value_all_reduce (25.4 ms)
    allgather      9.87 ms      8.02 ms      1.23x *merge (4.1 ms)
    oktopk         12.1 ms      10.9 ms      1.11x  split_p2p (4.6 ms)

    choice: allgather   (decided by: model, term oktopk.split_p2p)
    why: cost model (learned, cpu-gloo.yaml): allgather 9.87 ms < oktopk 12.1 ms < dense 36.2 ms; ...

Environment variables apply as in a run (``COLLTUNE_ALGO``, ``COLLTUNE_POLICY``).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import ClassVar

from colltune.algorithms.errors import ColltuneValueError
from colltune.cli.common import WORLD_BOUND, Command, cluster_profile, parse_n, parse_priced_ranks

__all__ = ["ExplainCommand"]


def parse_numel(text: str) -> int:
    """Parse ``1048576``, ``2^20``, ``2**20`` or ``1e6`` (:func:`colltune.cli.common.parse_n`)."""
    return parse_n(text, scientific=True)


def parse_unit(low_open: bool):  # noqa: ANN202
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number in {'(' if low_open else '['}0, 1], got {text!r}") from None
        if not ((0.0 < value) if low_open else (0.0 <= value)) or value > 1.0:
            raise argparse.ArgumentTypeError(f"must be in {'(' if low_open else '['}0, 1], got {text!r}")
        return value

    return parse


class ExplainCommand(Command):
    """``colltune explain``: each algorithm's predicted time, the choice, and why (a ``colltune.cli`` command)."""

    name: ClassVar[str] = "explain"
    help: ClassVar[str] = "show each algorithm's predicted time for a call, the selector's choice, and why"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the options of ``explain`` to ``parser``."""
        g = parser.add_argument_group("the call")
        g.add_argument("--numel", "--n", type=parse_numel, required=True, metavar="N",
                       help="dense rows n, e.g. 1048576 or 2^20")
        g.add_argument("--density", type=parse_unit(True), required=True, metavar="D",
                       help="entries per rank over n, in (0, 1]")
        g.add_argument("--world-size", "-P", type=parse_priced_ranks, required=True, metavar="P",
                       help=f"ranks, {WORLD_BOUND}")
        g.add_argument("--overlap", type=parse_unit(False), required=True, metavar="O",
                       help="index overlap between ranks, 0 (disjoint) to 1 (identical)")
        g.add_argument("--row-shape", "--row-numel", dest="row_shape", type=parse_numel, nargs="+", default=[1],
                       metavar="D", help="shape of one row, as in the other commands (embedding width; default 1); "
                       "--row-numel R is the same as --row-shape R")
        g.add_argument("--dtype", choices=("float32", "float64", "float16", "bfloat16"), default="float32")
        g.add_argument("--name", help="tensor name, for policy rules")
        s = parser.add_argument_group("the selector")
        s.add_argument("--profile", metavar="FILE",
                       help="profile (default: the policy's, else the one shipped for --backend)")
        s.add_argument("--policy", metavar="FILE", help="policy file (default: COLLTUNE_POLICY, else none)")
        s.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                       help="whose shipped profile to use without --profile (default gloo)")
        s.add_argument("--gpus-per-node", type=parse_priced_ranks, metavar="G",
                       help=f"NCCL: ranks per node, {WORLD_BOUND} (default: the profile's)")
        s.add_argument("--gpu", help="NCCL: GPU generation, v100, a100 or h100 (default: the profile's)")
        s.add_argument("--nic-gbps", type=float, metavar="X", help="NCCL: inter-node bandwidth per GPU, Gbit/s")
        s.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

    def run(self, args: argparse.Namespace) -> int:
        """Print the explanation; return 0."""
        from colltune.model.features import Features
        from colltune.offline.simulate import Workload, misfit
        from colltune.select.selector import Selector, format_explanation

        n, p = args.numel, args.world_size
        k = max(1, min(n, int(round(args.density * n))))
        refused = misfit(Workload(n, args.density, args.overlap), p)
        if refused:
            raise ColltuneValueError(f"{refused}.")
        k_sum = p * k
        union = k_sum - args.overlap * (k_sum - k)
        profile, _, changed = cluster_profile(args)
        rpn = profile.meta.get("ranks_per_node") if profile.meta.get("backend") == "nccl" else None
        features = Features.uniform(numel=n, row_numel=math.prod(args.row_shape), dtype=args.dtype, k=k, world_size=p,
                                    union=union, ranks_per_node=rpn)
        selector = Selector(policy=args.policy, profile=profile if changed else args.profile)
        explanation = selector.explain(features, name=args.name, backend=args.backend)
        if args.json:
            print(json.dumps(explanation.as_dict(), indent=1, default=str))
        else:
            print(format_explanation(explanation))
        return 0
