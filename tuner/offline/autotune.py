"""Tune the algorithms' knobs with Optuna on a workload, and write them as a policy (``colltune tune``).

One study, one workload. Each trial is a setting of the knobs; every rank
runs the workload with it, interleaved round by round with the default
knobs (so that load from other processes hits both alike), and the study
minimizes the median time of a round (max over ranks, ms): one call in
exact mode, ``--steps`` consecutive calls in top-k mode (the refresh
intervals only show over several calls). The defaults are the first trial,
so every later trial is compared with them.

Search space
------------

Exact mode (``sparse_allreduce``, default)::

    algorithm                  allgather | oktopk         (``--algorithm all``: a parameter of the study)
    allgather.mode             auto | p2p | pad | alltoall (point to point unpacked, padding, or all_to_all)
    oktopk.boundary_refresh    1 .. 256, log              (calls between region-boundary refreshes)
    oktopk.peers_in_flight     1 .. P-1                   (rotated point-to-point steps posted at once)
    oktopk.dense_fallback_ratio 0.1 .. 2.0, log           (a region travels dense past this share of dense)

Top-k mode (``--topk``: ``topk_allreduce`` with Ok-Topk, error feedback on)::

    oktopk.local_refresh       1 .. 128, log              (exact local threshold every N calls)
    oktopk.global_refresh      1 .. 128, log              (exact global threshold every N calls)
    oktopk.boundary_refresh    1 .. 256, log
    oktopk.peers_in_flight     1 .. P-1

Storage and resuming
--------------------

``--storage`` names the study's Optuna storage (:func:`storage_of`):

=============================  ==================================================
``tune.journal``               a journal file (``JournalStorage`` with a
``journal:tune.journal``       ``JournalFileBackend``; an append-only log), for
                               one run at a time
``sqlite:///tune.db``          a relational database by its SQLAlchemy URL
``postgresql://u@host/db``     (``RDBStorage``): several nodes can run the same
                               study at once
=============================  ==================================================

Running the same command again continues the study (``create_study`` with
``load_if_exists``): it runs until the study holds ``--trials`` finished
trials. A trial cut short by a kill is failed and its knobs are tried again
first: in a journal, every trial still running when the study is opened
(one run at a time); in a database, the trials whose heartbeat stopped
(``fail_stale_trials`` and Optuna's retry callback), so the running trials
of other nodes are left alone.

Output
------

A table of the trials, the best one marked ``<== BEST``, and a policy YAML
(``--out``, valid for :func:`colltune.model.policy.load_policy`) with the best knobs
of each algorithm tuned, for example::

    # colltune tune: study 'tune-exact-P4-n1048576-d0.01-o0.5-float32' (tune.journal)
    # best trial #7: 3.10 ms (default knobs 3.85 ms, 1.24x)
    version: 1
    default: auto
    knobs:
      oktopk: {boundary_refresh: 128, peers_in_flight: 2, dense_fallback_ratio: 0.66}
      allgather: {mode: pad}

Example:
    $ colltune tune --world-size 4 --trials 30 --storage tune.journal --out tuned.yaml
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from colltune import algorithms
from colltune.algorithms.knobs import Knob

__all__ = ["TuneTarget", "space", "tuned_knobs", "suggest", "run_study", "policy_text", "format_trials",
           "storage_of", "storage_label", "journal_file", "is_url"]



def tuned_knobs(mode: str, algorithm: str) -> tuple[Knob, ...]:
    """Return the knobs ``colltune tune`` searches for ``algorithm`` in ``mode`` (``exact`` or ``topk``)."""
    return tuple(k for k in algorithms.get(algorithm).knob_specs if mode in k.tune)


def space(mode: str) -> dict[str, dict[str, Knob]]:
    """Return the search space of ``mode``: algorithm -> knob name -> :class:`Knob` (its ``search`` range).

    Every registered algorithm with a tuned knob, from the registry.
    """
    out = {}
    for name in algorithms.names():
        knobs = tuned_knobs(mode, name)
        if knobs:
            out[name] = {k.name: k for k in knobs}
    return out


@dataclass(frozen=True)
class TuneTarget:
    """The call the knobs are tuned for.

    Attributes:
        mode: ``exact`` (``sparse_allreduce``) or ``topk`` (``topk_allreduce``).
        n: rows (exact) or elements of the gradient (top-k).
        density: entries per rank over ``n``.
        overlap: overlap of the ranks' index sets (exact mode).
        dtype: value dtype.
        world_size: ranks.
        rounds: timed rounds per trial (each runs the trial's knobs and the defaults once).
        steps: top-k mode: calls per round (the refresh intervals need several calls to matter).
        seed: input seed.
    """

    mode: str
    n: int
    density: float
    overlap: float
    dtype: str
    world_size: int
    rounds: int = 9
    steps: int = 16
    seed: int = 0

    @property
    def name(self) -> str:
        """A study name that identifies the workload."""
        base = f"tune-{self.mode}-P{self.world_size}-n{self.n}-d{self.density:g}"
        return base + (f"-o{self.overlap:g}-{self.dtype}" if self.mode == "exact" else "")


def suggest(trial: Any, mode: str, algorithms: Sequence[str], world_size: int) -> dict[str, Any]:
    """Suggest one setting: ``{"algorithm": a, "knobs": {...}}``.

    The knobs are conditional on the algorithm when several are tuned.
    """
    algs = list(algorithms)
    alg = algs[0] if len(algs) == 1 else trial.suggest_categorical("algorithm", algs)
    knobs: dict[str, Any] = {}
    for k in tuned_knobs(mode, alg):
        pname = f"{alg}.{k.name}"
        if k.kind == "choice":
            knobs[k.name] = trial.suggest_categorical(pname, list(k.choices))
        elif k.kind == "bool":
            knobs[k.name] = trial.suggest_categorical(pname, [False, True])
        else:
            assert k.search is not None
            low, _, log = k.search
            if k.kind == "int":
                knobs[k.name] = trial.suggest_int(pname, int(low), int(k.search_high(world_size)), log=log)
            else:
                knobs[k.name] = float(trial.suggest_float(pname, low, k.search_high(world_size), log=log))
    return {"algorithm": alg, "knobs": knobs}


def _defaults(mode: str, alg: str, world_size: int) -> dict[str, Any]:
    """The tuned knobs' defaults (what trial 0 measures), clipped into their search range at this world size."""
    base = {}
    for k in tuned_knobs(mode, alg):
        base[k.name] = k.default
        if k.search is not None and k.search[1] is None:
            base[k.name] = min(k.default, k.search_high(world_size))
    return base


def _default_params(mode: str, alg: str, algorithms: Sequence[str], world_size: int) -> dict[str, Any]:
    params: dict[str, Any] = {} if len(algorithms) == 1 else {"algorithm": alg}
    params.update({f"{alg}.{k}": v for k, v in _defaults(mode, alg, world_size).items()})
    return params


# --------------------------------------------------------------------------- rank side


def _measure(rank: int, world_size: int, w: TuneTarget, setting: Mapping[str, Any], device: Any) -> tuple[float, float]:
    """Time the setting against the defaults, interleaved; return both medians (ms, max over ranks)."""
    import torch
    import torch.distributed as dist

    import colltune
    from colltune.offline import bench
    from colltune.offline.bench import sync_device

    alg = setting["algorithm"]
    tuned, base = dict(setting["knobs"]), _defaults(w.mode, alg, world_size)
    if w.mode == "exact":
        from colltune.offline.workloads import Workload, k_for_density

        inp = Workload(w.n, k_for_density(w.n, w.density), world_size, w.overlap, dtype=getattr(torch, w.dtype),
                       seed=w.seed)
        idx, vals = inp.make(rank)
        idx, vals = idx.to(device), vals.to(device)

        def call_of(knobs: dict[str, Any]) -> Any:
            def call() -> Any:
                out = colltune.sparse_allreduce(idx, vals, w.n, algorithm=alg, knobs=knobs)
                sync_device(device)
                return out

            return call
    else:
        gen = torch.Generator().manual_seed(w.seed * 7919 + 1 + rank)
        grads = [torch.randn(w.n, generator=gen).to(device) for _ in range(4)]

        def state_of(knobs: dict[str, Any]) -> Any:
            return colltune.TopkState(density=w.density, local_refresh=knobs["local_refresh"],
                                   global_refresh=knobs["global_refresh"], boundary_refresh=knobs["boundary_refresh"],
                                   peers_in_flight=knobs["peers_in_flight"])

        def call_of(knobs: dict[str, Any]) -> Any:
            state = state_of(knobs)

            def call() -> Any:
                for s in range(w.steps):
                    out = colltune.topk_allreduce(grads[s % len(grads)], state, op="avg", algorithm="oktopk")
                sync_device(device)
                return out

            return call

    calls = {"tuned": call_of(tuned), "default": call_of(base)}
    for fn in calls.values():
        dist.barrier()
        fn()
    plan = bench.Plan(warmup=0, min_repeats=w.rounds, max_repeats=w.rounds, budget_s=1e9)
    times, _ = bench.budget_rounds(calls, plan)
    flat = bench.reduce_max(times["tuned"] + times["default"])
    r = w.rounds
    return statistics.median(flat[:r]) * 1e3, statistics.median(flat[r:]) * 1e3


def _tune_rank(rank: int, world_size: int, w: TuneTarget, algorithms: Sequence[str], trials: int, storage: str,
               seed: int, show: bool, backend: str) -> dict[str, Any] | None:
    """The rank function: rank 0 runs the study (``Study.optimize``); every rank measures each trial."""
    from colltune.offline.profiling import setup_device

    device = setup_device(backend)
    if rank != 0:
        while (setting := _shared(None, world_size)) is not None:
            _measure(rank, world_size, w, setting, device)
        return None
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState

    study = _open_study(storage, w, algorithms, seed)
    ran = [0]

    def objective(trial: Any) -> float:
        setting = _shared({"number": trial.number, **suggest(trial, w.mode, algorithms, world_size)}, world_size)
        tuned_ms, default_ms = _measure(rank, world_size, w, setting, device)
        ran[0] += 1
        trial.set_user_attr("default_ms", default_ms)
        trial.set_user_attr("speedup_vs_default", default_ms / tuned_ms)
        if show:
            knobs = ", ".join(f"{k}={_fmt(v)}" for k, v in setting["knobs"].items())
            print(f"trial {setting['number']:>3}: {setting['algorithm']} {knobs}: {tuned_ms:.3f} ms "
                  f"(default knobs {default_ms:.3f} ms)", flush=True)
        return tuned_ms

    left = trials - len(completed_trials(study))
    if left > 0:
        # Other nodes may run the same study: stop once it holds ``trials``, whoever finished them.
        study.optimize(objective, n_trials=left, callbacks=[MaxTrialsCallback(trials, states=(TrialState.COMPLETE,))])
    _shared(None, world_size)  # the other ranks stop
    return {"ran": ran[0]}


def _shared(setting: dict[str, Any] | None, world_size: int) -> dict[str, Any] | None:
    """Return rank 0's ``setting`` on every rank (``None``: the study is done)."""
    import torch.distributed as dist

    box: list[Any] = [setting]
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


# --------------------------------------------------------------------------- the study


#: Seconds between the heartbeats of a running trial in a database, and the silence after which it is stale
#: (a node that died); a journal has no heartbeat.
HEARTBEAT_S = 30
GRACE_S = 120

#: What ``--storage`` may start with to name a journal file explicitly.
JOURNAL_PREFIX = "journal:"


def is_url(spec: str) -> bool:
    """Whether ``spec`` is a database URL (``dialect[+driver]://...``) rather than a journal file."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", spec) is not None


def journal_file(spec: str) -> str | None:
    """Return the journal file ``spec`` names (a bare path or ``journal:PATH``), or None for a database URL."""
    if spec.startswith(JOURNAL_PREFIX):
        return spec[len(JOURNAL_PREFIX):]
    return None if is_url(spec) else spec


def storage_label(spec: str) -> str:
    """Return ``spec`` as output may show it: a journal's file name, a URL without its password."""
    path = journal_file(spec)
    if path is not None:
        return os.path.basename(path)
    return re.sub(r"^([^:]+://[^:/@]*):[^@/]*@", r"\1:***@", spec)


def storage_of(spec: str) -> Any:
    """Return the Optuna storage ``--storage SPEC`` names.

    A bare path or ``journal:PATH`` is a journal file (``JournalStorage``
    with a ``JournalFileBackend``); a URL such as ``sqlite:///tune.db`` or
    ``postgresql://user@host/db`` is a database (``RDBStorage``) whose
    running trials send heartbeats, so a trial whose node died is failed and
    queued again (Optuna's retry callback) while other nodes' trials run on.

    Raises:
        ProfilingError: the URL names no database Optuna can open.
    """
    import optuna.storages

    path = journal_file(spec)
    if path is not None:
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(path))
    retry = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    try:
        with _quiet_experimental():
            callback = {"heartbeat_stale_trial_callback": retry()} if retry is not None else {
                "failed_trial_callback": optuna.storages.RetryFailedTrialCallback()}
            return optuna.storages.RDBStorage(spec, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S, **callback)
    except Exception as exc:  # SQLAlchemy's errors: a bad URL, a missing driver, a database out of reach
        from colltune.offline.profiling import ProfilingError

        raise ProfilingError(
            f"--storage {storage_label(spec)!r} cannot be opened as an Optuna database ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); pass a URL such as sqlite:///tune.db or "
            "postgresql://user@host/db with its driver installed, or a file path for a journal.") from None


@contextlib.contextmanager
def _quiet_experimental() -> Iterator[None]:
    """Silence Optuna's notes that heartbeats and their retry callback are experimental (every run would print them)."""
    from optuna.exceptions import ExperimentalWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        yield


def _open_study(storage: str, w: TuneTarget, algorithms: Sequence[str], seed: int) -> Any:
    """Create or load the study in ``storage`` (a ``--storage`` spec); queue the defaults first.

    Trials cut short are failed and their knobs queued again: in a journal
    (one run at a time), every trial still running; in a database, the
    trials whose heartbeat went silent.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=study_name(w, algorithms), storage=storage_of(storage),
                                direction="minimize", load_if_exists=True)
    # A resumed study gets a sampler seeded past its trials, so its random start does not repeat the first run's.
    study.sampler = optuna.samplers.TPESampler(seed=seed * 100_003 + len(study.trials), n_startup_trials=8)
    if not study.trials:
        for alg in algorithms:  # the defaults first: every later trial is judged against them
            study.enqueue_trial(_default_params(w.mode, alg, algorithms, w.world_size), user_attrs={"default": True})
    if journal_file(storage) is not None:
        _retry_running(study)
    else:
        with _quiet_experimental():
            optuna.storages.fail_stale_trials(study)
    study.set_user_attr("workload", {k: getattr(w, k) for k in ("mode", "n", "density", "overlap", "dtype",
                                                               "world_size", "rounds", "steps", "seed")})
    study.set_user_attr("algorithms", list(algorithms))
    return study


def _retry_running(study: Any) -> None:
    """Fail the trials a kill left running in a journal, and queue their knobs again first."""
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(t.number, state=TrialState.FAIL)  # nothing of it was recorded
        study.enqueue_trial(dict(t.params), user_attrs={"retry_of": t.number, **(
            {"default": True} if t.user_attrs.get("default") else {})})


def study_name(w: TuneTarget, algorithms: Sequence[str]) -> str:
    """Return the name of the study of ``w`` tuning ``algorithms`` (one storage file can hold several)."""
    return w.name + ("-" + "+".join(algorithms))


def run_study(w: TuneTarget, algorithms: Sequence[str], trials: int, storage: str, *, seed: int = 0,
              show: bool = True, backend: str = "gloo", timeout: float = 6 * 3600.0) -> Any:
    """Run the study until it holds ``trials`` finished trials (local ranks, or torchrun's); return it on rank 0.

    ``storage`` is a ``--storage`` spec (:func:`storage_of`).
    """
    from colltune.offline import launch

    if launch.in_torchrun():
        got = launch.run_here(_tune_rank, w, tuple(algorithms), trials, storage, seed, show, backend,
                              backend=backend)
        if got is None:
            return None
    else:
        launch.run_local(_tune_rank, w.world_size, w, tuple(algorithms), trials, storage, seed, show, backend,
                         backend=backend, timeout=timeout)
    return _open_study(storage, w, algorithms, seed)


def completed_trials(study: Any) -> list[Any]:
    from optuna.trial import TrialState

    return [t for t in study.trials if t.state == TrialState.COMPLETE]


def _setting_of(t: Any, algorithms: Sequence[str]) -> tuple[str, dict[str, Any]]:
    alg = t.params.get("algorithm", algorithms[0])
    knobs = {k.split(".", 1)[1]: v for k, v in t.params.items() if k.startswith(alg + ".")}
    return alg, knobs


def best_per_algorithm(study: Any, algorithms: Sequence[str]) -> dict[str, Any]:
    """Return the best complete trial of each algorithm tuned."""
    out: dict[str, Any] = {}
    for t in completed_trials(study):
        alg, _ = _setting_of(t, algorithms)
        if alg not in out or t.value < out[alg].value:
            out[alg] = t
    return out


def format_trials(study: Any, algorithms: Sequence[str]) -> str:
    """Return every complete trial as a table; the best is marked ``<== BEST``."""
    trials = completed_trials(study)
    if not trials:
        return "no complete trial"
    best = min(trials, key=lambda t: t.value)
    lines = [f"{'trial':>5} {'algorithm':<10} {'time ms':>9} {'default ms':>10} {'speedup':>8}  knobs", "-" * 78]
    for t in sorted(trials, key=lambda t: t.number):
        alg, knobs = _setting_of(t, algorithms)
        tag = "  <== BEST" if t.number == best.number else ("  (defaults)" if t.user_attrs.get("default") else "")
        lines.append(f"{t.number:>5} {alg:<10} {t.value:>9.3f} {t.user_attrs.get('default_ms', float('nan')):>10.3f} "
                     f"{t.user_attrs.get('speedup_vs_default', float('nan')):>7.2f}x  "
                     + ", ".join(f"{k}={_fmt(v)}" for k, v in knobs.items()) + tag)
    alg, knobs = _setting_of(best, algorithms)
    lines += ["-" * 78,
              f"BEST: trial #{best.number}: {alg} " + ", ".join(f"{k}={_fmt(v)}" for k, v in knobs.items())
              + f": {best.value:.3f} ms (default knobs {best.user_attrs.get('default_ms', float('nan')):.3f} ms in "
              f"the same rounds, {best.user_attrs.get('speedup_vs_default', float('nan')):.2f}x)"]
    return "\n".join(lines)


def policy_text(study: Any, algorithms: Sequence[str], storage: str, profile: str | None = None,
                backend: str = "gloo") -> str:
    """Return the policy YAML holding the best knobs of each algorithm tuned.

    The knobs sit in one rule scoped to the world size and backend they were
    measured on (``when: {world_size: P, backend: B}``), so that a policy
    tuned on 2 ranks never sets the knobs of a 16-rank job; other calls keep
    the defaults. The text is validated by :mod:`colltune.model.policy`.
    """
    import yaml

    from colltune.model.policy import parse_policy

    best = best_per_algorithm(study, algorithms)
    overall = min(best.values(), key=lambda t: t.value) if best else None
    knobs: dict[str, dict[str, Any]] = {}
    for alg in algorithms:
        if alg in best:
            _, k = _setting_of(best[alg], algorithms)
            knobs[alg] = {name: (float(f"{v:.4g}") if isinstance(v, float) else v) for name, v in k.items()}
    w = study.user_attrs.get("workload", {})
    head = [f"# colltune tune: study {study.study_name!r} ({storage_label(storage)})",
            "# workload: " + ", ".join(f"{k}={v}" for k, v in w.items())]
    if overall is not None:
        alg, _ = _setting_of(overall, algorithms)
        head.append(f"# best trial #{overall.number} ({alg}): {overall.value:.3f} ms (default knobs "
                    f"{overall.user_attrs.get('default_ms', float('nan')):.3f} ms in the same rounds, "
                    f"{overall.user_attrs.get('speedup_vs_default', float('nan')):.2f}x)")
    for alg, t in best.items():
        head.append(f"# best {alg}: trial #{t.number}, {t.value:.3f} ms")
    doc: dict[str, Any] = {"version": 1}
    if profile:
        doc["profile"] = profile
    doc["default"] = "auto"
    world_size = int(w.get("world_size", 0)) or None
    if knobs:
        when: dict[str, Any] = {"backend": backend}
        if world_size is not None:
            when = {"world_size": world_size, **when}
        doc["rules"] = [{"name": f"tuned-P{world_size}-{backend}", "when": when, "use": "auto", "knobs": knobs}]
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)
    text = "\n".join(head) + "\n" + body
    parse_policy(text, source="<tuned policy>")  # never write a policy the loader refuses
    return text


