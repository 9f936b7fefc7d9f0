"""``colltune simulate`` (and ``explain``'s cluster options): what colltune would do on a cluster, per world size."""

from __future__ import annotations

import json

import pytest

from colltune import cli
from colltune.algorithms.registry import BUILTIN_NAMES
from colltune.model.features import MAX_WORLD_SIZE

#: Identical index sets: the overlap fits at every world size up to the bound.
CALL = ["--numel", "2^20", "--density", "5e-2", "--overlap", "1"]


def test_simulate_prints_every_world_size_and_a_choice(capsys) -> None:
    assert cli.main(["simulate", *CALL, "-P", "8", "64", "1024"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["8", "64", "1024"]
    assert [r[1] for r in rows] == ["1", "8", "128"] and all(r[2] == "8" for r in rows)
    assert all(r[-1] in BUILTIN_NAMES for r in rows)
    assert "it receives as much" in out


def test_simulate_json_holds_times_bytes_and_choices(capsys) -> None:
    assert cli.main(["simulate", *CALL, "-P", "8", "1024", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    first, last = doc["points"]
    assert first["world_size"] == 8 and last["nodes"] == 128
    for pt in doc["points"]:
        assert set(pt["predicted_us"]) == set(BUILTIN_NAMES)
        assert pt["choice"] == min(pt["predicted_us"], key=pt["predicted_us"].get)
        assert pt["bytes_received"] == pt["bytes_sent"]
    # at 1024 ranks allgather receives 40x dense's bytes: the NCCL model no longer picks it
    assert last["bytes_sent"]["allgather"] > 4 * last["bytes_sent"]["dense"] and last["choice"] != "allgather"


def test_the_layout_options_change_the_pricing(capsys) -> None:
    assert cli.main(["simulate", *CALL, "--nodes", "16", "--gpus-per-node", "4", "--gpu", "a100", "--json"]) == 0
    (pt,) = json.loads(capsys.readouterr().out)["points"]
    assert (pt["world_size"], pt["nodes"], pt["ranks_per_node"]) == (64, 16, 4)
    assert cli.main(["simulate", *CALL, "--nodes", "16", "--gpus-per-node", "4", "--gpu", "h100", "--json"]) == 0
    (faster,) = json.loads(capsys.readouterr().out)["points"]
    assert faster["predicted_us"]["dense"] < pt["predicted_us"]["dense"]


def test_simulate_draws_its_plot(tmp_path, capsys) -> None:
    png = tmp_path / "sim.png"
    assert cli.main(["simulate", "--topk", "--numel", "1e7", "--density", "1e-3", "-P", "32", "256",
                     "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in capsys.readouterr().out


def test_simulate_says_when_a_measured_profile_extrapolates(capsys) -> None:
    assert cli.main(["simulate", *CALL, "--backend", "gloo", "-P", "4", "64"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert "extrapolating" not in lines[0] and "world size outside the measured" in lines[1]


def test_bad_cluster_options_exit_2(capsys) -> None:
    assert cli.main(["simulate", *CALL, "--gpu", "z80"]) == 2
    assert "--gpu" in capsys.readouterr().err
    assert cli.main(["simulate", *CALL, "--backend", "gloo", "--gpus-per-node", "8"]) == 2
    assert "NCCL cluster" in capsys.readouterr().err
    assert cli.main(["simulate", *CALL, "--nodes", "2", "-P", "16"]) == 2


EXPLAIN = ["explain", "--numel", "2^40", "--density", "1e-9", "--overlap", "0.5"]


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["simulate", *CALL, "-P", str(2**40)], "--world-size/-P"),
        (["simulate", *CALL, "-P", "8", str(MAX_WORLD_SIZE + 1)], "--world-size/-P"),
        (["simulate", *CALL, "--nodes", str(2**31), "--gpus-per-node", "8"], "--nodes"),
        (["simulate", *CALL, "--gpus-per-node", str(2**40)], "--gpus-per-node"),
        (["explain", *EXPLAIN[1:], "-P", str(2**40)], "--world-size/-P"),
        (["explain", *EXPLAIN[1:], "-P", "8", "--backend", "nccl", "--gpus-per-node", str(2**40)], "--gpus-per-node"),
    ],
)
def test_world_sizes_beyond_the_bound_exit_2_naming_the_option(argv, option, capsys) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and option in err and str(MAX_WORLD_SIZE) in err


def test_nodes_times_ranks_per_node_beyond_the_bound_exit_2(capsys) -> None:
    nodes = MAX_WORLD_SIZE // 8 + 1
    assert cli.main(["simulate", *CALL, "--nodes", str(nodes), "--gpus-per-node", "8"]) == 2
    err = capsys.readouterr().err
    assert "--nodes" in err and str(MAX_WORLD_SIZE) in err and f"at most {MAX_WORLD_SIZE // 8}" in err
    assert cli.main(["simulate", *CALL, "--nodes", str(nodes)]) == 2  # the profile's 8 ranks per node
    assert "--nodes" in capsys.readouterr().err


def test_the_bound_is_priced_and_stated_in_the_help(capsys) -> None:
    assert cli.main(["simulate", *CALL, "-P", str(MAX_WORLD_SIZE), "--gpus-per-node", "1", "--json"]) == 0
    (pt,) = json.loads(capsys.readouterr().out)["points"]
    assert pt["world_size"] == MAX_WORLD_SIZE and pt["choice"]
    for command in ("simulate", "explain"):
        assert cli.main([command, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert text.count(str(MAX_WORLD_SIZE)) >= 2, command  # -P and --gpus-per-node (and simulate's --nodes)


def test_a_million_ranks_are_priced(capsys) -> None:
    p = 2**20
    assert cli.main(["simulate", *CALL, "-P", "8", str(p), "--json"]) == 0
    small, big = json.loads(capsys.readouterr().out)["points"]
    assert (big["world_size"], big["nodes"], big["ranks_per_node"]) == (p, p // 8, 8)
    assert big["predicted_us"]["dense"] > small["predicted_us"]["dense"]
    assert cli.main(["simulate", *CALL, "-P", str(p)]) == 0
    row = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert row[0][:3] == [str(p), str(p // 8), "8"]  # wide numbers keep their columns apart
    for backend in ("nccl", "gloo"):
        assert cli.main([*EXPLAIN, "-P", str(p), "--backend", backend, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)


def test_explain_takes_the_cluster_options(capsys) -> None:
    base = ["explain", "--numel", "2^20", "--density", "1e-2", "--world-size", "64", "--overlap", "0.5",
            "--backend", "nccl", "--json"]
    assert cli.main([*base, "--gpus-per-node", "8"]) == 0
    eight = json.loads(capsys.readouterr().out)
    assert cli.main([*base, "--gpus-per-node", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    times = {d["algorithm"]: d["predicted_us"] for d in eight["algorithms"]}
    spread = {d["algorithm"]: d["predicted_us"] for d in one["algorithms"]}
    assert times["dense"] != spread["dense"]  # 8 nodes of 8 against 64 nodes of 1


def test_the_layout_printed_is_the_layout_priced(capsys) -> None:
    assert cli.main(["simulate", *CALL, "-P", "12", "--json"]) == 0  # 8 per node: 2 nodes of 6
    (pt,) = json.loads(capsys.readouterr().out)["points"]
    assert (pt["nodes"], pt["ranks_per_node"]) == (2, 6)
    assert cli.main(["simulate", *CALL, "--nodes", "2", "--gpus-per-node", "6", "--json"]) == 0
    (same,) = json.loads(capsys.readouterr().out)["points"]
    assert same["predicted_us"] == pt["predicted_us"]


def test_an_uneven_layout_is_refused_with_the_even_ones_near_it(capsys) -> None:
    assert cli.main(["simulate", *CALL, "-P", "8", "1020"]) == 2
    err = capsys.readouterr().err
    assert "1020 ranks do not spread evenly" in err and "1016 or 1024" in err and "128 x 8 = 1024" in err


def test_default_world_sizes_are_whole_nodes(capsys) -> None:
    assert cli.main(["simulate", *CALL, "--gpus-per-node", "6", "--json"]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [pt["world_size"] for pt in points] == [6 * n for n in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert all(pt["ranks_per_node"] == 6 for pt in points)


def test_an_overlap_that_cannot_fit_is_not_priced(capsys) -> None:
    call = ["simulate", "--numel", "1e6", "--density", "1e-2", "--overlap", "0"]
    assert cli.main([*call, "-P", "8", "128", "--json"]) == 0
    fits, tight = json.loads(capsys.readouterr().out)["points"]
    assert fits["choice"] and not fits["refused"]
    assert tight["predicted_us"] == {} and not tight["choice"]
    assert "overlap by at least 0.221" in tight["refused"]  # ceil((128e4 - 1e6) / 127) / 1e4
    assert cli.main([*call, "-P", "8", "128"]) == 0
    assert "not priced: --overlap 0 does not fit" in capsys.readouterr().out
    assert cli.main([*call, "-P", "128"]) == 2  # nothing left to price
    assert "does not fit" in capsys.readouterr().err
    # explain refuses the same call in the same words
    assert cli.main(["explain", *call[1:], "-P", "128", "--backend", "nccl"]) == 2
    assert "overlap by at least 0.221" in capsys.readouterr().err


def test_explain_prices_an_overlap_that_fits_after_rounding(capsys) -> None:
    # 2 ranks of 10 entries over 15 rows share at least 5 (0.5); 0.55 fits although round(0.55 * 10) is 6
    assert cli.main(["explain", "--numel", "15", "--density", "0.6667", "-P", "2", "--overlap", "0.55"]) == 0

