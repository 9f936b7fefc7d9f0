"""The algorithm registry: a fourth algorithm, registered here, flows through every layer.

``Toy`` lives only in this module. It sums like ``dense`` (densify and
``all_reduce``) but declares its own knob and a cost schedule, so the test
sees it reach policy validation, the analytic cost model, the selector,
``explain``, the front door on several ranks and ``bench``, without any
other module naming it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import colltune
from colltune import algorithms
from colltune.algorithms.base import Algorithm, SparseInput, TopkOutput
from colltune.algorithms.comm import Comm
from colltune.algorithms.knobs import Knob
from colltune.algorithms.registry import BUILTIN_NAMES
from colltune.algorithms.schedule import Pricing, Step

from harness import pool
from sparse_cases import case, make_input, reference


class Toy(Algorithm):
    """Densify, ``all_reduce`` in ``chunks`` pieces, extract the union."""

    name = "toy"
    knob_specs = (Knob("chunks", 1, "all_reduce the dense buffer in this many pieces", minimum=1,
                       tune=("exact",), search=(1, 4, False)),)
    TERMS = ("metadata", "values")

    def sparse_allreduce(self, inp: SparseInput, comm: Comm, knobs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.zeros((inp.size, inp.row_numel), dtype=inp.acc_dtype, device=comm.device)
        mask = torch.zeros(inp.size, dtype=torch.float32, device=comm.device)
        if inp.indices.numel():
            buf.index_copy_(0, inp.indices.to(comm.device), inp.values.to(comm.device))
            mask[inp.indices.to(comm.device)] = 1
        for piece in torch.tensor_split(buf, knobs["chunks"]):
            if piece.numel():
                comm.all_reduce(piece)
        comm.all_reduce(mask)
        union = mask.nonzero().view(-1)
        return union, buf.index_select(0, union)

    def topk_allreduce(self, acc: torch.Tensor, state: Any, comm: Comm, knobs: dict[str, Any]) -> TopkOutput:
        total = comm.all_reduce(acc.clone())
        return TopkOutput(indices=None, values=total, sent=None, local_count=acc.numel(), global_count=acc.numel())

    def schedule(self, pricing: Pricing, knobs: dict[str, Any]) -> list[Step]:
        # Priced as nearly free, so that the analytic model always picks it.
        return [pricing.free("metadata", "all_gather"), pricing.local("values", 1.0, 1.0)]


@pytest.fixture
def toy():
    algorithms.register(Toy)
    try:
        yield algorithms.get("toy")
    finally:
        algorithms.unregister("toy")
        colltune.configure()


def test_register_checks_what_it_is_given() -> None:
    with pytest.raises(colltune.ColltuneTypeError, match="Algorithm subclass or instance"):
        algorithms.register(object())
    bad = type("Auto", (Toy,), {"name": "auto"})
    with pytest.raises(colltune.ColltuneValueError, match="other than auto"):
        algorithms.register(bad)
    taken = type("Other", (Toy,), {"name": "dense"})
    with pytest.raises(colltune.ColltuneValueError, match="taken by Dense"):
        algorithms.register(taken)
    assert algorithms.names() == BUILTIN_NAMES


def test_the_toy_is_listed_and_its_knobs_checked(toy: Algorithm) -> None:
    assert algorithms.names() == (*BUILTIN_NAMES, "toy")
    assert colltune.algorithm_names()[-1] == "toy"
    assert toy.check_knobs({"chunks": 3}) == {"chunks": 3}
    with pytest.raises(colltune.ColltuneValueError, match=r"knobs\['chunks'\] of algorithm 'toy' must be >= 1"):
        toy.check_knobs({"chunks": 0})


def test_policies_validate_the_toy_from_its_knob_specs(toy: Algorithm) -> None:
    from colltune.model.policy import PolicyError, parse_policy

    p = parse_policy("version: 1\nrules:\n  - use: toy\n    knobs: {toy: {chunks: 2}}\n")
    assert p.rules[0].use == "toy" and dict(p.rules[0].knobs["toy"]) == {"chunks": 2}
    with pytest.raises(PolicyError, match="allowed knobs: chunks"):
        parse_policy("version: 1\nknobs: {toy: {width: 2}}\n")
    with pytest.raises(PolicyError, match="an integer >= 1"):
        parse_policy("version: 1\nknobs: {toy: {chunks: 0}}\n")


def test_the_analytic_model_prices_and_picks_the_toy(toy: Algorithm) -> None:
    from colltune.model.cost_model import DEFAULT_PRIMITIVES, AnalyticModel
    from colltune.model.features import Features

    model = AnalyticModel(DEFAULT_PRIMITIVES)
    f = Features.build(numel=2**16, row_numel=1, dtype="float32", k_per_rank=[500, 500, 500, 500], union=1200)
    terms = model.terms(f)
    assert list(terms) == [*BUILTIN_NAMES, "toy"]
    assert list(terms["toy"]) == list(Toy.TERMS)
    assert model.select(f) == "toy"


def test_the_selector_and_explain_choose_the_toy(toy: Algorithm) -> None:
    from colltune.model.features import Features
    from colltune.select.selector import Selector, format_explanation

    sel = Selector(profile=None)
    f = Features.build(numel=2**16, row_numel=1, dtype="float32", k_per_rank=[500, 500], union=800)
    e = sel.explain(f)
    text = format_explanation(e)
    assert e.choice.algorithm == "toy", text
    assert "toy" in text


def test_the_explain_command_shows_the_toy(toy: Algorithm, capsys: pytest.CaptureFixture[str]) -> None:
    from colltune import cli

    assert cli.main(["explain", "--numel", "2^16", "--density", "1e-2", "--world-size", "4", "--overlap", "0.5",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "toy" in json.dumps(out)


def _toy_rank(rank: int, world_size: int, c: dict) -> dict:
    algorithms.register(Toy)
    try:
        colltune.configure()
        idx, vals = make_input(c, rank, world_size)
        forced = colltune.sparse_allreduce(idx, vals, c["size"], algorithm="toy", knobs={"chunks": 3})
        auto = colltune.sparse_allreduce(idx, vals, c["size"])
        return {"forced": (forced.algorithm, forced.indices, forced.values),
                "auto": (auto.algorithm, auto.indices, auto.values)}
    finally:
        algorithms.unregister("toy")
        colltune.configure()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_toy_runs_on_every_rank_against_the_reference(world_size: int) -> None:
    c = case(size=4096, dtype="float64", seed=world_size, counts=[40 + 7 * r for r in range(world_size)])
    out = pool(world_size).run(_toy_rank, c, timeout=60)
    ref = reference(c, world_size)
    for rec in out:
        for key in ("forced", "auto"):
            algorithm, idx, vals = rec[key]
            # On one rank nothing moves: auto takes its single-rank shortcut.
            assert algorithm == ("allgather" if key == "auto" and world_size == 1 else "toy"), (key, algorithm)
            assert torch.equal(idx, ref["union"])
            torch.testing.assert_close(vals, ref["dense"][idx], rtol=1e-12, atol=1e-12)
            assert torch.equal(vals, out[0][key][2]), "ranks differ"


def test_the_readme_knob_table_is_the_registry_s() -> None:
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("knob_table", root / "tools" / "knob_table.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.knob_table() in (root / "README.md").read_text()


def _toy_bench_rank(rank: int, world_size: int) -> dict:
    from colltune.offline import bench

    algorithms.register(Toy)
    try:
        colltune.configure()
        contenders = bench.all_contenders()
        cfg = bench.BenchConfig(n=4096, density=1e-2, overlap=0.5, world_size=world_size)
        rec = bench._bench_one(rank, world_size, cfg, contenders, bench.Plan.quick(), bench._Guard(None, 0))
        return {"contenders": contenders, "rec": rec}
    finally:
        algorithms.unregister("toy")
        colltune.configure()


def test_bench_times_the_toy_beside_the_others() -> None:
    out = pool(2).run(_toy_bench_rank, timeout=120)
    got = out[0]
    assert got["contenders"] == ("auto", *BUILTIN_NAMES, "toy", "torch")
    toy = got["rec"]["contenders"]["toy"]
    assert toy["median_ms"] > 0 and toy["max_rel_err"] <= 1e-6  # checked against the exact float64 sum
    assert got["rec"]["auto"]["algorithm"] == "toy"  # priced nearly free, so auto runs it
