"""A learned model is trusted where it was measured and fades into the analytic model beyond.

The shipped gloo profile was measured at P = 2 to 8 on one machine: at P = 16
the selector blends the learned and analytic predictions half and half, from
P = 32 on it uses the analytic model alone, and the reason says so.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from colltune.model.cost_model import FADE_DOUBLINGS, Domain
from colltune.model.features import Features
from colltune.model.profile import load_profile
from colltune.select.selector import Selector, model_for_profile, shipped_profile


def _f(p: int = 4, n: int = 2**16, row: int = 1, dtype: str = "float32") -> Features:
    k = max(1, n // 100)
    return Features.build(numel=n, row_numel=row, dtype=dtype, k_per_rank=[k] * p, union=k * p * 0.75)


@pytest.fixture(scope="module")
def gloo():
    profile = load_profile(shipped_profile("gloo"))
    return profile, model_for_profile(profile, "cpu-gloo.yaml")


def test_the_domain_is_what_was_measured(gloo) -> None:
    profile, model = gloo
    d = model.domain
    assert d == Domain.of(profile.measurements)
    assert d.world_size == (min(m.world_size for m in profile.measurements), max(m.world_size for m in profile.measurements))
    assert d.weight(_f(p=4)) == 1.0 and d.describe(_f(p=4)) is None


@pytest.mark.parametrize("p, weight", [(8, 1.0), (16, 0.5), (32, 0.0), (1024, 0.0)])
def test_the_learned_model_fades_with_the_world_size(gloo, p: int, weight: float) -> None:
    _, model = gloo
    f = _f(p=p)
    assert model.domain.weight(f) == pytest.approx(weight)
    learned = model.learned.predict([f])[0]
    analytic = model.analytic.predict(f)
    got = model.predict(f)
    for i, a in enumerate(model.learned.algorithms_):
        want = math.exp(weight * math.log(learned[i]) + (1 - weight) * math.log(analytic[a]))
        assert got[a] == pytest.approx(want, rel=1e-9)


def test_other_dimensions_fade_too(gloo) -> None:
    _, model = gloo
    d = model.domain
    assert d.weight(_f(n=d.numel[1] * 2)) == pytest.approx(1 - 1 / FADE_DOUBLINGS)
    assert d.weight(_f(row=d.row_bytes[1] // 4 * 4)) == 0.0  # rows of 4x the widest measured bytes
    # A value size never measured lies outside by its factor from the nearest measured one.
    fp32_only = dataclasses.replace(d, value_bytes=(4,))
    assert fp32_only.distances(_f(row=8, dtype="float64")) == {"dtype": pytest.approx(1.0)}
    assert fp32_only.weight(_f(row=8, dtype="float64")) == pytest.approx(1 - 1 / FADE_DOUBLINGS)
    assert "dtype outside the measured values of 4 B" in fp32_only.describe(_f(row=8, dtype="bfloat16"))


def test_row_width_and_dtype_count_in_bytes(gloo) -> None:
    profile, model = gloo
    d = model.domain
    # The shipped profile: float32 scalars (4 B rows) and rows of 64 float32 (256 B), bfloat16 and
    # float16 (128 B) and float64 (512 B): rows of 4..512 B, values of 2, 4 and 8 B.
    assert d.row_bytes == (4, 512) and d.value_bytes == (2, 4, 8)
    assert {m.dtype for m in profile.measurements} == {"float32", "bfloat16", "float16", "float64"}
    # A float32 row of 16 lies between the measured row bytes: inside, the learned model alone.
    assert d.distances(_f(row=16)) == {} and d.weight(_f(row=16)) == 1.0
    # Rows of 256 float32 (1 KiB) are one doubling wider than measured: extrapolation, and the reason says so.
    wide = _f(row=256)
    assert d.distances(wide) == {"row width": pytest.approx(1.0)}
    assert "row width outside the measured rows of 4..512 B" in d.describe(wide)
    # 16-bit and float64 rows of 8 to 32 (16 to 256 B) lie inside: their value sizes and arithmetic were timed.
    for dtype in ("bfloat16", "float16", "float64"):
        for row in (8, 16, 32):
            assert d.distances(_f(row=row, dtype=dtype)) == {} and d.weight(_f(row=row, dtype=dtype)) == 1.0
        assert model.extrapolation(_f(row=32, dtype=dtype)) is None
    assert d.distances(_f(dtype="float64")) == {}  # float64 scalars: 8 B rows
    # bfloat16 scalars: 2 B rows, narrower than any measured row (the value size itself was measured).
    narrow = _f(dtype="bfloat16")
    assert d.distances(narrow) == {"row width": pytest.approx(1.0)}
    assert d.weight(narrow) == pytest.approx(1 - 1 / FADE_DOUBLINGS)
    assert "row width outside the measured rows of 4..512 B" in d.describe(narrow) and "dtype" not in d.describe(narrow)


def test_explain_says_when_it_extrapolates() -> None:
    sel = Selector(environ={})
    inside = sel.explain(_f(p=4), backend="gloo").choice.reason
    far = sel.explain(_f(p=64), backend="gloo").choice.reason
    half = sel.explain(_f(p=16), backend="gloo").choice.reason
    assert "extrapolating" not in inside
    assert "world size outside the measured P 2..8): the analytic model alone" in far
    assert "50% learned, 50% analytic" in half


def test_a_measured_nccl_profile_fades_into_nccls_model(gloo) -> None:
    from colltune.model.cost_model import Network

    profile, _ = gloo
    nccl_profile = dataclasses.replace(profile, meta={**profile.meta, "backend": "nccl", "gpu": "h100",
                                                      "ranks_per_node": 8})
    model = model_for_profile(nccl_profile, "measured-on-nccl")
    assert model.analytic.network == Network("h100", 8)
    far = _f(p=256)
    assert model.domain.weight(far) == 0.0
    assert model.predict(far) == pytest.approx(model.analytic.predict(far))  # NCCL's model alone, far outside


def test_profiling_names_the_gpu_generation(monkeypatch) -> None:
    import torch

    from colltune.offline import profiling

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, gen in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-40GB", "a100"), ("Tesla T4", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        assert profiling.gpu_generation() == gen
