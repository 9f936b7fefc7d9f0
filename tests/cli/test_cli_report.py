"""``colltune report``: valid, non-trivial PNG files and a markdown summary, from a synthetic profile."""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest

from colltune import cli
from colltune.model.cost_model import DEFAULT_PRIMITIVES, AnalyticModel
from colltune.model.features import Features
from colltune.model.profile import Measurement, profile_from_measurements, save_profile

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic_profile(path, world_sizes=(2, 4), seed=0, ns=(2**12, 2**16, 2**20), densities=(1e-4, 1e-3, 1e-2, 1e-1)):
    """Write a profile whose times are the alpha-beta model's, times a little noise (no ranks needed)."""
    rng = random.Random(seed)
    model = AnalyticModel(DEFAULT_PRIMITIVES)
    ms = []
    for p in world_sizes:
        for n in ns:
            for density in densities:
                k = max(1, round(density * n))
                for overlap in (0.0, 0.5, 1.0):
                    s = min(k, round(overlap * k))
                    if s + p * (k - s) > n:
                        s = k
                    f = Features.build(numel=n, row_numel=1, dtype="float32", k_per_rank=[k] * p,
                                       union=float(s + p * (k - s)))
                    for alg, t in model.predict(f).items():
                        ms.append(Measurement.from_features(f, alg, time_us=t * math.exp(rng.gauss(0, 0.05)),
                                                            spread_us=0.05 * t, repeats=5, bytes_sent=1))
    prof = profile_from_measurements(ms, DEFAULT_PRIMITIVES, {"backend": "gloo", "world_sizes": list(world_sizes),
                                                              "notes": "synthetic"})
    save_profile(prof, path)
    return path


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    return synthetic_profile(tmp_path_factory.mktemp("synthetic") / "synthetic.yaml")


def test_report_writes_valid_pngs_and_a_summary(profile_path, tmp_path, capsys):
    import matplotlib.image as mpimg

    out = tmp_path / "report"
    assert cli.main(["report", str(profile_path), "--out", str(out), "--folds", "3"]) == 0
    printed = capsys.readouterr().out
    names = ["decision-density-world.png", "decision-density-overlap.png", "predicted-vs-measured.png"]
    for name in names:
        path = out / name
        assert f"wrote {path}" in printed
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        assert len(data) > 20_000, (name, len(data))  # axes, labels, coloured cells: not an empty canvas
        img = mpimg.imread(str(path))
        assert img.shape[0] > 300 and img.shape[1] > 500
        colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
        assert len(colours) > 50, name
    # The decision map shows more than one algorithm: the alpha-beta times cross over the grid.
    world = mpimg.imread(str(out / names[0]))[..., :3]
    from colltune.offline.report import COLORS

    present = [a for a, hexc in COLORS.items()
               if np.any(np.all(np.abs(world - np.array([int(hexc[i:i + 2], 16) / 255 for i in (1, 3, 5)])) < 0.02,
                                axis=-1))]
    assert len(present) >= 2, present
    md = (out / "summary.md").read_text()
    assert md.startswith("# colltune profile report")
    for needle in ("Cross-validated accuracy", "Selection regret", "fastest measured", *names):
        assert needle in md
    assert not [p for p in os.listdir(out) if p.startswith(".colltune-")]


def test_report_of_an_analytic_profile(tmp_path, capsys):
    """Primitives only (no measurements): the maps come from the alpha-beta model."""
    prof = profile_from_measurements([], DEFAULT_PRIMITIVES, {"backend": "nccl", "world_sizes": [8]})
    save_profile(prof, tmp_path / "a.yaml")
    assert cli.main(["report", str(tmp_path / "a.yaml"), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "decision-density-world.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "alpha-beta" in (tmp_path / "r" / "summary.md").read_text()


NAMES = ("decision-density-world.png", "decision-density-overlap.png", "predicted-vs-measured.png")


def _drawn_tick_labels(ax):
    """Return the tick labels ``ax`` draws: visible, not empty, at a tick inside the view."""
    out = []
    for axis, coord in ((ax.xaxis, 0), (ax.yaxis, 1)):
        lo, hi = sorted(axis.get_view_interval())
        slack = 1e-9 * max(1.0, abs(lo), abs(hi))
        out += [t for t in axis.get_ticklabels(which="both")
                if t.get_visible() and t.get_text() and lo - slack <= t.get_position()[coord] <= hi + slack]
    return out


def layout_problems(fig):
    """Return what a reader would see clipped or overprinted: texts outside the figure, labels that overlap."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ticks = [t for ax in fig.axes for t in _drawn_tick_labels(ax)]
    tick_ids = {id(t) for t in ticks}
    all_ticks = {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis) for t in axis.get_ticklabels(which="both")}
    texts = [t for t in fig.findobj(Text)
             if t.get_visible() and t.get_text() and (id(t) in tick_ids or id(t) not in all_ticks)]
    frame = fig.bbox.padded(1)
    problems = [f"outside the figure: {t.get_text()!r}" for t in texts
                if not frame.contains(*t.get_window_extent(renderer).p0)
                or not frame.contains(*t.get_window_extent(renderer).p1)]
    titles = [t for t in (fig._suptitle, *(a.title for a in fig.axes), *(a.xaxis.label for a in fig.axes),
                          *(a.yaxis.label for a in fig.axes)) if t is not None and t.get_text()]
    labels = ticks + titles
    boxes = [t.get_window_extent(renderer) for t in labels]
    for i in range(len(labels)):
        for j in range(i + 1, len(labels)):
            if boxes[i].overlaps(boxes[j]):
                problems.append(f"overlap: {labels[i].get_text()!r} and {labels[j].get_text()!r}")
    return problems


@pytest.mark.parametrize(
    ("world_sizes", "ns", "densities"),
    [
        ((2,), (2**14, 2**16, 2**18), (1e-3, 1e-2, 1e-1)),  # the quick grid at one P: times within a decade
        ((2,), (2**12, 2**16, 2**20), (1e-4, 1e-2, 1e-1)),
        ((2, 4, 8, 16, 32), (2**12, 2**20), (1e-3, 1e-1)),  # two rows of panels
    ],
)
def test_report_figures_clip_nothing_and_overprint_no_label(world_sizes, ns, densities, tmp_path, monkeypatch):
    from colltune.offline import report

    path = synthetic_profile(tmp_path / "p.yaml", world_sizes=world_sizes, ns=ns, densities=densities)
    seen = {}
    save = report.save_figure

    def checked(fig, out):
        seen[os.path.basename(out)] = layout_problems(fig)
        save(fig, out)

    monkeypatch.setattr(report, "save_figure", checked)
    report.write_report(str(path), str(tmp_path / "r"), folds=3)
    assert seen == {name: [] for name in NAMES}


def test_log_ticks_are_round_and_few():
    from colltune.offline.report import _log_ticks

    for lo, hi in [(0.5, 1.2), (5, 40), (1.2, 18), (0.7, 6), (1, 1000), (1e-3, 1e6), (2.0, 3.2)]:
        ticks = _log_ticks(lo, hi)
        assert 1 <= len(ticks) <= 6 and all(lo <= t <= hi for t in ticks), (lo, hi, ticks)
        assert all(float(f"{t:.2g}") == t for t in ticks), ticks
    assert _log_ticks(5, 40) == [5, 7, 10, 15, 20, 30] and _log_ticks(1, 1000) == [1, 10, 100, 1000]


def _online_run(path) -> None:
    import json

    calls = [{"site": s, "call": i, "forced": {"dense": 300.0, "allgather": 100.0},
              "predicted": {"dense": 300.0, "allgather": 300.0},
              "on": {"algorithm": "allgather" if i > 3 else "dense", "source": "model", "us": 100.0,
                     "correction": {"allgather": 1 / 3}},
              "off": {"algorithm": "dense", "source": "model", "us": 300.0, "correction": {}}}
             for s in (0, 1) for i in range(20)]
    path.write_text(json.dumps({"summary": {}, "calls": calls}))


def test_report_draws_an_online_run_alone(tmp_path, capsys):
    run = tmp_path / "online.json"
    _online_run(run)
    assert cli.main(["report", "--online", str(run), "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    for name in ("online-regret.png", "online-predicted-vs-measured.png", "online-summary.md"):
        assert (tmp_path / "r" / name).is_file() and name in out
    assert "| allgather | 40 | 0.33 | 1.00 |" in (tmp_path / "r" / "online-summary.md").read_text()


def test_report_without_a_profile_or_a_run_exits_2(tmp_path, capsys):
    assert cli.main(["report", "--out", str(tmp_path / "r")]) == 2
    assert "PROFILE" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli.main(["report", "--online", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert "--online" in capsys.readouterr().err and not (tmp_path / "r").exists()
