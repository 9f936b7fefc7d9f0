"""Draw a run of online correction: regret over calls, and measured against predicted (``colltune report --online``).

The input is the JSON a call-stream benchmark writes (``tools/online_bench.py
--json``): per call, its site and index, every algorithm's forced time (the
call's truth: the slowest rank's time of each), the profile's prediction of
each, and for ``auto`` with online correction on and off the algorithm it
ran and, with it on, the correction in force (corrected / predicted, per
algorithm). Files written to the output directory:

``online-regret.png``
    Choice regret (the forced time of the algorithm chosen over the
    call's fastest forced time) against the call's index at its site,
    with online correction on and off: the geometric mean over sites of a
    running window of :data:`WINDOW` calls, and the calls themselves, faint.
``online-predicted-vs-measured.png``
    Per algorithm, the forced (measured) time against the profile's
    prediction and against the corrected prediction, log-log, with the
    diagonal: correction moves the points onto it.
``online-summary.md``
    The run's summary (regret, exploring, the cost of correction) and the
    per-algorithm median of measured / predicted, before and after correction.

Example:
    >>> from colltune.offline.online_report import write_online_report
    >>> files = write_online_report("online.json", "report/")  # doctest: +SKIP
"""

from __future__ import annotations

import gzip
import json
import math
import os
import statistics
from typing import Any, Mapping, Sequence

from colltune.algorithms.errors import ColltuneValueError
from colltune.model.files import write_text_atomic

__all__ = ["WINDOW", "load_run", "regret_series", "wrong_label", "write_online_report"]

#: Calls per point of the running regret.
WINDOW = 10
#: The largest run file read.
MAX_RUN_BYTES = 64 * 2**20


def load_run(path: str) -> dict[str, Any]:
    """Read a call-stream run (JSON, or gzipped JSON if the name ends in ``.gz``); return it (``summary`` and ``calls``).

    Raises:
        ColltuneValueError: the file is too large, not JSON, or has no calls
            with forced times and on/off choices (the message names what is missing).
    """
    size = os.path.getsize(path)
    if size > MAX_RUN_BYTES:
        raise ColltuneValueError(f"--online {path!r}: {size} bytes, more than the {MAX_RUN_BYTES} a run may have.")
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as fh:
            run = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ColltuneValueError(f"--online {path!r} is not a readable JSON run: {exc}") from None
    calls = run.get("calls") if isinstance(run, dict) else None
    need = ("site", "call", "forced", "on", "off")
    if not isinstance(calls, list) or not calls or not all(isinstance(c, dict) and all(k in c for k in need)
                                                           for c in calls):
        raise ColltuneValueError(f"--online {path!r}: expected {{'calls': [...]}} with {', '.join(need)} per call, "
                                 "as tools/online_bench.py --json writes.")
    return run


def _regret(call: Mapping[str, Any], mode: str) -> float:
    forced = call["forced"]
    return forced[call[mode]["algorithm"]] / min(forced.values())


def regret_series(calls: Sequence[Mapping[str, Any]], mode: str, window: int = WINDOW) -> tuple[list[int], list[float]]:
    """Return call indices and the geometric mean over sites of each site's running regret over ``window`` calls."""
    by_site: dict[Any, dict[int, float]] = {}
    for c in calls:
        by_site.setdefault(c["site"], {})[int(c["call"])] = math.log(_regret(c, mode))
    last = max(int(c["call"]) for c in calls)
    xs, ys = [], []
    for i in range(window - 1, last + 1):
        logs = []
        for per in by_site.values():
            got = [per[j] for j in range(i - window + 1, i + 1) if j in per]
            if got:
                logs.append(sum(got) / len(got))
        if logs:
            xs.append(i)
            ys.append(math.exp(sum(logs) / len(logs)))
    return xs, ys


def _draw_regret(calls: Sequence[Mapping[str, Any]], path: str, title: str) -> None:
    from colltune.offline.report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
    for mode, color in (("off", "#8C8C8C"), ("on", "#4C72B0")):
        ax.scatter([c["call"] for c in calls], [_regret(c, mode) for c in calls], s=4, alpha=0.15, color=color)
        xs, ys = regret_series(calls, mode)
        ax.plot(xs, ys, color=color, label=f"online correction {mode} (running geometric mean of {WINDOW})")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("call at its site")
    ax.set_ylabel("regret: chosen / fastest (forced, same call)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    save_figure(fig, path)
    plt.close(fig)


def _points(calls: Sequence[Mapping[str, Any]], algorithm: str) -> tuple[list[float], list[float], list[float]]:
    """Measured, predicted and corrected times of ``algorithm`` over the calls that carry a prediction."""
    measured, predicted, corrected = [], [], []
    for c in calls:
        pred = (c.get("predicted") or {}).get(algorithm)
        if pred is None or pred <= 0 or algorithm not in c["forced"]:
            continue
        measured.append(c["forced"][algorithm])
        predicted.append(pred)
        corrected.append(pred * (c["on"].get("correction") or {}).get(algorithm, 1.0))
    return measured, predicted, corrected


def _draw_accuracy(calls: Sequence[Mapping[str, Any]], algorithms: Sequence[str], path: str, title: str) -> None:
    from colltune.offline.report import COLORS, log_axes, pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(algorithms), figsize=(4.2 * len(algorithms), 4.2), layout="constrained",
                             squeeze=False)
    for ax, a in zip(axes[0], algorithms):
        measured, predicted, corrected = _points(calls, a)
        if not measured:
            ax.set_title(f"{a}: no predictions", fontsize=9)
            continue
        ax.scatter(predicted, measured, s=6, alpha=0.35, color="#8C8C8C", label="profile's prediction")
        ax.scatter(corrected, measured, s=6, alpha=0.5, color=COLORS.get(a), label="corrected (online)")
        lo, hi = min(measured + predicted + corrected), max(measured + predicted + corrected)
        lo, hi = (lo / 2, hi * 2) if hi < lo * 1.01 else (lo, hi)  # one point: a decade around it
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
        log_axes(ax, lo, hi)
        ax.set_xlabel("predicted (us)")
        ax.set_ylabel("measured (us)")
        ax.set_title(a, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
    plt.close(fig)


def wrong_label(wrong: Sequence[Any] | None) -> str:
    """How a run's ``summary["wrong"]`` (``[algorithm, factor]``, the profile made wrong; or none) reads in a title."""
    return f"wrong: {wrong[0]} x{wrong[1]:g}" if wrong else ""


def _summary_md(run: Mapping[str, Any], algorithms: Sequence[str], files: Mapping[str, str]) -> str:
    s = run.get("summary") or {}
    lines = ["# Online correction: a call stream", ""]
    if s:
        lines += [f"{s.get('ranks', '?')} ranks, {s.get('sites', '?')} sites x {s.get('calls', '?')} calls; profile "
                  f"{s.get('profile', '?')}" + (f"; made {wrong_label(s['wrong'])}" if s.get("wrong") else ""), "",
                  "| mode | regret (geometric mean) | 95th percentile | max | smoothed: geometric mean | 95th "
                  "percentile | exploring calls | exploring time |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for mode in ("on", "off", "floor"):
            m = s.get(mode) or {}
            if m:
                smoothed = (f"{m['smoothed_regret_geomean']:.3f} | {m['smoothed_regret_p95']:.2f}"
                            if "smoothed_regret_geomean" in m else "- | -")
                explore = (f"{100 * m['explore_calls']:.1f}% | {100 * m['explore_time']:.1f}%" if "explore_calls" in m
                           else "- | -")
                lines.append(f"| {mode} | {m['regret_geomean']:.3f} | {m['regret_p95']:.2f} | {m['regret_max']:.2f} "
                             f"| {smoothed} | {explore} |")
        if "on_over_off" in s:
            ci = s.get("on_over_off_ci95")
            lines += ["", f"auto's own time, on over off (geometric mean): {s['on_over_off']:.3f}"
                      + (f" (95% confidence {ci[0]:.3f} to {ci[1]:.3f})" if ci else "")
                      + (f"; on's choices against off's, priced by the smoothed truth: "
                         f"{s['on_over_off_choices']:.3f}" if "on_over_off_choices" in s else "")
                      + f"; the same decisions on every rank: {s.get('same_on_every_rank')}"]
    lines += ["", "| algorithm | calls | measured / predicted (median) | measured / corrected (median) |",
              "| --- | --- | --- | --- |"]
    for a in algorithms:
        measured, predicted, corrected = _points(run["calls"], a)
        if measured:
            before = statistics.median(m / p for m, p in zip(measured, predicted))
            after = statistics.median(m / c for m, c in zip(measured, corrected))
            lines.append(f"| {a} | {len(measured)} | {before:.2f} | {after:.2f} |")
    lines += [""] + [f"![{name}]({os.path.basename(p)})" for name, p in files.items()] + [""]
    return "\n".join(lines)


def write_online_report(path: str, out_dir: str, run: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Draw the run in ``path`` (``run``: the one it holds, loaded already) into ``out_dir`` (created if missing);
    return the files written by name."""
    run = run if run is not None else load_run(path)
    calls = run["calls"]
    algorithms = list(dict.fromkeys(a for c in calls for a in c["forced"]))
    os.makedirs(out_dir, exist_ok=True)
    s = run.get("summary") or {}
    title = (f"{s.get('ranks', '?')} ranks, {s.get('sites', '?')} sites; profile {s.get('profile', '?')}"
             + (f", {wrong_label(s['wrong'])}" if s.get("wrong") else ""))
    files = {"regret": os.path.join(out_dir, "online-regret.png"),
             "predicted-vs-measured": os.path.join(out_dir, "online-predicted-vs-measured.png")}
    _draw_regret(calls, files["regret"], title)
    _draw_accuracy(calls, algorithms, files["predicted-vs-measured"], title)
    summary = os.path.join(out_dir, "online-summary.md")
    write_text_atomic(summary, _summary_md(run, algorithms, files))
    return {**files, "summary": summary}
