"""``colltune tune``: an Optuna study that resumes from its storage (a journal file or a database URL) and writes a
valid policy."""

from __future__ import annotations

import time

import optuna
import pytest
from optuna.trial import TrialState

from colltune import cli
from colltune.model.policy import load_policy
from colltune.offline import autotune

TINY = ["--world-size", "2", "--n", "2^10", "--density", "1e-2", "--rounds", "2", "--quiet"]


def _study(storage):
    w = autotune.TuneTarget("exact", 1024, 1e-2, 0.5, "float32", 2, 2, 16, 0)
    return optuna.load_study(study_name=autotune.study_name(w, tuple(autotune.space("exact"))),
                             storage=autotune.storage_of(str(storage)))


def test_tune_resumes_from_its_storage_and_writes_a_policy(tmp_path, capsys):
    storage, out = tmp_path / "tune.journal", tmp_path / "tuned.yaml"
    argv = ["tune", *TINY, "--storage", str(storage), "--out", str(out)]
    assert cli.main([*argv, "--trials", "3"]) == 0
    first = capsys.readouterr().out
    assert first.count("<== BEST") == 1 and "BEST: trial #" in first
    study = _study(storage)
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(done) == 3
    assert done[0].user_attrs.get("default") and done[0].params == {"algorithm": "allgather", "allgather.mode": "auto"}
    values = {t.number: t.value for t in done}

    assert cli.main([*argv, "--trials", "5"]) == 0
    capsys.readouterr()
    study = _study(storage)
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(done) == 5  # two more, not five more
    assert {t.number: t.value for t in done if t.number in values} == values  # the first three kept as they were

    policy = load_policy(out)
    assert policy.default == "auto" and not policy.knobs  # nothing global: other world sizes keep the defaults
    (rule,) = policy.rules
    assert rule.world_size == (2, 2) and rule.backend == ("gloo",) and rule.use == "auto"
    assert set(rule.knobs) <= set(autotune.space("exact")) and rule.knobs
    for alg, knobs in rule.knobs.items():
        assert set(knobs) <= set(autotune.space("exact")[alg])
    tuned = policy.match(None, 1024, 0.01, 2, None, "float32", "gloo")
    assert tuned.rule_index == 0 and tuned.knobs == rule.merged_knobs
    assert policy.match(None, 1024, 0.01, 16, None, "float32", "gloo").rule_index is None
    assert policy.match(None, 1024, 0.01, 2, None, "float32", "nccl").rule_index is None
    text = out.read_text()
    assert text.startswith("# colltune tune: study") and "# best trial #" in text


def test_a_trial_cut_short_is_failed_and_tried_again(tmp_path):
    """A kill leaves a RUNNING trial in the journal; reopening fails it and queues its knobs first."""
    storage = str(tmp_path / "s.journal")
    w = autotune.TuneTarget("exact", 1024, 1e-2, 0.5, "float32", 2)
    study = autotune._open_study(storage, w, ("oktopk",), 0)
    study.tell(study.ask(), 1.0)  # the defaults, enqueued first
    cut = study.ask()
    autotune.suggest(cut, "exact", ("oktopk",), 2)
    study = autotune._open_study(storage, w, ("oktopk",), 0)
    states = {t.number: t.state for t in study.trials}
    assert states[cut.number] == TrialState.FAIL
    retry = study.ask()
    autotune.suggest(retry, "exact", ("oktopk",), 2)
    assert retry.params == cut.params and retry.user_attrs["retry_of"] == cut.number


def test_the_topk_space_holds_the_refresh_intervals():
    space = autotune.space("topk")["oktopk"]
    assert {"local_refresh", "global_refresh", "boundary_refresh", "peers_in_flight"} == set(space)
    trial = optuna.create_study().ask()
    got = autotune.suggest(trial, "topk", ("oktopk",), 4)
    assert 1 <= got["knobs"]["peers_in_flight"] <= 3


def test_a_foreign_storage_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\n")
    assert cli.main(["tune", *TINY, "--storage", str(bad), "--out", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert "--storage" in err and "Traceback" not in err
    assert not (tmp_path / "p.yaml").exists()


def test_a_written_policy_with_a_bool_knob_loads(tmp_path):
    """A boolean knob (Ok-Topk's ``balance``) in a tuned setting is written as true/false and loads back."""
    study = optuna.create_study()
    dists = {"oktopk.balance": optuna.distributions.CategoricalDistribution((True, False)),
             "oktopk.peers_in_flight": optuna.distributions.IntDistribution(1, 3)}
    study.add_trial(optuna.trial.create_trial(params={"oktopk.balance": False, "oktopk.peers_in_flight": 2},
                                              distributions=dists, value=1.0))
    text = autotune.policy_text(study, ("oktopk",), str(tmp_path / "s.journal"))
    out = tmp_path / "tuned.yaml"
    out.write_text(text)
    knobs = load_policy(out).rules[0].knobs["oktopk"]
    assert knobs == {"balance": False, "peers_in_flight": 2} and knobs["balance"] is False


def test_a_database_url_holds_the_study_and_a_second_run_resumes_it(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    argv = ["tune", *TINY, "--algorithm", "allgather", "--storage", url, "--out", str(tmp_path / "p.yaml")]
    assert cli.main([*argv, "--trials", "2"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    w = autotune.TuneTarget("exact", 1024, 1e-2, 0.5, "float32", 2, 2, 16, 0)
    name = autotune.study_name(w, ("allgather",))
    first = {t.number: t.value for t in optuna.load_study(study_name=name, storage=url).trials
             if t.state == TrialState.COMPLETE}
    assert len(first) == 2
    assert cli.main([*argv, "--trials", "3"]) == 0
    out = capsys.readouterr().out
    study = optuna.load_study(study_name=name, storage=url)
    done = {t.number: t.value for t in study.trials if t.state == TrialState.COMPLETE}
    assert len(done) == 3 and {k: done[k] for k in first} == first  # the same study, one trial more
    assert [s.study_name for s in optuna.get_all_study_summaries(url)] == [name]
    assert f"in {url}" in out


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_database_trial_whose_heartbeat_stopped_is_failed_and_tried_again(tmp_path, monkeypatch):
    """A node that died leaves a RUNNING trial whose heartbeat went silent; opening the study retries it."""
    monkeypatch.setattr(autotune, "HEARTBEAT_S", 1)
    monkeypatch.setattr(autotune, "GRACE_S", 1)
    url = f"sqlite:///{tmp_path / 's.db'}"
    w = autotune.TuneTarget("exact", 1024, 1e-2, 0.5, "float32", 2)
    study = autotune._open_study(url, w, ("oktopk",), 0)
    cut = study.ask()
    autotune.suggest(cut, "exact", ("oktopk",), 2)
    study._storage.record_heartbeat(cut._trial_id)  # what Study.optimize's heartbeat thread does
    live = study.ask()  # no heartbeat yet: another node's trial that has just started
    time.sleep(2.5)
    study = autotune._open_study(url, w, ("oktopk",), 0)
    states = {t.number: t.state for t in study.trials}
    assert states[cut.number] == TrialState.FAIL and states[live.number] == TrialState.RUNNING
    (retry,) = [t for t in study.trials if t.state == TrialState.WAITING]
    assert retry.params == cut.params and retry.user_attrs.get("default")


@pytest.mark.parametrize("spec", ["tune.journal", "journal:tune.journal", "sub/dir/tune.journal"])
def test_a_path_or_journal_prefix_is_a_journal_file(spec):
    assert autotune.journal_file(spec) == spec.removeprefix("journal:")
    assert not autotune.is_url(spec)


def test_a_database_password_is_not_shown():
    assert autotune.storage_label("postgresql://me:secret@db:5432/tune") == "postgresql://me:***@db:5432/tune"
    assert autotune.storage_label("sqlite:///t.db") == "sqlite:///t.db"
    assert autotune.storage_label("runs/t.journal") == "t.journal"


def test_a_url_that_opens_no_database_exits_2(tmp_path, capsys):
    argv = ["tune", *TINY, "--storage", "nosuchdb://host/x", "--out", str(tmp_path / "p.yaml")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--storage 'nosuchdb://host/x'" in err and "sqlite:///" in err and "Traceback" not in err
