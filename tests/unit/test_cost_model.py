"""Tests of colltune.model.cost_model: the analytic schedules, the learned model, cross-validation."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError

from colltune.algorithms.errors import ColltuneError, ColltuneValueError
from colltune.model.cost_model import (
    ALGORITHMS,
    DEFAULT_PRIMITIVES,
    FEATURE_NAMES,
    PARAM_NAMES,
    AnalyticModel,
    CostModel,
    LearnedCostModel,
    _eval_regressor,
    _export_trees,
    cross_validate,
    default_group,
    feature_vector,
    predict_matrix,
)
from colltune.model.features import Features
from colltune.model.profile import Measurement, Primitive, load_profile, profile_from_measurements, save_profile

REPO = pathlib.Path(__file__).resolve().parents[2]


def _f(n: int = 1 << 20, p: int = 8, density: float = 1e-3, overlap: float = 0.0, row: int = 1,
       dtype: str = "float32") -> Features:
    k = max(1, round(density * n))
    total = p * k
    union = min(n, total - overlap * (total - k))
    return Features.build(numel=n, row_numel=row, dtype=dtype, k_per_rank=[k] * p, union=union)


# -- ground truth for the learned model -------------------------------------------
# Written from the design table, independently of AnalyticModel's schedules, with
# per-algorithm efficiencies and overheads the analytic model does not know.


def _truth(f: Features, alg: str) -> float:
    p, n, e, rb = f.world_size, f.numel, f.entry_bytes, f.row_bytes
    alpha, beta, mem = 25.0, 1 / 8e3, 1 / 60e3
    if alg == "dense":
        return 40 + 4 * (p - 1) * alpha + 2 * (p - 1) / p * (1.15 * n * rb + n) * beta + 3 * n * rb * mem
    if alg == "allgather":
        k = f.k_sum
        return 30 + 1.3 * (p - 1) * alpha + (p - 1) * f.k_max * e * beta + k * math.log2(max(k, 2)) * 6 * mem
    if alg == "hashpart":
        return 70 + 3 * (p - 1) * alpha + (f.k_avg + f.union) * (p - 1) / p * e * beta + 3 * f.k_avg * e * mem
    return 90 + 4 * (p - 1) * alpha + (f.k_avg + 1.2 * f.union) * (p - 1) / p * e * beta + 4 * f.k_avg * e * mem


def _synthetic(seed: int = 0, noise: float = 0.03, world_sizes: tuple[int, ...] = (2, 4, 8)) -> list[Measurement]:
    rng = np.random.default_rng(seed)
    out = []
    for p in world_sizes:
        for n in (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22):
            for density in (1e-4, 1e-3, 1e-2, 0.05, 0.3):
                for overlap in (0.0, 0.5, 1.0):
                    for row in (1, 16):
                        f = _f(n, p, density, overlap, row)
                        for alg in ALGORITHMS:
                            t = _truth(f, alg) * math.exp(rng.normal(0.0, noise))
                            out.append(Measurement.from_features(f, alg, time_us=t, spread_us=0.02 * t, repeats=10))
    return out


@pytest.fixture(scope="module")
def data() -> list[Measurement]:
    return _synthetic()


@pytest.fixture(scope="module")
def fitted(data: list[Measurement]) -> LearnedCostModel:
    return LearnedCostModel(n_estimators=60).fit(data)


# -- analytic model ---------------------------------------------------------------


def test_terms_sum_to_the_prediction_and_follow_the_declared_order() -> None:
    model = AnalyticModel(DEFAULT_PRIMITIVES)
    f = _f(density=0.01, overlap=0.5, row=8, dtype="bfloat16")
    terms, pred = model.terms(f), model.predict(f)
    assert tuple(terms) == ALGORITHMS == tuple(pred)
    for alg in ALGORITHMS:
        assert tuple(terms[alg]) == AnalyticModel.TERMS[alg]
        assert math.isclose(sum(terms[alg].values()), pred[alg], rel_tol=1e-12)
        assert all(v >= 0 for v in terms[alg].values())
        assert math.isclose(float(model.design(f)[alg] @ model.parameter_vector()), pred[alg], rel_tol=1e-9)


def test_message_counts_of_each_schedule() -> None:
    p, n, k = 4, 1 << 16, 100
    f = Features.build(numel=n, row_numel=2, dtype="float16", k_per_rank=[k] * p, union=300.0)
    e = 4 + 2 * 2  # int32 index + two fp16 values
    d = AnalyticModel(DEFAULT_PRIMITIVES, metadata_bytes=48, boundary_period=64, peers_in_flight=4).design(f)
    col = {name: i for i, name in enumerate(PARAM_NAMES)}

    def get(alg: str, name: str) -> float:
        return float(d[alg][col[name]])

    # dense: metadata all_gather; one all_reduce of the fp32 values (the union rides in them), 2(P-1) steps.
    assert get("dense", "all_gather.launch_us") == 1 and get("dense", "all_gather.alpha_us") == p - 1
    assert get("dense", "all_gather.beta_us_per_byte") == (p - 1) * 48
    assert get("dense", "all_reduce.launch_us") == 1 and get("dense", "all_reduce.alpha_us") == 2 * (p - 1)
    assert get("dense", "all_reduce.beta_us_per_byte") == pytest.approx(2 * (p - 1) / p * n * 2 * 4)
    # allgather: metadata and k_max packed entries per rank.
    assert get("allgather", "all_gather.launch_us") == 2 and get("allgather", "all_gather.alpha_us") == 2 * (p - 1)
    assert get("allgather", "all_gather.beta_us_per_byte") == (p - 1) * (48 + k * e)
    assert get("allgather", "all_reduce.launch_us") == 0 and get("allgather", "p2p.alpha_us") == 0
    # oktopk: amortized boundaries (P float64) and counts all_to_all, P-1 rotated
    # messages in ceil((P-1)/peers_in_flight) calls for the split, and as many
    # for the eager gather of the regions (narrow entries: each region with its
    # count, 1/16 room); the metadata record is the one all_gather.
    assert get("oktopk", "all_reduce.launch_us") == pytest.approx(1 / 64)
    assert get("oktopk", "all_reduce.alpha_us") == pytest.approx(2 * (p - 1) / 64)
    assert get("oktopk", "all_reduce.beta_us_per_byte") == pytest.approx(2 * (p - 1) / p * p * 8 / 64)
    # Counts all_to_all on refresh calls only (they ride in the metadata record in between).
    assert get("oktopk", "all_to_all.alpha_us") == pytest.approx((p - 1) / 64)
    assert get("oktopk", "all_to_all.beta_us_per_byte") == pytest.approx((p - 1) * 8 / 64)
    assert get("oktopk", "p2p.launch_us") == 2 and get("oktopk", "p2p.alpha_us") == 2 * (p - 1)
    split_bytes = (p - 1) * (k * p / p / p) * e
    # Each region's message: its count (one entry's room: 8 bytes), then room for ceil(u/P) + 1/16 + 4 entries.
    block = math.ceil(300 / p)
    gather_bytes = (p - 1) * (1 + block + block // 16 + 4) * e
    assert get("oktopk", "p2p.beta_us_per_byte") == pytest.approx(split_bytes + gather_bytes)
    assert get("oktopk", "all_gather.launch_us") == 1 and get("oktopk", "all_gather.alpha_us") == p - 1
    assert get("oktopk", "all_gather.beta_us_per_byte") == (p - 1) * 48


def test_allgather_switches_to_all_to_all_when_padding_is_wasteful() -> None:
    model = AnalyticModel(DEFAULT_PRIMITIVES)
    # 10000 entries of 8 bytes exceed the largest eager slot at P = 4 (64 KiB): a second collective.
    even = Features.build(numel=10**6, row_numel=1, dtype="float32", k_per_rank=[10000] * 4, union=40000)
    skewed = Features.build(numel=10**6, row_numel=1, dtype="float32", k_per_rank=[10000, 100, 100, 100], union=10300)
    col = PARAM_NAMES.index
    assert model.design(even)["allgather"][col("all_gather.launch_us")] == 2  # metadata + padded gather
    assert model.design(skewed)["allgather"][col("all_gather.launch_us")] == 1  # metadata only
    # The slot at its limit carries 8192 entries of each rank; the largest rank's other 1808 go to each peer.
    assert model.design(skewed)["allgather"][col("all_to_all.beta_us_per_byte")] == 3 * (10000 - 65536 // 8) * 8


def test_allgather_entries_that_fit_the_grown_slot_ride_in_the_record() -> None:
    from colltune.algorithms import meta as _meta

    model = AnalyticModel(DEFAULT_PRIMITIVES)
    f = Features.build(numel=10**6, row_numel=1, dtype="float32", k_per_rank=[1000] * 4, union=4000)
    col = PARAM_NAMES.index
    row = model.design(f)["allgather"]
    assert row[col("all_gather.launch_us")] == 1  # the record alone
    header = 8 * len(_meta.FIELDS)
    assert row[col("all_gather.beta_us_per_byte")] == 3 * (header + 8192)  # the slot grown to 8 KiB (8000 B)


def test_oktopk_sends_a_dense_region_once_the_union_outgrows_it() -> None:
    model = AnalyticModel(DEFAULT_PRIMITIVES)
    p, n = 4, 1000
    sparse = Features.build(numel=n, row_numel=1, dtype="float32", k_per_rank=[100] * p, union=400)
    dense = Features.build(numel=n, row_numel=1, dtype="float32", k_per_rank=[300] * p, union=600)
    gather = lambda f: model.terms(f)["oktopk"]["union_gather"]  # noqa: E731
    ag, p2p = DEFAULT_PRIMITIVES["all_gather"], DEFAULT_PRIMITIVES["p2p"]
    # 400 * 8 < 1000 * 4: sparse, the eager gather (point to point, each region with its count in the room of
    # one entry, and room for 1/16 more entries plus 4).
    eager = p2p.launch_us + (p - 1) * p2p.alpha_us + (p - 1) * (1 + 100 + 6 + 4) * 8 * p2p.beta_us_per_byte
    assert gather(sparse) == pytest.approx(eager)
    # 600 * 8 >= 1000 * 4: dense regions, rows and bitmap, all-gathered after the sizes.
    assert gather(dense) == pytest.approx(ag.launch_us + (p - 1) * ag.alpha_us + (p - 1) * (250 * 4 + 32) * ag.beta_us_per_byte)
    assert model.terms(dense)["oktopk"]["sizes_all_gather"] > 0 == model.terms(sparse)["oktopk"]["sizes_all_gather"]


def test_one_rank_pays_no_communication() -> None:
    model = AnalyticModel(DEFAULT_PRIMITIVES)
    d = model.design(_f(p=1, density=0.01))
    for alg in ALGORITHMS:
        comm = [i for i, name in enumerate(PARAM_NAMES) if not name.startswith("local.")]
        assert not d[alg][comm].any()
        assert d[alg][PARAM_NAMES.index("local.beta_us_per_byte")] > 0


def test_dense_communication_does_not_depend_on_sparsity() -> None:
    model = AnalyticModel(DEFAULT_PRIMITIVES)
    a, b = model.terms(_f(density=1e-4)), model.terms(_f(density=0.3, overlap=1.0))
    for term in ("metadata", "mask_all_reduce", "value_all_reduce"):
        assert a["dense"][term] == b["dense"][term]
    assert a["allgather"]["entries_gather"] < b["allgather"]["entries_gather"]


def test_analytic_choices_on_the_shipped_profile() -> None:
    model = AnalyticModel.from_profile(load_profile(REPO / "profiles" / "analytic-nccl.yaml"))
    assert model.select(_f(n=1 << 22, p=8, density=1e-4)) == "allgather"
    # Nearly dense data: dense. (At density 0.5 and overlap 1 Ok-Topk sends fewer bytes than the ring all_reduce
    # of the values, and the model says so.)
    assert model.select(_f(n=1 << 22, p=8, density=0.9, overlap=1.0)) == "dense"
    # Disjoint sets that together cover every row: dense's one all_reduce of the values moves fewer bytes than
    # Ok-Topk's split and gather of the whole union; identical sets (union k) send Ok-Topk.
    assert model.select(_f(n=1 << 22, p=32, density=0.2, overlap=0.0)) == "dense"
    assert model.select(_f(n=1 << 22, p=32, density=0.2, overlap=1.0)) == "oktopk"
    # More overlap helps Ok-Topk (smaller union) and never hurts allgather.
    lo, hi = model.predict(_f(p=16, density=0.05)), model.predict(_f(p=16, density=0.05, overlap=1.0))
    assert hi["oktopk"] < lo["oktopk"] and hi["allgather"] <= lo["allgather"]


def test_parameter_vector_round_trip() -> None:
    model = AnalyticModel(DEFAULT_PRIMITIVES)
    again = AnalyticModel.from_parameter_vector(model.parameter_vector())
    assert again.primitives == model.primitives
    assert len(PARAM_NAMES) == model.parameter_vector().size == 15


@pytest.mark.parametrize(
    "primitives, fragment",
    [
        ({k: v for k, v in DEFAULT_PRIMITIVES.items() if k != "p2p"}, "p2p"),
        ({**DEFAULT_PRIMITIVES, "broadcast": DEFAULT_PRIMITIVES["p2p"]}, "broadcast"),
        ({**DEFAULT_PRIMITIVES, "p2p": Primitive(alpha_us=-1.0, beta_us_per_byte=0.0)}, "alpha_us"),
        ({**DEFAULT_PRIMITIVES, "p2p": {"alpha_us": 1.0}}, "beta_us_per_byte"),
    ],
)
def test_analytic_model_rejects_bad_primitives(primitives: dict, fragment: str) -> None:
    with pytest.raises(ColltuneValueError, match=fragment):
        AnalyticModel(primitives)


def test_feature_vector_layout() -> None:
    f = _f(density=0.01, overlap=0.5)
    v = feature_vector(f, AnalyticModel(DEFAULT_PRIMITIVES))
    assert v.shape == (len(FEATURE_NAMES),) and np.all(np.isfinite(v))
    named = dict(zip(FEATURE_NAMES, v))
    assert named["world_size"] == 8 and named["overlap"] == pytest.approx(0.5)
    assert named["log_dense_bytes"] == pytest.approx(math.log((1 << 20) * 4))
    assert named["log_gather_bytes"] == pytest.approx(math.log1p(f.k_sum * 8))  # 4 B index + 4 B value
    assert named["t.dense"] == pytest.approx(math.log(AnalyticModel(DEFAULT_PRIMITIVES).predict(f)["dense"]))


def test_features_carry_bytes_not_dtype_codes() -> None:
    # The learned correction sees bytes and counts: no dtype code, no element width of its own.
    assert not {"value_bytes", "index_bytes", "log_row_bytes", "log_numel"} & set(FEATURE_NAMES)
    names = list(FEATURE_NAMES)
    base = names[: names.index("t.dense")]
    analytic = AnalyticModel(DEFAULT_PRIMITIVES)

    def vec(row: int, dtype: str) -> dict[str, float]:
        return dict(zip(base, feature_vector(_f(n=1 << 16, p=3, density=0.01, overlap=0.5, row=row, dtype=dtype),
                                             analytic)))

    # A bfloat16 row of 32 is 64 B, as a float32 row of 16: the same entries on the wire; only the dense
    # path differs, which sums bfloat16 in float32 (twice the bytes).
    bf16, fp32 = vec(32, "bfloat16"), vec(16, "float32")
    assert bf16["log_dense_bytes"] == pytest.approx(fp32["log_dense_bytes"] + math.log(2))
    assert {k: v for k, v in bf16.items() if k != "log_dense_bytes"} == {
        k: v for k, v in fp32.items() if k != "log_dense_bytes"}
    # float64 scalars and float32 pairs move the same bytes every way.
    assert vec(1, "float64") == vec(2, "float32")


# -- learned model ----------------------------------------------------------------


def _regret(model: LearnedCostModel, ms: list[Measurement]) -> np.ndarray:
    by_config: dict[tuple, dict[str, float]] = {}
    feats: dict[tuple, Features] = {}
    for m in ms:
        key = (m.numel, m.row_numel, m.world_size, m.k_max, m.k_sum, m.union)
        by_config.setdefault(key, {})[m.algorithm] = m.time_us
        feats[key] = m.features()
    out = []
    for key, times in by_config.items():
        out.append(times[model.select(feats[key])] / min(times.values()))
    return np.asarray(out)


def test_learned_model_recovers_the_argmin_on_held_out_configurations(data: list[Measurement]) -> None:
    rng = np.random.default_rng(7)
    configs = sorted({(m.numel, m.density, m.overlap, m.world_size) for m in data})
    held = {configs[i] for i in rng.choice(len(configs), size=len(configs) // 4, replace=False)}
    train = [m for m in data if (m.numel, m.density, m.overlap, m.world_size) not in held]
    test = [m for m in data if (m.numel, m.density, m.overlap, m.world_size) in held]
    model = LearnedCostModel(n_estimators=60).fit(train)
    regret = _regret(model, test)
    geomean = float(np.exp(np.log(regret).mean()))
    assert geomean < 1.03, geomean
    assert np.percentile(regret, 95) < 1.15
    # The uncalibrated analytic prior is far worse on this cluster; learning is what helps.
    prior = LearnedCostModel(estimator="none", calibrate=False).fit(train)
    assert geomean < float(np.exp(np.log(_regret(prior, test)).mean()))


def test_learned_model_extrapolates_to_a_larger_world_size() -> None:
    train = _synthetic(seed=1, world_sizes=(2, 4, 8))
    test = _synthetic(seed=2, world_sizes=(16,))
    model = LearnedCostModel(n_estimators=60).fit(train)
    regret = _regret(model, test)
    assert float(np.exp(np.log(regret).mean())) < 1.10


def test_calibration_recovers_an_alpha_beta_truth(data: list[Measurement]) -> None:
    truth = AnalyticModel({name: Primitive(alpha_us=3 * p.alpha_us + 1, beta_us_per_byte=2 * p.beta_us_per_byte,
                                           launch_us=p.launch_us / 2) for name, p in DEFAULT_PRIMITIVES.items()})
    feats = [m.features() for m in data[::3]]
    algs = [a for _ in feats for a in ALGORITHMS]
    xs = [f for f in feats for _ in ALGORITHMS]
    ys = [truth.predict(f)[a] for f, a in zip(xs, algs)]
    model = LearnedCostModel(estimator="none").fit(xs, ys, algs)
    pred = model.predict(xs)
    rel = np.abs(pred[np.arange(len(xs)), [ALGORITHMS.index(a) for a in algs]] - ys) / ys
    assert np.median(rel) < 0.01 and rel.max() < 0.1


def test_fit_is_deterministic(data: list[Measurement], fitted: LearnedCostModel) -> None:
    again = LearnedCostModel(n_estimators=60).fit(data)
    X = [m.features() for m in data[::5]]
    np.testing.assert_array_equal(fitted.predict(X), again.predict(X))
    assert json.dumps(fitted.to_dict(), sort_keys=True) == json.dumps(again.to_dict(), sort_keys=True)


def test_fit_accepts_features_with_times(data: list[Measurement]) -> None:
    part = data[::2]
    model = LearnedCostModel(n_estimators=20).fit(
        [m.features() for m in part], [m.time_us for m in part], [m.algorithm for m in part]
    )
    X = [m.features() for m in data[::7]]
    np.testing.assert_array_equal(model.predict(X), LearnedCostModel(n_estimators=20).fit(part).predict(X))


def test_to_dict_round_trip_predicts_identically(
    data: list[Measurement], fitted: LearnedCostModel, tmp_path: pathlib.Path
) -> None:
    plain = fitted.to_dict()
    json.dumps(plain, allow_nan=False)  # plain data only
    X = [m.features() for m in data[::3]]
    np.testing.assert_array_equal(LearnedCostModel.from_dict(plain).predict(X), fitted.predict(X))
    # Through a profile file, as the selector will load it.
    prims = {k: v for k, v in fitted.primitives_.items()}
    path = tmp_path / "measured.yaml"
    save_profile(profile_from_measurements(data, prims, {"backend": "gloo"}, model=plain), path)
    loaded = LearnedCostModel.from_dict(load_profile(path).model)
    np.testing.assert_array_equal(loaded.predict(X), fitted.predict(X))
    assert loaded.predict_times(X[0]) == fitted.predict_times(X[0])
    assert loaded.select(X[0]) == fitted.select(X[0])
    assert loaded.get_params() == fitted.get_params()


@pytest.mark.parametrize("estimator", ["ridge", "rf", "none"])
def test_other_estimators_fit_and_round_trip(data: list[Measurement], estimator: str) -> None:
    every_other = [m for i, m in enumerate(data) if (i // len(ALGORITHMS)) % 2 == 0]  # configurations
    model = LearnedCostModel(estimator=estimator, n_estimators=20, max_depth=6).fit(every_other)
    X = [m.features() for m in data[1::9]]
    pred = model.predict(X)
    assert pred.shape == (len(X), len(ALGORITHMS)) and np.all(pred > 0)
    np.testing.assert_array_equal(LearnedCostModel.from_dict(model.to_dict()).predict(X), pred)


@pytest.mark.parametrize("kind", ["gbr", "rf"])
def test_exported_trees_match_scikit_learn(kind: str) -> None:
    from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor

    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 5))
    y = np.sin(X[:, 0]) + X[:, 1] * X[:, 2] + rng.normal(0, 0.1, 300)
    if kind == "gbr":
        reg = GradientBoostingRegressor(n_estimators=30, max_depth=3, random_state=0).fit(X, y)
        plain = _export_trees(reg.estimators_[:, 0], float(reg.init_.constant_.reshape(-1)[0]), reg.learning_rate)
    else:
        reg = RandomForestRegressor(n_estimators=10, max_depth=6, random_state=0).fit(X, y)
        plain = _export_trees(reg.estimators_, 0.0, 1 / 10)
    Xt = rng.normal(size=(200, 5))
    np.testing.assert_allclose(_eval_regressor(plain, Xt), reg.predict(Xt), rtol=1e-10, atol=1e-12)


def test_not_fitted() -> None:
    model = LearnedCostModel()
    for call in (lambda: model.predict([_f()]), lambda: model.predict_times(_f()), model.to_dict):
        with pytest.raises(NotFittedError):
            call()


def test_is_a_scikit_learn_estimator(fitted: LearnedCostModel) -> None:
    params = fitted.get_params()
    assert params["estimator"] == "gbr" and params["random_state"] == 0 and params["n_estimators"] == 60
    fresh = clone(fitted)
    assert not hasattr(fresh, "residual_") and fresh.get_params() == params
    assert fitted.algorithms_ == ALGORITHMS and fitted.n_features_in_ == len(FEATURE_NAMES)
    assert set(fitted.overhead_us_) == set(ALGORITHMS)


@pytest.mark.parametrize(
    "kwargs, fit_args, fragment",
    [
        ({"estimator": "xgboost"}, None, "'estimator' parameter"),
        ({"n_estimators": 0}, None, "n_estimators"),
        ({}, "unknown_alg", "algorithm"),
        ({}, "empty", "empty"),
        ({}, "half", "`y`"),
    ],
)
def test_fit_rejects_bad_input(data: list[Measurement], kwargs: dict, fit_args: str | None, fragment: str) -> None:
    model = LearnedCostModel(**kwargs)
    with pytest.raises(ColltuneError, match=fragment):
        if fit_args is None:
            model.fit(data[:30])
        elif fit_args == "unknown_alg":
            model.fit([Measurement(**{**data[0].to_dict(), "algorithm": "ring"})])
        elif fit_args == "empty":
            model.fit([])
        else:
            model.fit([m.features() for m in data[:3]], y=[1.0, 2.0, 3.0])


def test_from_dict_rejects_foreign_or_damaged_data(fitted: LearnedCostModel) -> None:
    good = fitted.to_dict()
    with pytest.raises(ColltuneValueError, match="type"):
        LearnedCostModel.from_dict({"type": "pickle"})
    with pytest.raises(ColltuneValueError, match="feature"):
        LearnedCostModel.from_dict({**good, "feature_names": ["log_numel"]})
    broken = json.loads(json.dumps(good))
    broken["residual"]["dense"]["left"] = "1 2"
    with pytest.raises(ColltuneValueError, match="residual.dense"):
        LearnedCostModel.from_dict(broken)
    missing = {k: v for k, v in good.items() if k != "overhead_us"}
    with pytest.raises(ColltuneValueError, match="overhead_us"):
        LearnedCostModel.from_dict(missing)


# -- one contract -----------------------------------------------------------------

_CALLS = [_f(), _f(p=2, density=0.05, overlap=1.0), _f(n=1 << 16, p=4, density=0.3, row=16), _f(p=64, density=1e-4)]


def test_every_model_prices_one_call_and_many_alike(data: list[Measurement], fitted: LearnedCostModel) -> None:
    from colltune.select.selector import model_for_profile

    profile = profile_from_measurements(data, dict(fitted.primitives_), {"backend": "gloo"}, model=fitted.to_dict())
    selector_model = model_for_profile(profile, "measured")  # the learned model, fading out beyond P=8
    for model in (AnalyticModel(DEFAULT_PRIMITIVES), fitted, selector_model):
        assert isinstance(model, CostModel)
        many = model.predict_times_many(_CALLS)
        assert len(many) == len(_CALLS) and model.predict_times_many([]) == []
        for f, got in zip(_CALLS, many):
            assert got == pytest.approx(model.predict_times(f), rel=1e-12)
            assert all(t > 0 for t in got.values())
    # The learned model's batch is its scikit-learn prediction, column by column.
    assert fitted.predict_times_many(_CALLS) == [dict(zip(fitted.algorithms_, r)) for r in fitted.predict(_CALLS).tolist()]
    class OneCallOnly:  # half the contract: not a cost model
        def predict_times(self, features: Any) -> dict[str, float]:
            return {}

    assert not isinstance(OneCallOnly(), CostModel)


def test_offline_tools_take_either_model(data: list[Measurement], fitted: LearnedCostModel) -> None:
    from colltune.algorithms import registry
    from colltune.offline.active import Candidate, selection_regret
    from colltune.offline.report import decision_grid

    analytic = AnalyticModel(DEFAULT_PRIMITIVES)
    partial = LearnedCostModel(estimator="none").fit([m for m in data if m.algorithm != "oktopk"])  # prices two
    three = ("dense", "allgather", "oktopk")
    cands = [Candidate(str(i), f, (f.world_size, 0.0, 0.0, f.overlap, f.dtype), truth=analytic.predict(f))
             for i, f in enumerate(_CALLS)]
    densities, worlds = [1e-4, 1e-2, 0.3], [2, 8]
    for model in (analytic, fitted, partial):
        choice, speed = decision_grid(model, densities, worlds, lambda d, p: _f(p=p, density=d))
        assert choice.shape == speed.shape == (2, 3) and np.all(speed > 0)
        # An algorithm the model does not price is never chosen: the matrix holds inf for it.
        assert [registry.names()[j] for j in choice.ravel()] == [model.select(_f(p=p, density=d))
                                                                for p in worlds for d in densities]
        regret = selection_regret(model, cands, three)
        assert 1.0 <= regret["geomean"] < math.inf and 0.0 <= regret["optimal_fraction"] <= 1.0
    assert selection_regret(analytic, cands, three)["optimal_fraction"] == 1.0
    # The matrix the offline tools read: a column of inf for the algorithm the partial model never measured.
    matrix = predict_matrix(partial, _CALLS, three)
    assert np.isinf(matrix[:, 2]).all() and np.isfinite(matrix[:, :2]).all() and matrix.shape == (len(_CALLS), 3)


# -- cross-validation ---------------------------------------------------------------


def test_cross_validate_reports_error_and_regret(data: list[Measurement]) -> None:
    report = cross_validate(data, model=LearnedCostModel(n_estimators=50), n_splits=3)
    assert report["n_folds"] == 3 and report["n_measurements"] == len(data)
    # Groups are (n, density, overlap, P): both row sizes share one.
    assert report["n_groups"] == len({default_group(m) for m in data}) < len(data) // 3
    assert set(report["per_algorithm"]) == set(ALGORITHMS)
    for stats in report["per_algorithm"].values():
        assert stats["median_rel_error"] < 0.1 and stats["p90_rel_error"] >= stats["median_rel_error"]
    regret = report["regret"]
    assert regret["n_configs"] == len({(m.numel, m.row_numel, m.world_size, m.k_max, m.k_sum, m.union) for m in data})
    assert 1.0 <= regret["geomean"] < 1.03 and regret["p95"] >= 1.0 and 0 < regret["optimal_fraction"] <= 1


def test_cross_validate_leave_one_group_out(data: list[Measurement]) -> None:
    small = [m for m in data if m.world_size == 4 and m.numel == 1 << 18 and m.row_numel == 1]
    report = cross_validate(small, groups=lambda m: m.density, model=LearnedCostModel(estimator="ridge"))
    assert report["n_groups"] == report["n_folds"] == 5
    assert report["regret"]["n_configs"] == len(small) // len(ALGORITHMS)
    with pytest.raises(ColltuneValueError, match="one label per measurement"):
        cross_validate(small, groups=[0, 1])
    with pytest.raises(ColltuneValueError, match="at least 2 groups"):
        cross_validate(small, groups=lambda m: 0)


def test_an_nccl_profile_prices_the_hosts_cost_of_a_call():
    from colltune.algorithms import get
    from colltune.model.cost_model import AnalyticModel, Network
    from colltune.model.features import Features
    from colltune.model.profile import load_profile
    from colltune.select.selector import shipped_profile

    prof = load_profile(shipped_profile("nccl"))
    net = Network.of(prof.meta)
    assert (net.host_call_us, net.host_kernel_us, net.host_sync_us) == (423.0, 0.0, 63.0)
    feats = Features.build(numel=1 << 20, row_numel=1, dtype="float32", k_per_rank=[1000] * 8, union=6000)
    terms = AnalyticModel(prof.primitives, network=net).terms(feats)
    for alg, t in terms.items():
        assert t["host"] == 423.0 + 63.0 * get(alg).HOST_SYNCS["exact"], alg
    # With a per-kernel figure (the H200 file's fit): allgather's declared kernels (the device-path audit's
    # count, which tests/cli/test_audit_tools.py holds) and 2 reads, so 343 + 16 k + 67 * 2 us (957 at k = 30);
    # top-k dense, its all_reduce of the accumulator, its declared kernels and 1 read.
    fitted = Network.of({**prof.meta, "host_call_us": 343, "host_kernel_us": 16, "host_sync_us": 67})
    k = get("allgather").HOST_KERNELS["exact"]
    assert AnalyticModel(prof.primitives, network=fitted).terms(feats)["allgather"]["host"] == 343.0 + 16.0 * k + 134.0
    assert fitted.host_us("dense", "topk") == 343.0 + 16.0 * get("dense").HOST_KERNELS["topk"] + 67.0
    # Without a network (gloo profiles) or without the figures, no host term.
    assert "host" not in AnalyticModel(prof.primitives).terms(feats)["dense"]
    bare = Network.of({**prof.meta, "host_call_us": None, "host_sync_us": None, "host_kernel_us": None})
    assert "host" not in AnalyticModel(prof.primitives, network=bare).terms(feats)["dense"]


def test_a_negative_host_cost_is_refused(tmp_path):
    from colltune.model.profile import ProfileError, load_profile
    from colltune.select.selector import shipped_profile

    shipped = open(shipped_profile("nccl")).read()
    for key, text in (("host_sync_us", shipped.replace("host_sync_us: 63", "host_sync_us: -1")),
                      ("host_kernel_us", shipped.replace("host_sync_us: 63", "host_sync_us: 63\n  host_kernel_us: -1"))):
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ProfileError, match=key):
            load_profile(path)
