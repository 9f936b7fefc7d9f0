"""Smoke test of ``tools/train_soak.py``: training steps under ``SparseGradSync`` or DDP's hook, every step checked."""

from __future__ import annotations

import pytest
import torch

from harness import import_tool


@pytest.fixture(scope="module")
def train_soak():
    return import_tool("train_soak")


def test_short_training_soak_checks_every_step(train_soak, capsys):
    assert train_soak.main(["--ranks", "2", "--steps", "12", "--every", "4", "--seed", "1"]) == 0
    printed = capsys.readouterr().out
    assert "every gradient checked against the float64 average on 12 steps: 0 wrong" in printed
    assert "3 times (every 4 steps and at the end): 0 differed" in printed


def test_a_training_soak_on_the_device_path_unfused_with_topk(train_soak):
    r = train_soak.run(3, 10, 5, 2, algorithm="oktopk", dense="topk", fuse=False, device_path=True)
    assert r["wrong"] == [] and r["mismatches"] == [] and "topk" in r["routes"] and r["asynchronous"] > 0
    assert r["compared"] == 2 and r["checked"] == 10
    assert r["ledger"] == 4 and r["broken"] == []  # the MLP's error feedback, checked twice


@pytest.mark.parametrize("algorithm,device", [("allgather", False), ("oktopk", True)])
def test_a_training_soak_under_ddp_and_its_hook(train_soak, capsys, algorithm, device):
    argv = ["--ranks", "2", "--steps", "9", "--every", "3", "--hook", "ddp", "--algorithm", algorithm]
    assert train_soak.main(argv + (["--device-path"] if device else [])) == 0
    printed = capsys.readouterr().out
    assert f"DDP with colltune_hook, top-k {algorithm}" in printed and "routes dense, topk" in printed
    assert "first 5 steps (DDP's dense warm-up) checked against the float64 average on 9 steps: 0 wrong" in printed
    assert "error feedback of 10 parameters checked every 3 steps (fed = delivered + held): 0 broken" in printed


def test_the_ddp_soak_takes_only_a_compressing_algorithm(train_soak, capsys):
    with pytest.raises(SystemExit):
        train_soak.main(["--hook", "ddp", "--algorithm", "dense"])
    assert "--hook ddp compresses with one of" in capsys.readouterr().err


def test_residuals_come_out_parameter_by_parameter(train_soak):
    from types import SimpleNamespace

    numels = {"a": 2, "b": 3, "c": 1}
    states = {"a|b": SimpleNamespace(residual=torch.arange(5.0)), "c": SimpleNamespace(residual=None),
              "b": SimpleNamespace(residual=torch.ones(3))}  # b held twice: summed, so the ledger sees it twice
    got = train_soak.residuals(states, numels)
    assert sorted(got) == ["a", "b"]
    assert got["a"].residual.tolist() == [0.0, 1.0] and got["b"].residual.tolist() == [3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="'bucket0.1\\[3\\]'"):
        train_soak.residuals({"bucket0.1[3]": SimpleNamespace(residual=torch.ones(3))}, numels)
    with pytest.raises(ValueError, match=r"'a\|c'"):
        train_soak.residuals({"a|c": SimpleNamespace(residual=torch.ones(4))}, numels)


@pytest.mark.parametrize("hook", ["attach", "backward"])
def test_a_training_soak_through_the_optimizer_or_backward_hooks(train_soak, hook):
    r = train_soak.run(2, 8, 4, 3, device_path=True, hook=hook)
    assert r["wrong"] == [] and r["mismatches"] == [] and r["checked"] == 8
    assert r["asynchronous"] == (8 if hook == "backward" else 0)


@pytest.mark.parametrize("hook,dense,algorithm", [("backward", "topk", "auto"), ("ddp", "allreduce", "allgather")])
def test_a_training_soak_with_uneven_inputs_under_join(train_soak, capsys, hook, dense, algorithm):
    """Rank q trains 4 q steps fewer, under Join: rank 0 checks every step against the average over P of what
    the ranks still training computed; the parameters and the error feedback are checked after the last join."""
    argv = ["--ranks", "3", "--steps", "14", "--uneven", "4", "--seed", "4", "--hook", hook, "--dense", dense,
            "--algorithm", algorithm]
    assert train_soak.main(argv) == 0
    printed = capsys.readouterr().out
    assert "rank q 4 q steps fewer, under Join" in printed and "on 14 steps: 0 wrong" in printed
    assert "checked after every rank joined (fed = delivered + held): 0 broken" in printed
    assert "1 times (after every rank joined): 0 differed" in printed


def test_the_uneven_soak_leaves_the_last_rank_a_step(train_soak, capsys):
    with pytest.raises(SystemExit):
        train_soak.main(["--ranks", "3", "--steps", "8", "--uneven", "4"])
    assert "--uneven G must leave the last rank a step" in capsys.readouterr().err


def test_wrong_names_a_gradient_off_its_average(train_soak):
    torch.manual_seed(0)
    model = train_soak.Model()
    g = torch.Generator().manual_seed(4)
    batches = [train_soak.draw_batch(g, hot=True) for _ in range(2)]
    ref = train_soak.reference(model, batches)

    def sparse(dense: torch.Tensor, rows: list[int]) -> torch.Tensor:  # COO over the first dimension, as synced
        at = torch.tensor(sorted(rows), dtype=torch.long)
        return torch.sparse_coo_tensor(at.view(1, -1), dense[at], dense.shape, check_invariants=True)

    for name, param in model.named_parameters():  # the average itself, put on the model: right
        avg, _, some = ref[name]
        param.grad = None if not some else (sparse(avg.float(), some) if name.startswith("tables.") else avg.float())
    assert train_soak.wrong(model, ref, True) == []
    avg, _, rows = ref["tables.2.weight"]
    row = min(rows)
    off = avg.float().clone()
    off[row] *= 1.001
    model.tables[2].weight.grad = sparse(off, rows)
    said = train_soak.wrong(model, ref, True)
    assert len(said) == 1 and said[0].startswith("tables.2.weight: ") and "values off the average" in said[0]
    model.tables[2].weight.grad = sparse(avg.float(), rows - {row})
    assert f"rows [{row}] missing, [] extra" in train_soak.wrong(model, ref, True)[0]
    extra = min(set(range(1000)) - rows)
    model.tables[2].weight.grad = sparse(avg.float(), rows | {extra})  # a zero row more: wrong too
    assert train_soak.wrong(model, ref, True) == [f"tables.2.weight: rows [] missing, [{extra}] extra"]
    model.tables[2].weight.grad = sparse(avg.float(), rows)
    model.mlp[0].weight.grad = None
    assert train_soak.wrong(model, ref, True) == ["mlp.0.weight: no gradient, but some rank had one"]
    assert train_soak.wrong(model, ref, False) == []  # the MLP not checked
    model.tables[2].weight.grad = None
    assert f"tables.2.weight: no gradient, but the ranks' bags name {len(rows)} rows" in train_soak.wrong(
        model, ref, False)
    empty = dict(ref, **{"tables.2.weight": (avg, ref["tables.2.weight"][1], set())})
    model.tables[2].weight.grad = sparse(avg.float(), rows)
    assert "tables.2.weight: a gradient, but the ranks' bags name no row" in train_soak.wrong(model, empty, False)


@pytest.mark.slow
@pytest.mark.parametrize("ranks,seed,algorithm,fuse,hook", [(3, 11, "auto", True, "none"),
                                                         (4, 12, "allgather", False, "backward")])
def test_a_longer_training_soak_finds_every_gradient_right(train_soak, ranks, seed, algorithm, fuse, hook):
    """150 steps on the device path: every sparse and dense gradient within the bound, the ranks alike."""
    r = train_soak.run(ranks, 150, 25, seed, algorithm=algorithm, fuse=fuse, device_path=True, hook=hook)
    assert r["wrong"] == [] and r["mismatches"] == [] and r["asynchronous"] > 20 and r["checked"] == 150


@pytest.mark.slow
def test_a_longer_ddp_soak_keeps_every_gradient_fed_in():
    """100 steps of DDP with the hook at P = 3, ``auto`` choosing per bucket part: no error feedback broken."""
    r = import_tool("train_soak").run(3, 100, 20, 13, algorithm="auto", hook="ddp")
    assert r["wrong"] == [] and r["broken"] == [] and r["mismatches"] == [] and r["checked"] == 100
