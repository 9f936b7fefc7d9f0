"""Draw a profile: decision maps, predicted versus measured times, and a markdown summary (``colltune report``).

Files written to the output directory:

``decision-density-world.png``
    The algorithm the profile's cost model picks over density (x, log) and
    world size (y), at one ``n``, overlap and dtype; each cell shows the
    predicted speedup of that choice over dense allreduce. World sizes the
    profile measured are marked with ``*`` (others are extrapolated).
``decision-density-overlap.png``
    The same over density and overlap, one panel per measured world size
    (three to a row).
``predicted-vs-measured.png``
    Cross-validated predictions (each configuration predicted by a model
    fitted without it: ``GroupKFold`` over configurations) against the
    measured times (``time_us``: the median of the rounds, or the statistic
    the profile's ``meta.statistic`` names), one panel per algorithm,
    log-log, with the diagonal.
``summary.md``
    Metadata, the primitives, the cross-validated error per algorithm, the
    selection regret, the measured winners against the predicted ones, the
    configurations with the largest regret, and the pictures.

Plots use matplotlib's Agg backend (no display needed) and constrained
layout; long titles wrap to the figure's width, and log axes carry a few
round, plainly written ticks, so nothing clips or overprints whatever the
number of world sizes or the range of the times.

Example:
    >>> from colltune.offline.report import write_report
    >>> files = write_report("profiles/local.yaml", "report/")  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import math
import os
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np

from colltune.algorithms import registry
from colltune.model.files import atomic_path, write_text_atomic
from colltune.model.profile import Profile, load_profile

if TYPE_CHECKING:  # the cost models are imported when a report is drawn
    from colltune.model.cost_model import CostModel

__all__ = ["COLORS", "model_of", "decision_grid", "write_report", "pyplot", "save_figure", "log_axes"]

#: The colours of the algorithms, in registry order: the built-ins keep theirs in every picture.
PALETTE: tuple[str, ...] = (
    "#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD",
)


def _algs() -> tuple[str, ...]:
    """The algorithms a report shows: every registered one, in registry order."""
    return registry.names()


class _Colors(Mapping[str, str]):
    """One colour per registered algorithm (:data:`PALETTE` by registry position), the same in every picture."""

    def __getitem__(self, name: str) -> str:
        names = registry.names()
        if name not in names:
            raise KeyError(name)
        return PALETTE[names.index(name) % len(PALETTE)]

    def __iter__(self) -> Iterator[str]:
        return iter(registry.names())

    def __len__(self) -> int:
        return len(registry.names())


#: ``COLORS[name]``: the colour of a registered algorithm.
COLORS: Mapping[str, str] = _Colors()


def model_of(profile: Profile) -> tuple[CostModel, str]:
    """Return the profile's cost model (:func:`colltune.model.cost_model.model_for_profile`) and a label."""
    from colltune.model.cost_model import model_for_profile

    model, source = model_for_profile(profile)
    return model, {"stored": "learned (stored)", "fitted": "learned (fitted now)",
                   "analytic": "alpha-beta (primitives only)"}[source]


def _predict(model: CostModel, feats: Sequence[Any]) -> np.ndarray:
    """Return predicted times (us), shape ``(len(feats), len(_algs()))`` in :func:`_algs` order.

    An algorithm the model does not price (never fitted, no schedule) is predicted ``inf``.
    """
    from colltune.model.cost_model import predict_matrix

    return predict_matrix(model, feats, _algs())


def _features(n: int, density: float, p: int, overlap: float, dtype: str) -> Any:
    from colltune.model.features import Features
    from colltune.offline.workloads import k_for_density, shared_count

    k = k_for_density(n, density)
    s = k if p == 1 else shared_count(n, k, p, overlap)
    u = s + p * (k - s)
    return Features.build(numel=n, row_numel=1, dtype=dtype, k_per_rank=[k] * p, union=float(u))


def decision_grid(model: CostModel, xs: Sequence[float], ys: Sequence[Any], make: Any) -> tuple[np.ndarray, np.ndarray]:
    """Return the chosen algorithm index and its predicted speedup over dense for each ``make(x, y)`` call.

    Returns:
        ``(choice, speedup)``, both shaped ``(len(ys), len(xs))``.
    """
    feats = [make(x, y) for y in ys for x in xs]
    t = _predict(model, feats)
    choice = np.argmin(t, axis=1)
    speed = t[:, 0] / t[np.arange(len(feats)), choice]
    return choice.reshape(len(ys), len(xs)), speed.reshape(len(ys), len(xs))


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _draw_map(ax: Any, choice: np.ndarray, speed: np.ndarray, xs: Sequence[float], ylabels: Sequence[str]) -> None:
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap([COLORS[a] for a in _algs()])
    ax.imshow(choice, cmap=cmap, vmin=-0.5, vmax=len(_algs()) - 0.5, aspect="auto", origin="lower")
    for i in range(choice.shape[0]):
        for j in range(choice.shape[1]):
            s = speed[i, j]
            txt = f"{s:.0f}" if s >= 9.95 else f"{s:.1f}"
            ax.text(j, i, txt, ha="center", va="center", fontsize=7, color="white" if choice[i, j] != 1 else "black")
    ax.set_xticks(range(len(xs)))
    ax.set_xticklabels([f"{x:.0e}".replace("e-0", "e-") for x in xs], rotation=60, fontsize=8)
    ax.set_yticks(range(len(ylabels)))
    ax.set_yticklabels(ylabels, fontsize=8)


def _legend(fig: Any) -> None:
    from matplotlib.patches import Patch

    # "outside": constrained layout keeps a band below the axes for the legend.
    fig.legend(handles=[Patch(color=COLORS[a], label=a) for a in _algs()], loc="outside lower center",
               ncol=len(_algs()),
               fontsize=9, frameon=False)


def _panels(count: int, width: float, height: float) -> tuple[Any, list[Any]]:
    """Return a constrained-layout figure with ``count`` panels of ``width`` x ``height`` inches, 3 to a row.

    Constrained layout makes room for titles, tick labels, the suptitle and
    an outside legend, whatever the number of panels.
    """
    plt = pyplot()
    cols = min(3, max(1, count))
    rows = math.ceil(max(1, count) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.6), squeeze=False,
                             layout="constrained")
    flat = list(axes.flat)
    for ax in flat[count:]:
        ax.remove()
    return fig, flat[:count]


def _fit_width(fig: Any, text: Any, share: float = 0.96) -> None:
    """Wrap ``text`` (a title) onto more lines until it is at most ``share`` of the figure's width."""
    renderer = fig.canvas.get_renderer()
    words = text.get_text().replace("\n", " ")
    width = len(words)
    while text.get_window_extent(renderer).width > share * fig.bbox.width and width > 12:
        width = int(width * 0.85)
        text.set_text(textwrap.fill(words, width))


#: Multipliers of each power of ten that may carry a labelled tick, sparsest first.
_LOG_STEPS: tuple[tuple[float, ...], ...] = ((1.0,), (1.0, 3.0), (1.0, 2.0, 5.0), (1.0, 1.5, 2.0, 3.0, 5.0, 7.0),
                                             (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0))


def _log_ticks(lo: float, hi: float, most: int = 6) -> list[float]:
    """Return labelled ticks for a log axis over ``[lo, hi]``: the densest round values, at most ``most`` of them.

    Matplotlib's own log ticks label every minor tick over a range of about
    one decade, and those labels run into each other.
    """
    if not 0 < lo < hi < math.inf:
        return []  # nothing to label: matplotlib's own ticks
    e0, e1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    best: list[float] = []
    for subs in _LOG_STEPS:
        values = (float(f"{m:g}e{e}") for e in range(e0, e1 + 1) for m in subs)
        ticks = [v for v in values if lo <= v <= hi]
        if len(ticks) > most:
            break
        best = ticks
    if not best:  # many decades: every few decades
        decades = [float(f"1e{e}") for e in range(e0, e1 + 1) if lo <= float(f"1e{e}") <= hi]
        best = decades[:: max(1, math.ceil(len(decades) / most))]
    return best


def log_axes(ax: Any, lo: float, hi: float) -> None:
    """Make both axes of ``ax`` logarithmic over ``[lo, hi]``, labelled with :func:`_log_ticks` as plain numbers."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    ticks = _log_ticks(lo, hi)
    ax.set_box_aspect(1)  # square, so the diagonal is at 45 degrees
    for axis, set_scale, set_lim in ((ax.xaxis, ax.set_xscale, ax.set_xlim), (ax.yaxis, ax.set_yscale, ax.set_ylim)):
        set_scale("log")
        set_lim(lo, hi)
        if not ticks:
            continue
        axis.set_major_locator(FixedLocator(ticks))
        axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        axis.set_minor_locator(LogLocator(subs="auto"))
        axis.set_minor_formatter(NullFormatter())


def save_figure(fig: Any, path: str) -> None:
    """Write a figure atomically (temporary file, then rename)."""
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")


def _finish_map(fig: Any, out_dir: str, name: str) -> str:
    """Add the legend to a decision-map figure, write ``out_dir/name.png``, close it; return the path."""
    _legend(fig)
    path = os.path.join(out_dir, f"{name}.png")
    save_figure(fig, path)
    pyplot().close(fig)
    return path


def _cv_predictions(profile: Profile, folds: int = 5) -> tuple[list[Any], np.ndarray, np.ndarray, int]:
    """Predict every measurement with a model fitted without its configuration (``GroupKFold``).

    Returns:
        The measurements, the prediction of each one's own algorithm, the
        predictions of every algorithm (``(len(ms), len(_algs()))``, :func:`_algs` order)
        and the number of folds (0: fewer than two configurations).
    """
    from sklearn.model_selection import GroupKFold

    from colltune.model.cost_model import LearnedCostModel, default_group

    ms = list(profile.measurements)
    groups = [default_group(m) for m in ms]
    distinct = sorted(set(groups), key=repr)
    pred = np.full(len(ms), np.nan)
    every = np.full((len(ms), len(_algs())), np.nan)
    if len(distinct) < 2:
        return ms, pred, every, 0
    code = {g: i for i, g in enumerate(distinct)}
    gid = np.array([code[g] for g in groups])
    prior = {k: p.to_dict() for k, p in profile.primitives.items()}
    k = min(folds, len(distinct))
    for train, test in GroupKFold(n_splits=k).split(np.zeros(len(ms)), groups=gid):
        model = LearnedCostModel(primitives=prior).fit([ms[i] for i in train])
        every[test] = _predict(model, [ms[i].features() for i in test])
    for i, m in enumerate(ms):
        pred[i] = every[i, _algs().index(m.algorithm)]
    return ms, pred, every, k


def _cv_summary(ms: Sequence[Any], pred: np.ndarray, every: np.ndarray, folds: int) -> dict[str, Any] | None:
    """Return the cross-validated error per algorithm and the selection regret.

    As :func:`colltune.model.cost_model.cross_validate` reports them.
    """
    from colltune.model.cost_model import default_group

    if folds == 0:
        return None
    per: dict[str, Any] = {}
    for a in _algs():
        err = [abs(pred[i] - m.time_us) / m.time_us
               for i, m in enumerate(ms) if m.algorithm == a and np.isfinite(pred[i])]
        if err:
            per[a] = {"n": len(err), "median_rel_error": float(np.median(err)),
                      "p90_rel_error": float(np.percentile(err, 90))}
    configs: dict[Any, dict[str, float]] = {}
    rows: dict[Any, int] = {}
    for i, m in enumerate(ms):
        key = (m.numel, m.row_numel, m.dtype, m.world_size, m.k_max, m.k_sum, m.union)
        configs.setdefault(key, {})[m.algorithm] = m.time_us
        rows[key] = i
    regrets = []
    for key, measured in configs.items():
        cands = [a for a in _algs() if a in measured and np.isfinite(every[rows[key], _algs().index(a)])]
        if len(cands) >= 2:
            chosen = min(cands, key=lambda a: every[rows[key], _algs().index(a)])
            regrets.append(measured[chosen] / min(measured[a] for a in cands))
    r = np.asarray(regrets)
    nan = float("nan")
    return {
        "n_folds": folds,
        "n_groups": len({default_group(m) for m in ms}),
        "per_algorithm": per,
        "regret": {"n_configs": int(r.size),
                   "geomean": float(np.exp(np.mean(np.log(r)))) if r.size else nan,
                   "p95": float(np.percentile(r, 95)) if r.size else nan,
                   "max": float(r.max()) if r.size else nan,
                   "optimal_fraction": float(np.mean(r <= 1.0)) if r.size else nan},
    }


def _pick_n(profile: Profile) -> int:
    ns = sorted({m.numel for m in profile.measurements})
    if not ns:
        return 1 << 20
    return max(n for n in ns if n <= (1 << 20)) if any(n <= (1 << 20) for n in ns) else ns[0]


def write_report(
    profile_path: str,
    out_dir: str,
    *,
    n: int | None = None,
    overlap: float = 0.5,
    dtype: str = "float32",
    folds: int = 5,
    profile: Profile | None = None,
) -> dict[str, str]:
    """Write the decision maps, the predicted-versus-measured plot and ``summary.md`` to ``out_dir``.

    Args:
        profile_path: the profile (read unless ``profile`` is given: the one it holds, loaded already).
        out_dir: the directory (created if missing).
        n: rows of the maps (default: the largest measured ``n`` up to 2^20).
        overlap: overlap of the density x world-size map.
        dtype: value dtype of the maps.
        folds: cross-validation folds of the predicted-versus-measured plot.

    Returns:
        ``{"name": path}`` of the files written.

    Raises:
        colltune.model.profile.ProfileError: the profile is unreadable.
    """
    profile = profile if profile is not None else load_profile(profile_path)
    os.makedirs(out_dir, exist_ok=True)
    model, label = model_of(profile)
    n = n or _pick_n(profile)
    measured_p = sorted({m.world_size for m in profile.measurements}) or [
        int(p) for p in profile.meta.get("world_sizes", [2, 4, 8])]
    densities = [float(x) for x in np.logspace(-5, math.log10(0.5), 14)]
    maps = _Maps(model, label, n, overlap, dtype, densities, measured_p, out_dir)
    files = {"decision-density-world": maps.density_world(), "decision-density-overlap": maps.density_overlap()}
    ms, pred, every, n_folds = _cv_predictions(profile, folds)
    files["predicted-vs-measured"] = _predicted_vs_measured(profile, ms, pred, n_folds, out_dir)
    cv = _cv_summary(ms, pred, every, n_folds)
    path = os.path.join(out_dir, "summary.md")
    _write_text(path, _summary_md(profile_path, profile, model, label, cv, n, overlap, dtype, files, maps.cells))
    files["summary"] = path
    return files


@dataclass
class _Maps:
    """The decision maps of one model: the algorithm chosen and its predicted speedup over dense."""

    model: CostModel
    label: str
    n: int
    overlap: float
    dtype: str
    densities: list[float]
    measured_p: list[int]
    out_dir: str
    #: Per algorithm (registry order), the map cells where it is chosen, over the maps drawn so far.
    cells: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_algs(), 0))

    def _count(self, choice: np.ndarray) -> None:
        for j, a in enumerate(_algs()):
            self.cells[a] += int((choice == j).sum())

    def density_world(self) -> str:
        """Draw density x world size (measured world sizes starred); return the file."""
        n, overlap, dtype, measured_p = self.n, self.overlap, self.dtype, self.measured_p
        worlds = sorted(set([2, 4, 8, 16, 32, 64] + measured_p))
        choice, speed = decision_grid(self.model, self.densities, worlds,
                                      lambda d, p: _features(n, d, p, overlap, dtype))
        self._count(choice)
        fig, (ax,) = _panels(1, 9, 3.6 + 0.1 * len(worlds))
        _draw_map(ax, choice, speed, self.densities, [f"{p}*" if p in measured_p else str(p) for p in worlds])
        ax.set_xlabel("density (entries per rank / n)")
        ax.set_ylabel("world size P  (* measured)")
        ax.set_title(f"chosen algorithm and predicted speedup over dense\nn = 2^{int(math.log2(n))} rows, overlap "
                     f"{overlap:g}, {dtype}; model: {self.label}", fontsize=10)
        _fit_width(fig, ax.title)
        return _finish_map(fig, self.out_dir, "decision-density-world")

    def density_overlap(self) -> str:
        """Draw density x overlap, one panel per measured world size (3 to a row); return the file."""
        n, dtype, measured_p = self.n, self.dtype, self.measured_p
        overlaps = [round(x, 2) for x in np.linspace(0, 1, 11)]
        fig, axes = _panels(len(measured_p), 6.2, 4.4)
        for ax, p in zip(axes, measured_p):
            choice, speed = decision_grid(self.model, self.densities, overlaps,
                                          lambda d, o, p=p: _features(n, d, p, o, dtype))
            self._count(choice)
            _draw_map(ax, choice, speed, self.densities, [f"{o:.1f}" for o in overlaps])
            ax.set_xlabel("density")
            ax.set_ylabel("overlap")
            ax.set_title(f"P = {p}", fontsize=10)
        title = fig.suptitle(f"chosen algorithm and predicted speedup over dense; n = 2^{int(math.log2(n))}, "
                             f"{dtype}; model: {self.label}", fontsize=10)
        _fit_width(fig, title)
        return _finish_map(fig, self.out_dir, "decision-density-overlap")


def _predicted_vs_measured(profile: Profile, ms: list[Any], pred: np.ndarray, n_folds: int, out_dir: str) -> str:
    """Draw the cross-validated predictions against the measurements, one panel per algorithm; return the file."""
    algs = [a for a in _algs() if any(m.algorithm == a for m in ms)] or list(_algs())
    fig, axes = _panels(len(algs), 4.4, 4.4)
    statistic = str(profile.meta.get("statistic") or "median").replace("-", " ")
    for ax, a in zip(axes, algs):
        err = _scatter_algorithm(ax, a, ms, pred)
        ax.set_xlabel(f"measured {statistic} (ms)")
        ax.set_ylabel("predicted, cross-validated (ms)")
        ax.set_title(f"{a}: median error {100 * err:.0f}%", fontsize=10)
        _fit_width(fig, ax.title, ax.get_position().width)
    title = fig.suptitle(f"predicted vs measured ({n_folds}-fold cross-validation over configurations; "
                         "dotted: +-25%)", fontsize=10)
    _fit_width(fig, title)
    path = os.path.join(out_dir, "predicted-vs-measured.png")
    save_figure(fig, path)
    pyplot().close(fig)
    return path


def _scatter_algorithm(ax: Any, a: str, ms: list[Any], pred: np.ndarray) -> float:
    """Plot one algorithm's predicted against measured times per world size; return its median relative error."""
    sel = [i for i, m in enumerate(ms) if m.algorithm == a and np.isfinite(pred[i])]
    if not sel:
        return float("nan")
    meas = np.array([ms[i].time_us for i in sel]) / 1e3
    pr = pred[sel] / 1e3
    for p, marker in zip(sorted({ms[i].world_size for i in sel}), itertools.cycle("os^Dv<>")):
        idx = [j for j, i in enumerate(sel) if ms[i].world_size == p]
        ax.scatter(meas[idx], pr[idx], s=10, alpha=0.6, color=COLORS[a], marker=marker, label=f"P={p}")
    lo = float(min(meas.min(), pr.min())) * 0.8
    hi = float(max(meas.max(), pr.max())) * 1.25
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.plot([lo, hi], [lo * 1.25, hi * 1.25], "k:", lw=0.6)
    ax.plot([lo, hi], [lo / 1.25, hi / 1.25], "k:", lw=0.6)
    log_axes(ax, lo, hi)
    ax.legend(fontsize=7, loc="upper left", ncol=1 + (len(ax.collections) - 1) // 4)
    return float(np.median(np.abs(pr - meas) / meas))


def _write_text(path: str, text: str) -> None:
    write_text_atomic(path, text, ".md")


def _summary_md(source: str, profile: Profile, model: CostModel, label: str, cv: Mapping[str, Any] | None, n: int,
                overlap: float, dtype: str, files: Mapping[str, str], cells: Mapping[str, int]) -> str:
    from colltune.offline.active import candidates_from_profile

    meta = profile.meta
    lines = [f"# colltune profile report: `{os.path.basename(source)}`", ""]
    lines += ["| field | value |", "| --- | --- |"]
    for key in ("backend", "world_sizes", "nodes", "ranks_per_node", "torch_version", "host", "date", "notes"):
        if key in meta and meta[key] not in (None, ""):
            lines.append(f"| {key} | {meta[key]} |")
    lines.append(f"| measurements | {len(profile.measurements)} |")
    lines.append(f"| cost model | {label} |")
    lines += ["", "## Primitives (alpha-beta)", "", "| primitive | launch (us) | alpha (us/step) | bandwidth (GB/s) |",
              "| --- | ---: | ---: | ---: |"]
    for name, p in profile.primitives.items():
        bw = f"{1 / p.beta_us_per_byte / 1e3:.2f}" if p.beta_us_per_byte > 0 else "-"
        lines.append(f"| {name} | {p.launch_us:.1f} | {p.alpha_us:.1f} | {bw} |")
    lines += ["", "## Decision maps", "", "| algorithm | colour | cells where it is chosen |", "| --- | --- | ---: |"]
    lines += [f"| {a} | `{COLORS[a]}` | {c} |" for a, c in cells.items()]
    if cv is not None:
        r = cv["regret"]
        lines += ["", f"## Cross-validated accuracy ({cv['n_folds']} folds over {cv['n_groups']} configurations)", "",
                  "| algorithm | n | median rel. error | p90 rel. error |", "| --- | ---: | ---: | ---: |"]
        for a, v in cv["per_algorithm"].items():
            lines.append(f"| {a} | {v['n']} | {100 * v['median_rel_error']:.1f}% | {100 * v['p90_rel_error']:.1f}% |")
        lines += ["", f"Selection regret on held-out configurations (time of the chosen algorithm over the fastest "
                      f"measured): geometric mean **{r['geomean']:.3f}**, p95 {r['p95']:.3f}, max {r['max']:.3f}; "
                      f"the fastest was chosen in {100 * r['optimal_fraction']:.0f}% of {r['n_configs']} "
                      "configurations."]
    cands = candidates_from_profile(profile, [a for a in _algs() if any(m.algorithm == a for m in profile.measurements)]
                                    or _algs())
    if cands:
        t = np.array([[c.measured[a].time_us if a in c.measured else np.inf for a in _algs()] for c in cands])
        pred = _predict(model, [c.features for c in cands])
        best, chosen = t.argmin(1), pred.argmin(1)
        reg = t[np.arange(len(cands)), chosen] / t.min(1)
        lines += ["", "## Measured winners and the model's choices (in-sample)", "",
                  "| | " + " | ".join(_algs()) + " |", "| --- |" + " ---: |" * len(_algs()),
                  "| fastest measured | " + " | ".join(str(int((best == j).sum())) for j in range(len(_algs()))) + " |",
                  "| chosen by the model | " + " | ".join(str(int((chosen == j).sum())) for j in range(len(_algs())))
                  + " |", "",
                  f"In-sample regret: geometric mean {math.exp(float(np.mean(np.log(reg)))):.3f}, "
                  f"speedup of the choice over always-dense: geometric mean "
                  f"{math.exp(float(np.mean(np.log(t[:, 0] / t[np.arange(len(cands)), chosen])))):.2f}x.", ""]
        worst = np.argsort(-reg)[:10]
        lines += ["Largest regrets:", "", "| P | n | density | overlap | dtype | chosen | fastest | regret |",
                  "| ---: | ---: | ---: | ---: | --- | --- | --- | ---: |"]
        for i in worst:
            f = cands[i].features
            lines.append(f"| {f.world_size} | {f.numel} | {f.density:.2g} | {f.overlap:.2f} | {f.dtype} | "
                         f"{_algs()[chosen[i]]} | {_algs()[best[i]]} | {reg[i]:.2f} |")
    lines += ["", "## Pictures", ""]
    for key, path in files.items():
        lines.append(f"![{key}]({os.path.basename(path)})")
        lines.append("")
    lines.append(f"Decision maps at n = 2^{int(math.log2(n))}, {dtype}; the density x world size map at overlap "
                 f"{overlap:g}. Numbers in the cells: predicted speedup of the chosen algorithm over dense.")
    return "\n".join(lines) + "\n"


