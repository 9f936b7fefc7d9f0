"""A registered plugin takes part in every mode and command, with no edit but its own module.

The toy plugin is allgather under another name, priced at half allgather's
bytes (so the model prefers it where allgather wins). It is registered the
way a user registers one: in Python with ``colltune.algorithms.register``,
and for the command-line tools (and the ranks they start) by naming its
module in ``COLLTUNE_ALGORITHMS``. Then top-k ``auto`` prices and picks it,
``simulate`` prices it, ``tune`` searches its knobs, ``report`` draws it,
``bench`` times it and ``profile`` measures it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from colltune import algorithms
from colltune.algorithms.registry import PLUGINS_ENV

TOY = textwrap.dedent('''
    """A toy plugin: allgather under another name, priced at half its bytes."""

    import dataclasses

    from colltune.algorithms import register
    from colltune.algorithms.allgather import Allgather


    @register
    class Toy(Allgather):
        name = "toy"

        def schedule(self, pricing, knobs):
            return [dataclasses.replace(s, nbytes=s.nbytes / 2) for s in super().schedule(pricing, knobs)]
''')

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def plugin(tmp_path: Path) -> dict[str, str]:
    """The environment of a command that sees the toy plugin."""
    (tmp_path / "toy_plugin.py").write_text(TOY)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env[PLUGINS_ENV] = "toy_plugin"
    return env


def _colltune(env: dict[str, str], *args: str, cwd: Path | None = None, timeout: float = 300) -> str:
    done = subprocess.run([sys.executable, "-m", "colltune.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_top_k_auto_prices_and_picks_a_registered_plugin(tmp_path: Path) -> None:
    from colltune.select.selector import Selector

    sys.path.insert(0, str(tmp_path))
    (tmp_path / "toy_plugin.py").write_text(TOY)
    try:
        import toy_plugin  # noqa: F401 - registers it

        sel = Selector(profile=str(ROOT / "profiles" / "analytic-nccl.yaml"))
        choice = sel.decide_topk(("topk", "t"), world_size=8, rank=0, backend="nccl", name="t", numel=2**24,
                                 k=2**10, dtype="float32", ranks_per_node=8)
        assert "toy" in choice.predicted_us and choice.predicted_us["toy"] < choice.predicted_us["allgather"]
        assert choice.algorithm == "toy", choice
    finally:
        algorithms.unregister("toy")
        sys.path.remove(str(tmp_path))
        sys.modules.pop("toy_plugin", None)


def test_simulate_prices_a_registered_plugin(plugin: dict[str, str]) -> None:
    for extra in ([], ["--topk"]):
        out = json.loads(_colltune(plugin, "simulate", "--numel", "2^20", "--density", "1e-3", "-P", "8",
                                   "--backend", "nccl", "--json", *extra))
        point = out["points"][0]
        assert "toy" in point["predicted_us"] and "toy" in point["bytes_sent"], point


def test_a_bad_plugin_module_is_a_clear_error(plugin: dict[str, str]) -> None:
    plugin[PLUGINS_ENV] = "no_such_plugin_module"
    done = subprocess.run([sys.executable, "-m", "colltune.cli", "simulate", "--numel", "2^20", "--density", "1e-3",
                           "-P", "8"], env=plugin, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert PLUGINS_ENV in done.stderr and "no_such_plugin_module" in done.stderr, done.stderr[-2000:]


def test_bench_times_a_registered_plugin(plugin: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    _colltune(plugin, "bench", "-P", "2", "--n", "2^12", "--density", "1e-2", "--overlap", "0.5", "--repeats", "1",
              "--budget", "0.5", "--contenders", "toy", "allgather", "--json", str(out), "--no-progress")
    text = out.read_text()
    assert '"toy"' in text


def test_tune_searches_a_registered_plugins_knobs(plugin: dict[str, str], tmp_path: Path) -> None:
    out = _colltune(plugin, "tune", "--algorithm", "toy", "-P", "2", "--trials", "1", "--rounds", "1",
                    "--n", "2^12", "--density", "1e-2", "--storage", str(tmp_path / "t.journal"),
                    "--out", str(tmp_path / "policy.yaml"), "--quiet", cwd=tmp_path)
    assert "toy" in (tmp_path / "policy.yaml").read_text(), out


def test_report_draws_a_registered_plugin(plugin: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _colltune(plugin, "report", str(ROOT / "profiles" / "analytic-nccl.yaml"), "--out", str(tmp_path / "r"))
    row = next(line for line in (tmp_path / "r" / "summary.md").read_text().splitlines() if line.startswith("| toy |"))
    assert int(row.rstrip(" |").rsplit("|", 1)[1]) > 0, row  # chosen (drawn) in some cells of the maps
