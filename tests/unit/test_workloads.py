"""Synthetic inputs with a controlled overlap: the design's definition, deterministic, feasible."""

from __future__ import annotations

import pytest
import torch

from colltune.algorithms.errors import ColltuneValueError
from colltune.offline.workloads import Workload, k_for_density, shared_count


def _measured_overlap(w: Workload) -> float:
    """Return the overlap of the design notes: (K - u) / (K - max k_p), from the index sets."""
    sets = [set(w.make(r)[0].tolist()) for r in range(w.world_size)]
    assert all(len(s) == w.k for s in sets)  # no duplicates within a rank
    total = sum(len(s) for s in sets)
    union = len(set().union(*sets))
    assert union == w.union
    return (total - union) / (total - max(len(s) for s in sets))


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.5, 1.0])
def test_overlap_matches_the_definition(p, overlap):
    w = Workload(10_000, 200, p, overlap, seed=3)
    assert w.overlap == pytest.approx(overlap, abs=1 / 200)
    assert _measured_overlap(w) == pytest.approx(w.overlap, abs=1e-12)


def test_overlap_is_raised_when_n_is_too_small_and_reported():
    # 8 ranks x 2000 disjoint entries do not fit in 10 000 rows.
    w = Workload(10_000, 2_000, 8, 0.0)
    assert w.shared == -(-(8 * 2_000 - 10_000) // 7)
    assert w.union <= 10_000
    assert w.overlap > 0.0 and w.overlap_requested == 0.0
    assert _measured_overlap(w) == pytest.approx(w.overlap)
    # The least feasible: one fewer shared index would not fit.
    s = w.shared - 1
    assert s + 8 * (2_000 - s) > 10_000


def test_same_seed_same_inputs_other_seed_other_inputs():
    a, b, c = Workload(4096, 64, 4, 0.5, seed=1), Workload(4096, 64, 4, 0.5, seed=1), Workload(4096, 64, 4, 0.5, seed=2)
    for r in range(4):
        assert torch.equal(a.make(r)[0], b.make(r)[0]) and torch.equal(a.make(r)[1], b.make(r)[1])
    assert not torch.equal(a.make(0)[0], c.make(0)[0])


def test_rows_and_dtype():
    idx, vals = Workload(100, 10, 2, row_shape=(3, 2), dtype=torch.float16).make(1)
    assert idx.dtype == torch.int64 and idx.shape == (10,)
    assert vals.shape == (10, 3, 2) and vals.dtype == torch.float16
    assert int(idx.min()) >= 0 and int(idx.max()) < 100


def test_indices_are_spread_and_unsorted():
    idx, _ = Workload(2**16, 1000, 2, 0.0).make(0)
    assert int(idx.max()) > 2**15 and int(idx.min()) < 2**15
    assert not bool((idx[1:] > idx[:-1]).all())


def test_k_for_density_and_errors():
    assert k_for_density(2**20, 1e-2) == 10486
    assert k_for_density(100, 1e-9) == 1
    with pytest.raises(ColltuneValueError, match="overlap"):
        shared_count(100, 10, 2, 1.5)
    with pytest.raises(ColltuneValueError, match="k must be <= n"):
        Workload(10, 11, 2)
    with pytest.raises(ColltuneValueError, match="rank"):
        Workload(10, 5, 2).make(2)
