"""Check the team's benchmark targets on a report written by ``colltune bench --json``.

Usage: python3 tools/check_targets.py bench.json

The targets are the algorithms issue's acceptance checks, kept here for the
team rather than printed to users by ``colltune bench``:

(a) ``allgather`` is never more than 10% slower than ``torch``, and faster
    at density >= 1e-2;
(b) ``oktopk`` at P = 8, overlap 1, density 1e-2 sends at most a third of
    ``allgather``'s bytes per rank and is faster;
(c) in top-k mode Ok-Topk's entry words per rank stay within ``6k(P-1)/P``.

Exit status 0 when every target that has a matching configuration holds.
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

from colltune.offline.bench import config_name


def check_targets(report: dict[str, Any]) -> dict[str, Any]:
    """Evaluate the targets on a report.

    (a) ``allgather`` is never more than 10% slower than ``torch``, and faster
    at density >= 1e-2; (b) ``oktopk`` at P = 8, overlap 1, density 1e-2 sends
    at most a third of ``allgather``'s bytes per rank and is faster; (c) in
    top-k mode Ok-Topk's entry words per rank stay within ``6k(P-1)/P``.
    A target with no matching configuration has ``holds: None``.
    """
    return {"a": _target_a(report), "b": _target_b(report), "c": _target_c(report)}


def _target_a(report: dict[str, Any]) -> dict[str, Any]:
    """Evaluate (a): ``allgather``'s time over ``torch``'s, everywhere and at density >= 1e-2."""
    rows = []
    for c in report.get("configs", []):
        cs = c["contenders"]
        if "median_ms" in cs.get("allgather", {}) and "median_ms" in cs.get("torch", {}):
            ratio = cs["allgather"]["median_ms"] / cs["torch"]["median_ms"]
            rows.append((c, ratio))
    a_fail_10 = [(config_name(c), r) for c, r in rows if r > 1.10]
    a_dense = [(c, r) for c, r in rows if c["density"] >= 1e-2]
    a_fail_fast = [(config_name(c), r) for c, r in a_dense if r >= 1.0]
    return {
        "what": "allgather time / torch time <= 1.10 everywhere, < 1 at density >= 1e-2",
        "holds": None if not rows else (not a_fail_10 and not a_fail_fast),
        "configs": len(rows),
        "worst_ratio": max((r for _, r in rows), default=None),
        "worst_config": config_name(max(rows, key=lambda x: x[1])[0]) if rows else None,
        "worst_ratio_density_ge_1e-2": max((r for _, r in a_dense), default=None),
        "median_ratio": statistics.median([r for _, r in rows]) if rows else None,
        "over_1.10": [{"config": n, "ratio": r} for n, r in a_fail_10],
        "not_faster_at_density_ge_1e-2": [{"config": n, "ratio": r} for n, r in a_fail_fast],
    }


def _target_b(report: dict[str, Any]) -> dict[str, Any]:
    """Evaluate (b): ``oktopk``'s bytes and time against ``allgather``'s at P = 8, overlap 1, density 1e-2."""
    b_rows = []
    for c in report.get("configs", []):
        cs = c["contenders"]
        if (
            c["world_size"] == 8
            and c["overlap_requested"] == 1.0
            and abs(c["density"] - 1e-2) < 1e-12
            and "median_ms" in cs.get("oktopk", {})
            and "median_ms" in cs.get("allgather", {})
        ):
            b_rows.append(
                {
                    "config": config_name(c),
                    "bytes_ratio": cs["oktopk"]["bytes_per_rank_max"] / max(1.0, cs["allgather"]["bytes_per_rank_max"]),
                    "time_ratio": cs["oktopk"]["median_ms"] / cs["allgather"]["median_ms"],
                }
            )
    return {
        "what": "oktopk at P=8, overlap 1, density 1e-2: bytes/rank <= 1/3 of allgather's, and faster",
        "holds": None if not b_rows else all(r["bytes_ratio"] <= 1 / 3 and r["time_ratio"] < 1 for r in b_rows),
        "bytes_holds": None if not b_rows else all(r["bytes_ratio"] <= 1 / 3 for r in b_rows),
        "time_holds": None if not b_rows else all(r["time_ratio"] < 1 for r in b_rows),
        "rows": b_rows,
    }


def _target_c(report: dict[str, Any]) -> dict[str, Any]:
    """Evaluate (c): Ok-Topk's entry words per rank in top-k mode against ``6k(P-1)/P``."""
    c_rows = []
    for t in report.get("topk", []):
        ok = t["contenders"].get("oktopk")
        if ok is None or "words_per_rank_max" not in ok:
            continue
        c_rows.append(
            {
                "config": f"n={t['n']} density={t['density']:g} P={t['world_size']}",
                "k": t["k"],
                "bound_words": t["bound_words"],
                "words_median": ok["words_per_rank_median"],
                "words_max": ok["words_per_rank_max"],
                "meta_words_max": ok["meta_words_per_rank_max"],
                "over_bound_median": ok["words_over_bound_median"],
                "over_bound_max": ok["words_over_bound_max"],
            }
        )
    return {
        "what": "oktopk top-k: entry words per rank <= 6k(P-1)/P (metadata reported apart)",
        "holds": None if not c_rows else all(r["over_bound_max"] <= 1.0 for r in c_rows),
        "holds_median": None if not c_rows else all(r["over_bound_median"] <= 1.0 for r in c_rows),
        "rows": c_rows,
    }


def format_targets(targets: dict[str, Any]) -> str:
    """Return a short verdict per target."""

    def verdict(h: Any) -> str:
        return "n/a (no matching configuration)" if h is None else ("holds" if h else "FAILS")

    a, b, c = targets["a"], targets["b"], targets["c"]
    lines = [f"(a) {a['what']}: {verdict(a['holds'])}"]
    if a["configs"]:
        lines.append(
            f"    {a['configs']} configs; median ratio {a['median_ratio']:.2f}, worst {a['worst_ratio']:.2f} "
            f"({a['worst_config']}); worst at density >= 1e-2: "
            + ("-" if a["worst_ratio_density_ge_1e-2"] is None else f"{a['worst_ratio_density_ge_1e-2']:.2f}")
        )
        for item in a["over_1.10"][:10]:
            lines.append(f"    over 1.10: {item['config']}: {item['ratio']:.2f}")
        for item in a["not_faster_at_density_ge_1e-2"][:10]:
            lines.append(f"    not faster at density >= 1e-2: {item['config']}: {item['ratio']:.2f}")
    lines.append(f"(b) {b['what']}: {verdict(b['holds'])}")
    for r in b["rows"]:
        lines.append(f"    {r['config']}: bytes ratio {r['bytes_ratio']:.3f}, time ratio {r['time_ratio']:.2f}")
    lines.append(f"(c) {c['what']}: {verdict(c['holds'])}")
    for r in c["rows"]:
        lines.append(
            f"    {r['config']} k={r['k']}: words/rank median {r['words_median']:.0f}, max {r['words_max']:.0f} "
            f"vs bound {r['bound_words']:.0f} ({r['over_bound_max']:.2f}); meta words max {r['meta_words_max']:.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Print the verdicts of the report named in ``argv``; return 0 when no target fails, 1 when one does."""
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        targets = check_targets(json.load(f))
    print(format_targets(targets))
    return 0 if all(t.get("holds") is not False for t in targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
