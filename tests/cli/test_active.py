"""Active profiling: the acquisition, the Optuna chooser, and the simulation against stored measurements."""

from __future__ import annotations

import numpy as np
from test_cli_report import synthetic_profile

from colltune.algorithms.registry import BUILTIN_NAMES
from colltune.model.profile import load_profile
from colltune.offline import active


def test_expected_regret_is_largest_where_the_choice_is_close_and_uncertain():
    logp = np.log(np.array([[1.0, 1.02, 5.0],    # a near tie
                            [1.0, 3.0, 5.0],     # a clear winner
                            [1.0, 3.0, 5.0]]))   # the same, but the model is unsure
    sd = np.array([[0.1] * 3, [0.1] * 3, [1.0] * 3])
    acq = active.expected_regret(logp, sd, noise=0.0)
    assert acq[0] > acq[1] and acq[2] > acq[1]
    assert acq[1] < 1e-6  # a winner by 10 standard deviations: nothing to learn there
    assert np.all(acq >= 0)


def test_the_chooser_measures_where_the_prior_is_torn(tmp_path):
    prof = load_profile(synthetic_profile(tmp_path / "s.yaml", world_sizes=(4,)))
    cands = active.candidates_from_profile(prof)
    chooser = active.ActiveChooser(cands, prof.primitives, trials=24, seed=0, init=0)
    first = chooser.choose([], set())
    # With nothing measured, the alpha-beta prior decides: the pick is a near tie of its predictions.
    from colltune.model.cost_model import AnalyticModel

    model = AnalyticModel(prof.primitives)

    def gap(c):
        t = sorted(model.predict(c.features).values())
        return t[1] / t[0]

    gaps = sorted(gap(c) for c in cands)
    assert gap(first) <= gaps[len(gaps) // 4], (gap(first), gaps)
    second = chooser.choose(list(first.measured.values()), {first.key})
    assert second.key != first.key


def test_simulation_replays_grid_active_and_random(tmp_path):
    prof = load_profile(synthetic_profile(tmp_path / "s.yaml"))
    res = active.simulate(prof, seeds=1, limit=5, trials=8, ensemble=2, model_kw={"n_estimators": 20},
                          member_kw={"n_estimators": 10})
    (run,) = res["runs"]
    assert run["pool"] + run["test"] == res["setup"]["configs"] >= 60
    assert run["grid"]["configs"] == run["pool"] and run["grid"]["measurements"] == len(BUILTIN_NAMES) * run["pool"]
    assert [m for m, _ in run["active"]] == [m for m, _ in run["random"]] == [1, 2, 3, 4, 5]
    assert all(r >= 1.0 for _, r in run["active"] + run["random"])
    assert len({p["key"] for p in run["active_picks"]}) == 5  # never the same configuration twice
    text = active.format_simulation(res)
    assert "grid configs" in text and "median over seeds" in text


def test_the_first_choices_fill_the_space(tmp_path):
    prof = load_profile(synthetic_profile(tmp_path / "s.yaml"))
    cands = active.candidates_from_profile(prof)
    chooser = active.ActiveChooser(cands, prof.primitives, seed=0, init=6)
    done, picks = set(), []
    for _ in range(6):
        c = chooser.choose([], done)
        done.add(c.key)
        picks.append(c)
    assert len({c.coords[0] for c in picks}) == 2  # both world sizes
    assert len({c.features.numel for c in picks}) >= 2 and len({round(c.coords[2]) for c in picks}) >= 3


def test_live_active_profiling_measures_what_it_chooses(tmp_path, capsys):
    from colltune import cli

    out = tmp_path / "active.yaml"
    argv = ["profile", "--active", "--measurements", "2", "--world-size", "2", "--n", "2^10", "--density", "1e-2",
            "1e-1", "--overlap", "0", "1", "--repeats", "2", "--out", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and "2 measured now" in text
    prof = load_profile(out)
    assert len(prof.measurements) == 2 * len(BUILTIN_NAMES) and "active profiling" in prof.meta["notes"]
    assert prof.model is not None
