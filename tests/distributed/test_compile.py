"""torch.compile: the front door called from a compiled function, and a compiled model beside the synchronizer.

The front door is one graph break: Dynamo runs it, and everything it
calls, as plain Python, so the compiled function gives the same result as
the uncompiled one, with the ``eager`` and ``aot_eager`` backends.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import colltune
from colltune.train import SparseGradSync

from harness import run_ranks

N = 1000


def _step(idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    x = vals * 2
    res = colltune.sparse_allreduce(idx, x, N, op="avg")
    t = colltune.topk_allreduce(torch.arange(16.0) * (1 + idx[0]), colltune.TopkState(k=4))
    return res.to_dense().sum() + t.to_dense().sum()


def _rank_compiled_call(rank: int, world_size: int, backend: str) -> dict:
    from torch._dynamo.utils import counters

    from colltune.select.selector import Selector

    # The compiled and the plain call are two calls at one site: online correction could send them to two
    # algorithms (top-k results differ between algorithms), which is not what this test compares.
    colltune.configure(selector=Selector(environ={}, online=False))
    try:
        compiled = torch.compile(_step, backend=backend)
        out = []
        for step in range(3):
            idx = torch.tensor([rank, 10 + step, 500])
            vals = torch.full((3,), float(step + 1))
            out.append((compiled(idx, vals), _step(idx, vals)))
    finally:
        colltune.configure()
    breaks = sum(counters["graph_break"].values())
    return {"pairs": out, "breaks": breaks, "frames": counters["frames"]["total"]}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_front_door_inside_a_compiled_function(backend: str) -> None:
    out = run_ranks(_rank_compiled_call, 2, backend, timeout=240)
    for o in out:
        for compiled, eager in o["pairs"]:
            assert torch.equal(compiled, eager)
        assert o["breaks"] <= 4, o  # the front doors, not colltune's internals
        assert o["frames"] <= 12, o
    assert [float(c) for c, _ in out[0]["pairs"]] == [float(c) for c, _ in out[1]["pairs"]]


class Rec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 8, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).sum(1)).squeeze(1)


def _train(rank: int, compiled: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = Rec()
    run = torch.compile(model, backend="aot_eager") if compiled else model
    sync = SparseGradSync(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync.attach(opt)
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        ids, y = torch.randint(0, 100, (8, 3), generator=g), torch.randn(8, generator=g)
        nn.functional.mse_loss(run(ids), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _rank_compiled_model(rank: int, world_size: int) -> dict:
    return {"compiled": _train(rank, True), "eager": _train(rank, False)}


def test_compiled_model_with_the_synchronizer_outside() -> None:
    out = run_ranks(_rank_compiled_model, 2, timeout=240)
    for o in out:
        assert torch.allclose(o["compiled"], o["eager"], atol=1e-6)
    assert torch.equal(out[0]["compiled"], out[1]["compiled"])
