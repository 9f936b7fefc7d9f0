"""What colltune would do on a cluster you do not have yet (``colltune simulate``).

Given a cluster (an NCCL profile and its layout: GPU generation, GPUs per
node, network bandwidth; or a measured profile) and a workload (rows,
row shape, dtype, density, overlap, exact or top-k), :func:`simulate`
prices each algorithm at each world size with the profile's cost model, as
the selector does, and reports per world size the predicted times, the
bytes each rank sends (and receives: every schedule here is symmetric, so
a rank receives what it sends), the cost model's choice and why. A learned
model asked outside what it measured fades into the analytic model, and the
reason says so (:class:`colltune.model.cost_model.Domain`).

The choice is the cost model's argmin: a policy's pins and the selector's
hysteresis (``margin``) are not applied.

Example:
    >>> from colltune.offline.simulate import Workload, simulate
    >>> rows = simulate(model, Workload(numel=2**24, density=1e-2), [8, 64, 1024], ranks_per_node=8)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from colltune.algorithms.errors import ColltuneValueError
from colltune.model.cost_model import AnalyticModel, CostModel, even_layout
from colltune.model.features import Features, features_by_algorithm, least_overlap, topk_features
from colltune.model.files import atomic_path

__all__ = ["SelectorModel", "Workload", "Point", "misfit", "check_layout", "simulate", "decision_map", "format_points",
           "plot", "MAP_DENSITIES"]


class SelectorModel(CostModel, Protocol):
    """A profile's cost model as the selector sees it (:func:`colltune.select.selector.model_for_profile`).

    Attributes:
        analytic: the analytic model whose schedules count the bytes each algorithm sends.
    """

    analytic: AnalyticModel

    def extrapolation(self, f: Features) -> str | None:
        """Return why the learned model is not (fully) trusted for ``f``, or ``None``."""
        ...


@dataclass(frozen=True)
class Workload:
    """One call to simulate.

    Attributes:
        numel: rows ``n`` (the first dimension; the whole tensor's elements in top-k mode).
        row_numel: elements per row (1 for scalars; top-k mode has 1).
        dtype: value dtype name.
        density: entries per rank over ``n`` (top-k: ``k / numel``).
        overlap: index overlap between ranks, 0 (disjoint) to 1 (identical).
        mode: ``exact`` (sparse allreduce) or ``topk`` (top-k of a dense tensor).
    """

    numel: int
    density: float
    overlap: float = 0.0
    row_numel: int = 1
    dtype: str = "float32"
    mode: str = "exact"

    def k(self) -> int:
        """Entries per rank."""
        return max(1, min(self.numel, round(self.density * self.numel)))


@dataclass
class Point:
    """The simulation at one world size.

    Attributes:
        world_size, nodes, ranks_per_node: the layout priced.
        predicted_us: predicted time per algorithm.
        bytes_sent: bytes one rank sends per algorithm (and receives).
        choice: the algorithm with the smallest predicted time.
        note: why the model is not fully trusted there (extrapolation), or ``""``.
        refused: why this world size is not priced (the overlap cannot fit), or ``""``.
    """

    world_size: int
    nodes: int | None
    ranks_per_node: int | None
    predicted_us: dict[str, float] = field(default_factory=dict)
    bytes_sent: dict[str, float] = field(default_factory=dict)
    choice: str = ""
    note: str = ""
    refused: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Return the point as JSON-ready plain data."""
        return {"world_size": self.world_size, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "predicted_us": dict(self.predicted_us), "bytes_sent": dict(self.bytes_sent),
                "bytes_received": dict(self.bytes_sent), "choice": self.choice, "note": self.note,
                "refused": self.refused}


def _features(w: Workload, p: int, rpn: int | None) -> tuple[dict[str, Features], Features]:
    """Return the features each registered algorithm is priced on, as the selector builds them for this kind of
    call, and the features of the ranks' entries (what the call's extrapolation warning is about)."""
    k = w.k()
    if w.mode == "topk":
        sparse, dense = topk_features(w.numel, k, p, w.overlap, w.dtype, rpn)
        return features_by_algorithm(sparse, dense), sparse
    union = p * k - w.overlap * (p * k - k)
    sparse = Features.uniform(numel=w.numel, row_numel=w.row_numel, dtype=w.dtype, k=k, world_size=p,
                              union=union, ranks_per_node=rpn, mode=w.mode)
    return features_by_algorithm(sparse), sparse


def misfit(workload: Workload, world_size: int) -> str:
    """Why ``workload`` cannot be priced at ``world_size`` as asked, or ``""``.

    In exact mode each rank's ``k`` distinct entries must fit in ``numel``
    rows with no more overlap than asked; ``colltune explain`` refuses the
    same call with the same words.
    """
    w, k = workload, workload.k()
    least = least_overlap(w.numel, k, world_size)
    if w.mode != "exact" or least <= w.overlap + 1e-9:
        return ""
    return (f"--overlap {w.overlap:g} does not fit: {world_size} ranks with {k} entries each over n={w.numel} rows "
            f"overlap by at least {least:.3f}; raise --overlap or --numel, or lower --density")


def check_layout(world_sizes: Sequence[int], ranks_per_node: int | None) -> None:
    """Refuse world sizes that do not spread evenly over nodes of ``ranks_per_node`` ranks.

    NCCL's model prices nodes that hold as many ranks each
    (:func:`colltune.model.cost_model.even_layout`), so an uneven world size
    would be priced as a larger one.

    Raises:
        ColltuneValueError: naming the first such world size and the nearest even ones.
    """
    if ranks_per_node is None:
        return
    uneven = [p for p in world_sizes if math.prod(even_layout(p, ranks_per_node)) != p]
    if uneven:
        p = uneven[0]
        nodes, per_node = even_layout(p, ranks_per_node)
        raise ColltuneValueError(
            f"{p} ranks do not spread evenly over nodes of at most {ranks_per_node} ranks: NCCL's model prices "
            f"nodes that hold as many ranks each, so it would price {nodes} x {per_node} = {nodes * per_node} "
            "ranks. Ask for a whole number of nodes "
            f"({ranks_per_node * (p // ranks_per_node) or ranks_per_node} or {nodes * ranks_per_node} ranks), or set "
            "--gpus-per-node to a divisor of it.")


def simulate(model: SelectorModel, workload: Workload, world_sizes: Sequence[int], *,
             ranks_per_node: int | None = None) -> list[Point]:
    """Price ``workload`` at each world size with ``model`` (the selector's view of a profile).

    Args:
        model: what :func:`colltune.select.selector.model_for_profile` returns.
        workload: the call.
        world_sizes: the world sizes to price, each >= 2.
        ranks_per_node: ranks per node (``None``: the profile's layout).

    Returns:
        One :class:`Point` per world size, in the order given, each with the
        nodes and ranks per node it was priced on. A world size where the
        overlap cannot fit is not priced: its point has no predictions, and
        its ``refused`` says why (:func:`misfit`).

    Raises:
        ColltuneValueError: an uneven layout (:func:`check_layout`), or the
            overlap fits at none of the world sizes.
    """
    check_layout(world_sizes, ranks_per_node)
    reasons = {p: misfit(workload, p) for p in world_sizes}
    if world_sizes and all(reasons.values()):
        raise ColltuneValueError(f"{reasons[world_sizes[0]]}.")
    points = []
    for p in world_sizes:
        rpn = None if ranks_per_node is None else min(ranks_per_node, p)
        nodes, per_node = (None, None) if rpn is None else even_layout(p, rpn)
        if reasons[p]:
            points.append(Point(p, nodes, per_node, refused=reasons[p]))
            continue
        feats, entries = _features(workload, p, rpn)
        distinct = {id(f): f for f in feats.values()}  # exact calls price every algorithm on one set of features
        preds = {i: model.predict_times(f) for i, f in distinct.items()}
        steps = {i: model.analytic.schedule(f) for i, f in distinct.items()}
        priced = {a: f for a, f in feats.items() if a in preds[id(f)]}  # an algorithm without a schedule: unpriced
        pred = {a: preds[id(f)][a] for a, f in priced.items()}
        sent = {a: math.fsum(s.nbytes for s in steps[id(f)].get(a, ()) if s.primitive != "local")
                for a, f in priced.items()}
        points.append(Point(p, nodes, per_node, pred, sent, min(pred, key=lambda a: (pred[a], list(pred).index(a))),
                            model.extrapolation(entries) or ""))
    return points


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _time(us: float) -> str:
    return f"{us / 1e3:.3g} ms" if us >= 1e3 else f"{us:.3g} us"


def format_points(points: Sequence[Point], workload: Workload, label: str) -> str:
    """Return the simulation as a table: per world size each algorithm's time and bytes, and the choice."""
    priced = [pt for pt in points if not pt.refused]
    algs = list(priced[0].predicted_us) if priced else []
    w = workload
    head = (f"{w.mode} call: n={w.numel} rows x {w.row_numel}, {w.dtype}, density {w.density:g} "
            f"(k={w.k()} per rank), overlap {w.overlap:g}; cost model: {label}")
    width = max([12] + [len(a) + 7 for a in algs])
    cols = "".join(f"{a + ' time':>{width}}{a + ' sent':>{width}}" for a in algs)
    # P and the nodes widen past 5 and 6 digits (a million ranks and more), so their columns never touch.
    wp = max([6] + [len(str(pt.world_size)) + 1 for pt in points])
    wn = max([7] + [len(str(pt.nodes)) + 1 for pt in points])
    lines = [head, "", f"{'P':>{wp}}{'nodes':>{wn}}{'per node':>9}{cols}  choice",
             "-" * (wp + wn + 11 + 2 * width * len(algs) + 10)]
    for pt in points:
        nodes = "-" if pt.nodes is None else str(pt.nodes)
        rpn = "-" if pt.ranks_per_node is None else str(pt.ranks_per_node)
        if pt.refused:
            lines.append(f"{pt.world_size:>{wp}}{nodes:>{wn}}{rpn:>9}  not priced: {pt.refused}")
            continue
        cells = "".join(f"{_time(pt.predicted_us[a]):>{width}}{_size(pt.bytes_sent[a]):>{width}}" for a in algs)
        lines.append(f"{pt.world_size:>{wp}}{nodes:>{wn}}{rpn:>9}{cells}  {pt.choice}"
                     + (f"  ({pt.note})" if pt.note else ""))
    lines.append("")
    lines.append("sent: bytes one rank puts on the wire per call (it receives as much: the schedules are symmetric).")
    return "\n".join(lines)


#: Densities of the decision map, per decade from 1e-5 to 1.
MAP_DENSITIES: tuple[float, ...] = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


def decision_map(model: SelectorModel, workload: Workload, world_sizes: Sequence[int], densities: Sequence[float], *,
                 ranks_per_node: int | None = None) -> list[list[str]]:
    """Return the choice at each density (rows) and world size (columns), the rest of ``workload`` fixed.

    A cell where the overlap cannot fit holds ``""`` (drawn grey).
    """
    out = []
    for d in densities:
        w = Workload(workload.numel, d, workload.overlap, workload.row_numel, workload.dtype, workload.mode)
        fits = [p for p in world_sizes if not misfit(w, p)]
        chosen = {pt.world_size: pt.choice for pt in simulate(model, w, fits, ranks_per_node=ranks_per_node)}
        out.append([chosen.get(p, "") for p in world_sizes])
    return out


def plot(points: Sequence[Point], path: str, workload: Workload, label: str,
         choices: Sequence[Sequence[str]] | None = None, densities: Sequence[float] = MAP_DENSITIES) -> None:
    """Draw time and bytes sent against world size per algorithm (log-log, the choice circled) and the decision map.

    ``choices`` is :func:`decision_map` over ``densities`` and the points'
    world sizes; without it the map is left out.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from colltune.offline.report import COLORS

    columns = [pt.world_size for pt in points]  # the map's: every world size asked
    points = [pt for pt in points if not pt.refused]
    ps = [pt.world_size for pt in points]
    fig, axes = plt.subplots(1, 3 if choices else 2, figsize=(16 if choices else 11, 4.8), layout="constrained")
    ax_t, ax_b = axes[0], axes[1]
    if choices:
        _draw_choices(axes[2], choices, columns, densities, COLORS)
    for a in (points[0].predicted_us if points else ()):
        color = COLORS.get(a)
        ax_t.plot(ps, [pt.predicted_us[a] / 1e3 for pt in points], marker="o", ms=3, label=a, color=color)
        ax_b.plot(ps, [max(pt.bytes_sent[a], 1.0) for pt in points], marker="o", ms=3, label=a, color=color)
        chosen = [(pt.world_size, pt.predicted_us[a] / 1e3) for pt in points if pt.choice == a]
        if chosen:
            ax_t.scatter(*zip(*chosen), s=70, facecolors="none", edgecolors=color, linewidths=1.5)
    for ax, ylabel in ((ax_t, "predicted time (ms); circled: the choice"), (ax_b, "bytes sent per rank per call")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size P")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    w = workload
    fig.suptitle(f"{w.mode}: n={w.numel} x {w.row_numel} {w.dtype}, density {w.density:g}, overlap {w.overlap:g} "
                 f"({label})", fontsize=10)
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def _draw_choices(ax: Any, choices: Sequence[Sequence[str]], ps: Sequence[int], densities: Sequence[float],
                  colors: dict[str, str]) -> None:
    """Draw the decision map: one cell per (world size, density), coloured by the choice."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    names = list(colors)
    grid = [[names.index(c) if c in names else len(names) for c in row] for row in choices]
    ax.imshow(grid, cmap=ListedColormap([colors[a] for a in names] + ["#999999"]), vmin=0, vmax=len(names),
              aspect="auto", origin="lower")
    ax.set_xticks(range(len(ps)))
    ax.set_xticklabels([str(p) for p in ps], rotation=60, fontsize=8)
    ax.set_yticks(range(len(densities)))
    ax.set_yticklabels([f"{d:g}" for d in densities], fontsize=8)
    ax.set_xlabel("world size P")
    ax.set_ylabel("density")
    ax.set_title("the cost model's choice", fontsize=9)
    ax.legend(handles=[Patch(color=colors[a], label=a) for a in names], fontsize=8, loc="upper left",
              bbox_to_anchor=(1.0, 1.0), frameon=False)
