"""Active profiling: measure where the algorithm choice is least certain, not on a fixed grid.

A fixed grid spends most of its measurements where one algorithm wins by a
wide margin and any model gets the decision right. Active profiling measures
one configuration at a time, each chosen where the current model's decision
is least certain, and refits after each measurement.

The acquisition: the expected regret of the decision
------------------------------------------------------

For a candidate call ``x`` the model predicts each algorithm's log time; a
small bootstrap ensemble of the same model (fitted on resampled
configurations) gives their spread. With ``c`` the predicted fastest
algorithm, every other algorithm ``a`` at a predicted log-time gap
``m_a = log t_a - log t_c >= 0`` with uncertainty
``s_a = sqrt(sd_c^2 + sd_a^2 + 2 noise^2)`` could in truth be faster
(``noise``: the median standard error of the medians measured so far, from
their recorded spread, at least 5%); the expected log-regret of choosing
``c`` is (for a Gaussian error)::

    acq(x) = sum_a  s_a * pdf(m_a / s_a) - m_a * cdf(-m_a / s_a)

It is large where predicted times are close (small ``m``) and where the
ensemble disagrees (large ``s``), and near zero where one algorithm wins by
far more than the model's uncertainty. Before anything is measured, the
alpha-beta model of the profile's primitives (:class:`~colltune.model.cost_model.AnalyticModel`)
predicts, with a wide prior uncertainty.

Optuna chooses the configuration: each step runs a small study whose trials
suggest a point of the configuration space (world size, ``log2 n``,
``log10 density``, overlap, dtype), snapped to the nearest candidate not yet
measured, and whose objective is ``acq``; the best trial's candidate is
measured next. (TPE over a few dozen trials, warm-started with the previous
step's best candidates.)

Two ways to run it
------------------

* **Live** (``colltune profile --active``): the candidates are the grid's
  configurations, measuring is :func:`colltune.offline.profiling.measure_config` on the
  ranks (rank 0 chooses, every rank measures), each measurement goes to the
  journal, and the profile holds what was measured.
* **Simulated** (``colltune profile --active --simulate PROFILE``): a profile
  that measured a whole grid is replayed. Its configurations are split into
  a held-out test set and a training pool. The *fixed grid* fits the model on
  the whole pool; *active* and *random* (the pool in random order) start
  from nothing, and "measuring" a configuration means reading its stored
  measurements. After each measurement the model is refitted and its
  selection regret on the test set computed: the geometric mean over test
  configurations of ``time(chosen) / time(fastest)``, with measured times.
  Reported: how many configurations each strategy needs to reach the fixed
  grid's regret. Nothing is measured, so the comparison is exact for those
  stored measurements; it says nothing about measurement noise beyond what
  the stored medians carry.

Example:
    >>> from colltune.offline.active import simulate
    >>> result = simulate(load_profile("profiles/cpu-gloo-grid.yaml"), seeds=3)  # doctest: +SKIP
    >>> result["summary"]["ratio_median"]                                       # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from colltune.algorithms.registry import BUILTIN_NAMES
from colltune.model.profile import Measurement, Primitive, Profile, load_profile

if TYPE_CHECKING:  # the cost models are imported when a model is fitted
    from colltune.model.cost_model import CostModel, LearnedCostModel

__all__ = [
    "Candidate",
    "ActiveChooser",
    "candidates_from_profile",
    "selection_regret",
    "simulate",
    "format_simulation",
    "run_live",
]

logger = logging.getLogger(__name__)

_ALGS: tuple[str, ...] = BUILTIN_NAMES  # what a profile measures
#: Log-time uncertainty of the alpha-beta model before anything is measured.
PRIOR_SIGMA = 0.5
#: Log-time measurement noise assumed on top of the ensemble spread (5%).
NOISE_SIGMA = 0.05


@dataclass
class Candidate:
    """One configuration that can be measured.

    Attributes:
        key: its stable name (:attr:`colltune.offline.profiling.ProfileConfig.key`).
        features: the call's :class:`~colltune.model.features.Features` (exact union).
        coords: ``(world_size, log2 n, log10 density, overlap, dtype)``, what Optuna suggests.
        measured: simulation only: its stored measurement per algorithm.
        config: live only: the :class:`~colltune.offline.profiling.ProfileConfig` to measure.
        truth: simulation only: the times (us) regret is scored against, per
            algorithm; ``None`` scores against ``measured``.
    """

    key: str
    features: Any
    coords: tuple[int, float, float, float, str]
    measured: dict[str, Measurement] = field(default_factory=dict)
    config: Any = None
    truth: dict[str, float] | None = None


def _coords(f: Any) -> tuple[int, float, float, float, str]:
    return (int(f.world_size), math.log2(f.numel), math.log10(max(f.density, 1e-12)), float(f.overlap), str(f.dtype))


def candidates_from_profile(profile: Profile, algorithms: Sequence[str] = _ALGS) -> list[Candidate]:
    """Group a profile's measurements by configuration; keep those measured with every algorithm."""
    from colltune.offline.profiling import measurement_key

    by: dict[str, dict[str, Measurement]] = {}
    for m in profile.measurements:
        by.setdefault(measurement_key(m), {})[m.algorithm] = m
    out = []
    for key in sorted(by):
        ms = by[key]
        if all(a in ms for a in algorithms):
            f = ms[algorithms[0]].features()
            out.append(Candidate(key, f, _coords(f), {a: ms[a] for a in algorithms}))
    return out


def candidates_from_configs(configs: Sequence[Any]) -> list[Candidate]:
    """Return the candidates of live profiling: one per :class:`~colltune.offline.profiling.ProfileConfig`."""
    out = []
    for c in configs:
        f = c.features()
        out.append(Candidate(c.key, f, _coords(f), config=c))
    return out


# --------------------------------------------------------------------------- models


def _model(primitives: Mapping[str, Primitive], **kw: Any) -> LearnedCostModel:
    from colltune.model.cost_model import LearnedCostModel

    return LearnedCostModel(primitives={k: p.to_dict() for k, p in primitives.items()}, **kw)


def _log_predictions(model: CostModel, feats: Sequence[Any], algorithms: Sequence[str]) -> np.ndarray:
    """Return ``log(predicted time)``, shape ``(len(feats), len(algorithms))`` (``inf`` where the model has no price)."""
    from colltune.model.cost_model import predict_matrix

    return np.log(np.maximum(predict_matrix(model, feats, algorithms), 1e-3))


def selection_regret(model: CostModel, cands: Sequence[Candidate], algorithms: Sequence[str] = _ALGS) -> dict[str, float]:
    """Return the selection regret of ``model`` on candidates with stored measurements.

    Returns:
        ``{"geomean", "mean", "p95", "max", "optimal_fraction"}`` of
        ``time(chosen) / time(fastest)`` over ``cands``.
    """
    if not cands:
        return {"geomean": float("nan"), "mean": float("nan"), "p95": float("nan"), "max": float("nan"),
                "optimal_fraction": float("nan")}
    lp = _log_predictions(model, [c.features for c in cands], algorithms)
    chosen = np.argmin(lp, axis=1)
    t = np.array([[c.truth[a] if c.truth is not None else c.measured[a].time_us for a in algorithms] for c in cands])
    r = t[np.arange(len(cands)), chosen] / t.min(axis=1)
    return {"geomean": float(np.exp(np.mean(np.log(r)))), "mean": float(np.mean(r)),
            "p95": float(np.percentile(r, 95)), "max": float(r.max()), "optimal_fraction": float(np.mean(r <= 1.0))}


def _fit(measurements: Sequence[Measurement], primitives: Mapping[str, Primitive], **kw: Any) -> CostModel:
    from colltune.model.cost_model import AnalyticModel

    if not measurements:
        return AnalyticModel(primitives)
    return _model(primitives, **kw).fit(list(measurements))


# --------------------------------------------------------------------------- the chooser


def expected_regret(logp: np.ndarray, sd: np.ndarray, noise: float = NOISE_SIGMA) -> np.ndarray:
    """Return the acquisition of each row: the expected log-regret of picking the row's predicted fastest.

    Args:
        logp: mean log-time predictions, ``(candidates, algorithms)``.
        sd: their standard deviations, same shape.
        noise: log-time measurement noise added to every prediction.
    """
    from scipy.stats import norm

    best = np.argmin(logp, axis=1)
    rows = np.arange(logp.shape[0])
    m = logp - logp[rows, best][:, None]
    s = np.sqrt(sd**2 + sd[rows, best][:, None] ** 2 + 2 * noise**2)
    z = m / s
    eg = s * norm.pdf(z) - m * norm.cdf(-z)
    eg[rows, best] = 0.0
    return eg.sum(axis=1)


class ActiveChooser:
    """Pick the next configuration to measure: Optuna maximizes the decision's expected regret.

    Args:
        candidates: what may be measured.
        primitives: the profile's alpha-beta constants (the prior model).
        algorithms: the algorithms compared.
        ensemble: bootstrap members that give the prediction spread.
        trials: Optuna trials per choice.
        init: the first choices are a space-filling design (Optuna's
            quasi-Monte Carlo sampler, snapped to candidates), so that the
            model is calibrated over the whole space before the acquisition
            steers it; default ``min(12, max(4, len(candidates) // 40))``.
        explore_every: after the start, every this-many-th choice is the
            next space-filling point instead (0: never), so that the model
            keeps seeing the whole space while the acquisition refines the
            boundaries.
        seed: seed of the bootstrap and of the sampler.
        member_kw: keyword arguments of the ensemble members' :class:`~colltune.model.cost_model.LearnedCostModel`.

    Call :meth:`choose` with what was measured so far; it returns a candidate
    not measured yet (``None`` when none is left).
    """

    def __init__(
        self,
        candidates: Sequence[Candidate],
        primitives: Mapping[str, Primitive],
        *,
        algorithms: Sequence[str] = _ALGS,
        ensemble: int = 4,
        trials: int = 40,
        seed: int = 0,
        member_kw: Mapping[str, Any] | None = None,
        init: int | None = None,
        explore_every: int = 0,
    ) -> None:
        self.candidates = list(candidates)
        self.primitives = dict(primitives)
        self.algorithms = tuple(algorithms)
        self.ensemble = int(ensemble)
        self.trials = int(trials)
        self.seed = int(seed)
        self.member_kw = dict(member_kw or {"n_estimators": 30, "learning_rate": 0.25})
        self._rng = np.random.default_rng(seed)
        self._step = 0
        self._warm: list[int] = []
        ws = sorted({c.coords[0] for c in self.candidates})
        dts = sorted({c.coords[4] for c in self.candidates})
        self._ws, self._dts = ws, dts
        X = np.array([self._vec(c.coords) for c in self.candidates]) if self.candidates else np.zeros((0, 5))
        self._X = X
        self._lo = X.min(axis=0) if len(X) else np.zeros(5)
        self._hi = X.max(axis=0) if len(X) else np.ones(5)
        self.last_acquisition: float = float("nan")
        self.init = min(12, max(4, len(self.candidates) // 40)) if init is None else int(init)
        self.explore_every = int(explore_every)
        self._qmc: Any = None

    def _vec(self, coords: Sequence[Any]) -> list[float]:
        p, ln, ld, o, dt = coords
        return [float(self._ws.index(p)) if p in self._ws else 0.0, float(ln), float(ld), float(o),
                float(self._dts.index(dt)) if dt in self._dts else 0.0]

    def _snap(self, coords: Sequence[Any], free: np.ndarray) -> int:
        """Return the index of the free candidate nearest ``coords`` (normalized; world size and dtype exact first)."""
        v = np.array(self._vec(coords))
        span = np.where(self._hi > self._lo, self._hi - self._lo, 1.0)
        d = (((self._X - v) / span) ** 2)
        d[:, 0] *= 100.0  # another world size or dtype only when none of this one is left
        d[:, 4] *= 100.0
        dist = d.sum(axis=1)
        dist[~free] = np.inf
        return int(np.argmin(dist))

    def _models(self, measured: Sequence[Measurement], model: CostModel | None) -> tuple[CostModel, list[CostModel]]:
        """Return the model (fitted on everything measured) and the bootstrap members (resampled configurations)."""
        if not measured:
            from colltune.model.cost_model import AnalyticModel

            return AnalyticModel(self.primitives), []
        from colltune.offline.profiling import measurement_key

        by: dict[str, list[Measurement]] = {}
        for m in measured:
            by.setdefault(measurement_key(m), []).append(m)
        keys = sorted(by)
        members = []
        for _ in range(self.ensemble):
            pick = self._rng.integers(0, len(keys), size=len(keys))
            ms = [m for j in pick for m in by[keys[j]]]
            members.append(_fit(ms, self.primitives, **self.member_kw))
        return (model if model is not None else _fit(measured, self.primitives)), members

    @staticmethod
    def noise_of(measured: Sequence[Measurement]) -> float:
        """Return the log-time noise of a measured time: the median standard error of the medians (at least 5%)."""
        se = [1.2533 * m.spread_us / 1.349 / math.sqrt(max(1, m.repeats)) / m.time_us
              for m in measured if m.time_us > 0]
        return max(NOISE_SIGMA, float(np.median(se))) if se else NOISE_SIGMA

    def _acquisition(self, main: CostModel, members: Sequence[CostModel], idx: Sequence[int], n_configs: int,
                     noise: float = NOISE_SIGMA) -> np.ndarray:
        feats = [self.candidates[i].features for i in idx]
        lp = _log_predictions(main, feats, self.algorithms)
        if members:
            sd = np.stack([_log_predictions(m, feats, self.algorithms) for m in members]).std(axis=0)
        else:
            sd = np.zeros_like(lp)
        if n_configs < 3:  # no data, or a bootstrap of one or two configurations: keep the prior's width
            sd = np.maximum(sd, PRIOR_SIGMA)
        return expected_regret(lp, sd, noise)

    def _distributions(self) -> dict[str, Any]:
        import optuna

        lo, hi = self._lo, self._hi
        return {
            "world_size": optuna.distributions.CategoricalDistribution(self._ws),
            "log2_n": optuna.distributions.FloatDistribution(float(lo[1]), float(max(hi[1], lo[1] + 1e-9))),
            "log10_density": optuna.distributions.FloatDistribution(float(lo[2]), float(max(hi[2], lo[2] + 1e-9))),
            "overlap": optuna.distributions.FloatDistribution(0.0, 1.0),
            "dtype": optuna.distributions.CategoricalDistribution(self._dts),
        }

    def _space_filling(self, free: np.ndarray, dists: Mapping[str, Any]) -> Candidate:
        """Return the next point of a scrambled Sobol sequence (Optuna's QMC sampler), snapped to a free candidate."""
        import optuna

        if self._qmc is None:
            sampler = optuna.samplers.QMCSampler(qmc_type="sobol", scramble=True, seed=self.seed,
                                                 warn_independent_sampling=False)
            self._qmc = optuna.create_study(direction="maximize", sampler=sampler)
        trial = self._qmc.ask(dict(dists))
        pr = trial.params
        i = self._snap((pr["world_size"], pr["log2_n"], pr["log10_density"], pr["overlap"], pr["dtype"]), free)
        self._qmc.tell(trial, 0.0)
        self._step += 1
        self.last_acquisition = float("nan")
        return self.candidates[i]

    def choose(self, measured: Sequence[Measurement], done: set[str], model: CostModel | None = None) -> Candidate | None:
        """Return the unmeasured candidate Optuna finds with the largest expected regret (``None``: all measured).

        Args:
            measured: everything measured so far.
            done: keys of the candidates measured.
            model: the model fitted on ``measured``, if the caller has it (saves a fit).
        """
        import optuna

        free = np.array([c.key not in done for c in self.candidates], dtype=bool)
        if not free.any():
            return None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        dists = self._distributions()
        after = len(done) - self.init
        if after < 0 or (self.explore_every > 0 and after % self.explore_every == self.explore_every - 1):
            return self._space_filling(free, dists)
        main, members = self._models(measured, model)
        n_configs = len(done)
        noise = self.noise_of(measured)

        sampler = optuna.samplers.TPESampler(seed=self.seed * 100_003 + self._step, n_startup_trials=10,
                                             multivariate=True)
        study = optuna.create_study(direction="maximize", sampler=sampler, storage=None)
        # Warm start: the best candidates of the previous step that are still free.
        for i in [i for i in self._warm if free[i]][:5]:
            p, ln, ld, o, dt = self.candidates[i].coords
            study.enqueue_trial({"world_size": p, "log2_n": ln, "log10_density": ld, "overlap": o, "dtype": dt})
        best_i, best_v = -1, -np.inf
        tried: dict[int, float] = {}
        batch = 8  # trials asked together (TPE's constant liar), their candidates predicted in one call
        left = self.trials
        while left > 0:
            trials = [study.ask(dists) for _ in range(min(batch, left))]
            left -= len(trials)
            picks = []
            for trial in trials:
                pr = trial.params
                picks.append(self._snap((pr["world_size"], pr["log2_n"], pr["log10_density"], pr["overlap"],
                                         pr["dtype"]), free))
            new = sorted({i for i in picks if i not in tried})
            if new:
                for i, v in zip(new, self._acquisition(main, members, new, n_configs, noise)):
                    tried[i] = float(v)
            for trial, i in zip(trials, picks):
                study.tell(trial, tried[i])
                if tried[i] > best_v:
                    best_i, best_v = i, tried[i]
        self._warm = sorted(tried, key=tried.get, reverse=True)  # type: ignore[arg-type]
        self._step += 1
        self.last_acquisition = best_v
        return self.candidates[best_i]


# --------------------------------------------------------------------------- simulation


def _checkpoints(limit: int) -> list[int]:
    pts = list(range(1, min(limit, 24) + 1))
    pts += list(range(26, min(limit, 60) + 1, 2))
    pts += list(range(64, min(limit, 120) + 1, 4))
    pts += list(range(128, limit + 1, 8))
    if pts[-1] != limit:
        pts.append(limit)
    return pts


def _first_reach(curve: Sequence[tuple[int, float]], target: float, stay: bool) -> int | None:
    """Return the first m whose regret is <= target (and, with ``stay``, every later one too)."""
    for j, (m, r) in enumerate(curve):
        if r <= target + 1e-12 and (not stay or all(rr <= target + 1e-12 for _, rr in curve[j:])):
            return m
    return None


def simulate(
    profile: Profile, *, seeds: int = 5, test_fraction: float = 0.25, limit: int | None = None, trials: int = 40,
    ensemble: int = 4, world_sizes: Sequence[int] | None = None, progress: Callable[[str], None] | None = None,
    model_kw: Mapping[str, Any] | None = None, member_kw: Mapping[str, Any] | None = None, truth: str = "measured",
    noise: float = 0.1, explore_every: int = 0,
) -> dict[str, Any]:
    """Replay the fixed grid, active profiling and random order against a profile's stored measurements.

    Args:
        profile: a profile that measured a grid with every algorithm.
        seeds: repetitions; each draws another held-out set and seeds the strategies.
        test_fraction: share of the configurations held out for the regret.
        limit: most configurations the active and random strategies may
            measure (default: a quarter of the pool).
        trials: Optuna trials per active choice.
        ensemble: bootstrap members of the active strategy's uncertainty.
        world_sizes: keep only these world sizes (default all).
        progress: called with a status line after each seed.
        model_kw: arguments of the :class:`~colltune.model.cost_model.LearnedCostModel`
            every strategy is scored with (default: its defaults, as ``colltune fit``).
        member_kw: arguments of the active strategy's bootstrap members.
        truth: ``measured``: the stored medians are both what a strategy
            "measures" and what regret is scored against (so timing noise
            in the stored data counts against every strategy alike).
            ``model``: semi-synthetic: a model fitted on the whole profile is
            the true cost surface; regret is scored against it, and
            measuring draws its time times ``exp(N(0, noise))``, afresh per seed.
        noise: ``truth="model"``: log-normal timing noise of a measurement.
        explore_every: see :class:`ActiveChooser`.

    Returns:
        ``{"setup": ..., "runs": [per seed: {"grid": ..., "active": curve, "random": curve, ...}],
        "summary": ...}``; curves are lists of ``[m, regret_geomean]``.

    Raises:
        colltune.offline.profiling.ProfilingError: fewer than 20 configurations measured with every algorithm.
    """
    from colltune.offline.profiling import ProfilingError

    if truth not in ("measured", "model"):
        raise ProfilingError(f"truth must be 'measured' or 'model', but got {truth!r}.")
    cands = _simulation_candidates(profile, world_sizes)
    prims = dict(profile.primitives)
    true_t = _true_times(cands, prims) if truth == "model" else None
    settings = {"test_fraction": test_fraction, "limit": limit, "trials": trials, "ensemble": ensemble,
                "model_kw": dict(model_kw or {}), "member_kw": member_kw, "explore_every": explore_every}
    runs = _simulate_seeds(cands, prims, true_t, seeds, noise, settings, progress)
    return {"setup": {"configs": len(cands), "test_fraction": test_fraction, "seeds": seeds, "trials": trials,
                      "ensemble": ensemble, "algorithms": list(_ALGS), "truth": truth, "explore_every": explore_every,
                      "noise": noise if truth == "model" else None,
                      "world_sizes": sorted({c.coords[0] for c in cands}),
                      "measurements_per_config": len(_ALGS)},
            "runs": runs, "summary": _summary(runs)}


def _true_times(cands: list[Candidate], prims: Mapping[str, Any]) -> np.ndarray:
    """Return the true time of every candidate and algorithm under ``truth="model"``: a model fitted on them all."""
    surface = _fit([m for c in cands for m in c.measured.values()], prims)
    return np.exp(_log_predictions(surface, [c.features for c in cands], _ALGS))


def _simulate_seeds(cands: list[Candidate], prims: Mapping[str, Any], true_t: np.ndarray | None, seeds: int,
                    noise: float, settings: Mapping[str, Any],
                    progress: Callable[[str], None] | None) -> list[dict[str, Any]]:
    """Replay every seed (on noisy draws of ``true_t`` when given); report a status line after each."""
    runs = []
    t_start = time.perf_counter()
    for seed in range(seeds):
        seeded = cands if true_t is None else _noisy_candidates(cands, true_t, seed, noise)
        run = _simulate_seed(seeded, prims, seed, settings)
        runs.append(run)
        if progress is not None:
            progress(_seed_line(run, time.perf_counter() - t_start))
    return runs


def _simulation_candidates(profile: Profile, world_sizes: Sequence[int] | None) -> list[Candidate]:
    """Return the profile's configurations measured with every algorithm (at least 20), at ``world_sizes``."""
    from colltune.offline.profiling import ProfilingError

    cands = candidates_from_profile(profile)
    if world_sizes:
        cands = [c for c in cands if c.coords[0] in set(world_sizes)]
    if len(cands) < 20:
        raise ProfilingError(
            f"the profile has {len(cands)} configurations measured with every algorithm; the simulation needs at "
            "least 20 (measure a grid: colltune profile --grid full --world-size 2 4)."
        )
    return cands


def _noisy_candidates(base: list[Candidate], true_t: np.ndarray, seed: int, noise: float) -> list[Candidate]:
    """Return the candidates "measured" on the model surface ``true_t``, each time times ``exp(N(0, noise))``."""
    draw = np.random.default_rng(7000 + seed)
    out = []
    for c, tt in zip(base, true_t):
        noisy = tt * np.exp(draw.normal(0.0, noise, size=tt.shape)) if noise > 0 else tt
        ms = {a: Measurement.from_features(c.features, a, time_us=float(noisy[j]),
                                           spread_us=float(noise * 1.349 * noisy[j]), repeats=1,
                                           bytes_sent=c.measured[a].bytes_sent)
              for j, a in enumerate(_ALGS)}
        out.append(Candidate(c.key, c.features, c.coords, ms, truth={a: float(tt[j]) for j, a in enumerate(_ALGS)}))
    return out


def _simulate_seed(cands: list[Candidate], prims: Mapping[str, Any], seed: int,
                   settings: Mapping[str, Any]) -> dict[str, Any]:
    """Hold out a test set, then score the fixed grid, active profiling and random order on it."""
    rng = random.Random(1000 + seed)
    order = list(range(len(cands)))
    rng.shuffle(order)
    n_test = max(1, int(round(settings["test_fraction"] * len(cands))))
    test = [cands[i] for i in order[:n_test]]
    pool = [cands[i] for i in order[n_test:]]
    lim = min(len(pool), settings["limit"] or max(20, len(pool) // 5))
    pts = _checkpoints(lim)
    mkw = settings["model_kw"]
    grid_ms = [m for c in pool for m in c.measured.values()]
    t0 = time.perf_counter()
    grid_regret = selection_regret(_fit(grid_ms, prims, **mkw), test)
    grid_fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    active_curve, picks = _active_curve(pool, test, prims, seed, lim, pts, settings)
    active_s = time.perf_counter() - t0
    # Random order: the same pool, shuffled.
    rorder = list(pool)
    random.Random(2000 + seed).shuffle(rorder)
    random_curve = []
    for m in pts:
        ms = [x for c in rorder[:m] for x in c.measured.values()]
        random_curve.append([m, selection_regret(_fit(ms, prims, **mkw), test)["geomean"]])
    target = grid_regret["geomean"]
    reach = {
        name: {"first": _first_reach(curve, target, False), "stays": _first_reach(curve, target, True)}
        for name, curve in (("active", active_curve), ("random", random_curve))
    }
    return {
        "seed": seed, "pool": len(pool), "test": len(test), "limit": lim,
        "grid": {"configs": len(pool), "measurements": len(grid_ms), "regret": grid_regret, "fit_s": grid_fit_s},
        "active": active_curve, "random": random_curve, "reach": reach, "active_picks": picks,
        "active_s": active_s,
    }


def _active_curve(pool: list[Candidate], test: list[Candidate], prims: Mapping[str, Any], seed: int, lim: int,
                  pts: Any, settings: Mapping[str, Any]) -> tuple[list[list[float]], list[dict[str, Any]]]:
    """Let Optuna pick each next configuration; return the regret curve at the checkpoints and the picks."""
    chooser = ActiveChooser(pool, prims, ensemble=settings["ensemble"], trials=settings["trials"], seed=seed,
                            member_kw=settings["member_kw"], explore_every=settings["explore_every"])
    measured: list[Measurement] = []
    done: set[str] = set()
    curve, picks = [], []
    model = None
    for m in range(1, lim + 1):
        c = chooser.choose(measured, done, model)
        if c is None:
            break
        done.add(c.key)
        measured.extend(c.measured.values())
        acq = chooser.last_acquisition
        picks.append({"key": c.key, "acquisition": acq if math.isfinite(acq) else None})
        # The model after m configurations: scored, then used for the next choice.
        model = _fit(measured, prims, **settings["model_kw"])
        if m in pts:
            curve.append([m, selection_regret(model, test)["geomean"]])
    return curve, picks


def _seed_line(run: Mapping[str, Any], elapsed_s: float) -> str:
    """One status line after a seed: the grid's regret and where active and random order reach it."""
    lim, reach = run["limit"], run["reach"]
    active, rand = reach["active"]["first"], reach["random"]["first"]
    return (f"seed {run['seed']}: grid {run['pool']} configurations -> regret {run['grid']['regret']['geomean']:.4f}; "
            f"active reaches it at {active if active is not None else f'>{lim}'}, random at "
            f"{rand if rand is not None else f'>{lim}'} ({elapsed_s:.0f} s)")


def _summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Summarize each strategy: configurations to reach the grid's regret per seed, ratio grid/strategy, median."""
    out: dict[str, Any] = {}
    for kind in ("first", "stays"):
        for name in ("active", "random"):
            ms = [r["reach"][name][kind] for r in runs]
            ratios = [r["grid"]["configs"] / m if m else None for r, m in zip(runs, ms)]
            got = [x for x in ratios if x is not None]
            out[f"{name}_{kind}"] = ms
            out[f"{name}_{kind}_ratio"] = ratios
            out[f"{name}_{kind}_ratio_median"] = float(np.median(got)) if len(got) == len(runs) and got else None
    out["grid_configs"] = [r["grid"]["configs"] for r in runs]
    out["grid_regret"] = [r["grid"]["regret"]["geomean"] for r in runs]
    # The same on the median curve over seeds (less noisy than any one seed), against the median grid regret.
    if runs:
        common = sorted(set.intersection(*[{m for m, _ in r["active"]} for r in runs]))
        target = float(np.median(out["grid_regret"]))
        configs = float(np.median(out["grid_configs"]))
        for name in ("active", "random"):
            curve = [(m, float(np.median([dict(map(tuple, r[name]))[m] for r in runs]))) for m in common]
            out[f"{name}_median_curve"] = [[m, v] for m, v in curve]
            for kind, stay in (("first", False), ("stays", True)):
                m = _first_reach(curve, target, stay)
                out[f"{name}_median_curve_{kind}"] = m
                out[f"{name}_median_curve_{kind}_ratio"] = configs / m if m else None
        out["grid_regret_median"] = target
    return out


def format_simulation(result: Mapping[str, Any]) -> str:
    """Return the simulation as a table: per seed, configurations needed to reach the grid's regret."""
    s = result["setup"]
    k = s["measurements_per_config"]
    if s.get("truth") == "model":
        head = (f"SEMI-SYNTHETIC: the true cost surface is a model fitted on the whole profile; measuring draws it "
                f"with {100 * s['noise']:.0f}% log-normal noise; regret is scored against the surface")
    else:
        head = ("replayed the stored measurements: measuring a configuration reads its medians, and regret is scored "
                "against them too (their timing noise counts against every strategy)")
    lines = [
        head,
        f"replayed {s['configs']} configurations x {k} algorithms (P={','.join(map(str, s['world_sizes']))}); "
        f"{int(100 * s['test_fraction'])}% held out per seed; a measurement = one configuration timed with all "
        f"{k} algorithms (interleaved), so measurements are configurations x {k}",
        "",
        f"{'seed':>4} {'grid configs':>12} {'grid regret':>11} {'active reach':>12} {'active stays':>12} "
        f"{'random reach':>12} {'ratio grid/active':>17}",
    ]
    lines += _seed_rows(result["runs"])
    runs = result["runs"]
    lines += _curve_rows(runs)
    lines += _summary_rows(result["summary"], runs)
    return "\n".join(lines)


def _seed_rows(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """One row per seed: the grid, where active and random order reach its regret, and the ratio."""
    lines = []
    for r in runs:
        def f(v: Any) -> str:
            return f">{r['limit']}" if v is None else str(v)

        a = r["reach"]["active"]
        ratio = f"{r['grid']['configs'] / a['first']:.2f}x" if a["first"] else "-"
        stay = f"{r['grid']['configs'] / a['stays']:.2f}x" if a["stays"] else "-"
        lines.append(f"{r['seed']:>4} {r['grid']['configs']:>12} {r['grid']['regret']['geomean']:>11.4f} "
                     f"{f(a['first']):>12} {f(a['stays']):>12} {f(r['reach']['random']['first']):>12} "
                     f"{ratio:>8} ({stay} stays)")
    return lines


def _curve_rows(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The median regret curves of active and random order at the checkpoints every seed reached."""
    common = sorted(set.intersection(*[{m for m, _ in r["active"]} for r in runs])) if runs else []
    show = [m for m in common if m in (1, 2, 5, 10, 15, 20, 30, 40, 50, 60, 80, 100, 120, 160, 200)] or common[:10]
    if not show:
        return []
    lines = ["", "regret (geomean over the held-out configurations; median over seeds) after m configurations:",
             f"{'m':>8} " + " ".join(f"{m:>6}" for m in show) + f" {'grid':>8}"]
    grid_med = float(np.median([r["grid"]["regret"]["geomean"] for r in runs]))
    for name in ("active", "random"):
        vals = [float(np.median([dict(map(tuple, r[name]))[m] for r in runs])) for m in show]
        lines.append(f"{name:>8} " + " ".join(f"{v:>6.3f}" for v in vals) + f" {grid_med:>8.3f}")
    lines.append(f"{'(grid: all ' + str(runs[0]['grid']['configs']) + ' pool configurations)':>8}")
    return lines


def _summary_rows(sm: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The per-seed median ratios and where the median curves reach the median grid regret."""
    def med(name: str) -> str:
        v = sm.get(name)
        return "not reached in every seed" if v is None else f"{v:.2f}x"

    def on_curve(name: str) -> str:
        first, stays = sm.get(f"{name}_median_curve_first"), sm.get(f"{name}_median_curve_stays")
        if first is None:
            return f"{name}: not reached within {runs[0]['limit']} configurations"
        text = f"{name}: reaches it at {first} ({sm[f'{name}_median_curve_first_ratio']:.2f}x fewer)"
        if stays is not None:
            text += f", stays at or below it from {stays} on ({sm[f'{name}_median_curve_stays_ratio']:.2f}x fewer)"
        else:
            text += ", but does not stay below it"
        return text

    lines = [
        "",
        f"per seed, configurations needed for the grid's regret, median ratio grid/strategy: active "
        f"{med('active_first_ratio_median')} (staying there: {med('active_stays_ratio_median')}); random order "
        f"{med('random_first_ratio_median')} (staying there: {med('random_stays_ratio_median')})",
    ]
    if "grid_regret_median" in sm:
        lines += [f"median curve over seeds against the median grid regret {sm['grid_regret_median']:.4f} "
                  f"({int(np.median(sm['grid_configs']))} configurations): " + on_curve("active") + "; "
                  + on_curve("random")]
    return lines


# --------------------------------------------------------------------------- live


def _active_rank(rank: int, world_size: int, candidates: Sequence[Candidate], count: int,
                 primitives: Mapping[str, Primitive], measured0: Sequence[Measurement], done0: Sequence[str],
                 algorithms: Sequence[str], plan: Any,
                 journal: str, header: Mapping[str, Any], seed: int, trials: int, backend: str,
                 show: bool) -> dict[str, Any] | None:
    """The rank function of live active profiling at one world size: rank 0 chooses, every rank measures."""
    import torch.distributed as dist

    from colltune.offline import profiling

    device = profiling.setup_device(backend)
    jr = profiling.Journal(journal, header) if rank == 0 else None
    chooser = ActiveChooser(candidates, primitives, seed=seed, trials=trials) if rank == 0 else None
    measured, done = list(measured0), set(done0)
    n = 0
    for step in range(count):
        box: list[Any] = [None]
        if rank == 0:
            c = chooser.choose(measured, done)  # type: ignore[union-attr]
            box[0] = None if c is None else c.key
        if world_size > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        cand = next(c for c in candidates if c.key == box[0])
        t0 = time.perf_counter()
        raw: dict[str, list[float]] = {}
        ms = profiling.measure_config(rank, world_size, cand.config, algorithms, plan, device, raw)
        done.add(cand.key)
        if rank == 0 and ms is not None:
            acq = chooser.last_acquisition  # type: ignore[union-attr]
            acq = float(acq) if math.isfinite(acq) else None  # None: a point of the space-filling start
            jr.add_config(cand.key, ms, seconds=round(time.perf_counter() - t0, 3),  # type: ignore[union-attr]
                          acquisition=acq, times_us=raw)
            measured.extend(Measurement(**m) for m in ms)
            if show:
                best = min(ms, key=lambda m: m["time_us"])
                why = "space-filling start" if acq is None else f"expected regret {acq:.3f}"
                print(f"active {step + 1}/{count}: {cand.key}: {why}; "
                      f"fastest {best['algorithm']} {best['time_us'] / 1e3:.2f} ms", flush=True)
        n += 1
    return {"measured": n} if rank == 0 else None


def _merge(previous: Sequence[Measurement], journal: Any) -> list[Measurement]:
    """Return the previous profile's measurements with the journal's added (the journal wins a tie)."""
    from colltune.offline.profiling import measurement_key

    by = {(measurement_key(m), m.algorithm): m for m in previous}
    for key, ms in journal.configs.items():
        for d in ms:
            by[(key, d["algorithm"])] = Measurement(**d)
    return list(by.values())


def run_live(out: str, world_sizes: Sequence[int], grid: Any, *, count: int | None = None, backend: str = "gloo",
             plan: Any = None, resume: bool = False, seed: int = 0, trials: int = 40, show: bool = True,
             timeout: float = 6 * 3600.0) -> Any:
    """Measure ``count`` configurations of ``grid`` chosen actively; write the profile.

    The count is split evenly over the world sizes.

    The primitives are measured first (by :func:`colltune.offline.profiling.run_profile`,
    which also keeps the journal); every measurement is journaled at once, so
    ``resume`` continues an interrupted run.

    Returns:
        The :class:`colltune.offline.profiling.ProfileResult`.
    """
    from colltune.model.profile import profile_from_measurements, save_profile
    from colltune.offline import launch, profiling

    if launch.in_torchrun():
        raise profiling.ProfilingError("--active starts its own ranks; run it without torchrun.")
    started = time.monotonic()
    plan = plan or profiling.TimingPlan()
    world_sizes = sorted(set(world_sizes))
    all_cfgs = {p: grid.configs(p) for p in world_sizes}
    total = sum(len(v) for v in all_cfgs.values())
    count = min(total, count or max(len(world_sizes), total // 6))
    # The primitives and the journal, through the ordinary profiler with nothing of the grid to measure.
    profiling.run_profile(out, world_sizes, grid, backend=backend, plan=plan, resume=resume, progress=False,
                          order=lambda todo: [], log=lambda s: None)
    prof = load_profile(out)
    previous, prims = list(prof.measurements), dict(prof.primitives)
    jpath = profiling.journal_path(out)
    header = {"backend": backend, "grid": grid.as_dict(), "algorithms": list(profiling.ALGORITHMS), "active": True}
    measured = _merge(previous, profiling.Journal(jpath, header))
    done = {profiling.measurement_key(m) for m in measured}
    resumed = len(done)
    per_p = {p: count // len(world_sizes) + (1 if i < count % len(world_sizes) else 0)
             for i, p in enumerate(world_sizes)}
    for p in world_sizes:
        keys = {c.key for c in all_cfgs[p]}
        todo = max(0, per_p[p] - len(done & keys))
        if not todo:
            continue
        cands = candidates_from_configs(all_cfgs[p])
        launch.run_local(_active_rank, p, cands, todo, prims, measured, sorted(done), profiling.ALGORITHMS, plan,
                         jpath, header, seed, trials, backend, show, backend=backend, timeout=timeout)
        measured = _merge(previous, profiling.Journal(jpath, header))
        done = {profiling.measurement_key(m) for m in measured}
    meta = profiling.profile_meta(backend, world_sizes, grid,
                           f"active profiling: {len(done)} of the grid's {total} configurations, chosen by "
                           "expected regret of the decision")
    model = profiling.fit_model(measured, prims).to_dict() if len(measured) >= 2 else None
    save_profile(profile_from_measurements(measured, prims, meta, model=model), out)
    complete = len(done) >= count
    if complete:
        try:
            os.remove(jpath)
        except OSError:
            pass
    return profiling.ProfileResult(profile=load_profile(out), path=out, configs_total=count,
                                   configs_resumed=resumed, configs_measured=len(done) - resumed, complete=complete,
                                   elapsed_s=time.monotonic() - started, journal="" if complete else jpath,
                                   world_sizes=world_sizes)


