"""Decisions on NCCL clusters of 8 to 1024 GPUs, from the shipped analytic profile (DGX H100 nodes).

A grid of calls over world size, rows, density, overlap and row width:

* a fully dense tensor goes to ``dense`` at every world size;
* ``allgather`` is never chosen where a rank receives more than 4x dense
  allreduce's bytes while dense is predicted no slower than 2x its time;
* Ok-Topk in top-k mode is never priced above Eq. 3's volume,
  6 k (P-1) / P words of entries (plus its control data);
* along the world size, no call's choice flips back and forth more than
  twice (a choice within 5% of the best is kept, as the selector's
  hysteresis keeps it).

And the paper's BERT runs (3.4e8 parameters, P = 32 to 256, one GPU per
node as on Piz Daint, and 8 per node): allgather-based top-k exceeds dense
volume at 256 GPUs (density 1e-2), and Ok-Topk is the fastest of the three there.
"""

from __future__ import annotations

import itertools

import pytest

from colltune.model.profile import load_profile
from colltune.offline.simulate import Workload, simulate
from colltune.select.selector import model_for_profile, shipped_profile

SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
BERT = 340_000_000


@pytest.fixture(scope="module")
def model():
    return model_for_profile(load_profile(shipped_profile("nccl")), "analytic-nccl.yaml")


def _choices(model, w: Workload, rpn: int = 8, sizes=SIZES):
    """The priced points: world sizes where ``w``'s overlap cannot fit in its rows are left out."""
    return [pt for pt in simulate(model, w, sizes, ranks_per_node=rpn) if not pt.refused]


@pytest.mark.parametrize("n", [2**16, 2**20, 2**24])
@pytest.mark.parametrize("row, dtype", [(1, "float32"), (64, "float32"), (64, "bfloat16"), (64, "float16")])
def test_a_dense_tensor_goes_to_dense_at_every_world_size(model, n: int, row: int, dtype: str) -> None:
    """16-bit rows too: their fp32 sums travel in fp32, but the ranks holding every row reduce them in place."""
    for pt in _choices(model, Workload(n, 1.0, 1.0, row, dtype=dtype)):
        assert pt.choice == "dense", (pt.world_size, pt.predicted_us)


#: Tensors that fit one GPU's memory (a BERT table of rows of 64 does not).
GRID = [(n, d, o, row, dtype) for n, d, o, (row, dtype) in itertools.product(
    (2**20, 2**24, BERT), (1e-4, 1e-3, 1e-2, 5e-2), (0.0, 0.5, 1.0),
    ((1, "float32"), (64, "float32"), (64, "bfloat16"))) if n * row <= 2**31]


@pytest.mark.parametrize("n, density, overlap, row, dtype", GRID)
def test_allgather_is_not_chosen_where_it_moves_far_more_than_dense(model, n, density, overlap, row, dtype) -> None:
    points = _choices(model, Workload(n, density, overlap, row, dtype=dtype))
    for pt in points:
        sent, t = pt.bytes_sent, pt.predicted_us
        if pt.choice == "allgather":
            assert not (sent["allgather"] > 4 * sent["dense"] and t["dense"] <= 2 * t["allgather"]), pt.as_dict()
    assert _flips(points) <= 2, [(pt.choice, {a: round(t) for a, t in pt.predicted_us.items()}) for pt in points]


def _flips(points, margin: float = 0.05) -> int:
    """Count changes of choice along P, a choice kept while within ``margin`` of the best (the selector's hysteresis)."""
    flips, held = 0, points[0].choice
    for pt in points[1:]:
        t = pt.predicted_us
        if t[held] > (1 + margin) * t[pt.choice]:
            flips, held = flips + 1, pt.choice
    return flips


@pytest.mark.parametrize("density", [1e-3, 1e-2])
@pytest.mark.parametrize("rpn", [1, 8])
def test_oktopk_topk_stays_within_eq3(model, density: float, rpn: int) -> None:
    w = Workload(BERT, density, mode="topk")
    k = w.k()
    for pt in _choices(model, w, rpn, (32, 64, 128, 256)):
        p = pt.world_size
        words = 6 * k * (p - 1) / p
        assert pt.bytes_sent["oktopk"] <= words * 4 * 1.05 + 64 * 1024 * p, (p, pt.bytes_sent)


@pytest.mark.parametrize("rpn", [1, 8])
def test_the_papers_bert_runs(model, rpn: int) -> None:
    dense_heavy = _choices(model, Workload(BERT, 1e-2, mode="topk"), rpn, (32, 64, 128, 256))
    assert dense_heavy[-1].bytes_sent["allgather"] > dense_heavy[-1].bytes_sent["dense"]
    for density in (1e-3, 1e-2):
        at_256 = _choices(model, Workload(BERT, density, mode="topk"), rpn, (256,))[0]
        assert at_256.choice == "oktopk", at_256.as_dict()
