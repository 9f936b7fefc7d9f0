"""Online correction: the selector learns from its own calls, the same on every rank.

A profile predicts each algorithm's time on the machine it was measured on;
on another machine, or as the job's neighbours change, it drifts. Every
call the selector decides is also a measurement of exactly what it
predicted, so each call times itself (:class:`Timer`: wall time on CPU,
CUDA events on a GPU, read on a later call so that timing adds no host
sync) and hands the figure to the group's :class:`Feedback`. The next
metadata exchange on the group carries it (record fields ``fb_code`` and
``fb_us``); every rank takes the maximum over ranks (what the call cost)
once every rank's figure is there, so every rank learns the same figure at
the same call and keeps deciding alike, whatever its own clock said.

The selector keeps, per call site and algorithm, the ratio measured /
predicted as a geometric mean that forgets old calls (:data:`DECAY`) and
is shrunk toward the algorithm's ratio over every site (itself shrunk
toward the machine's, :meth:`Ratios.machine_log`) while it has few
samples (:data:`PRIOR_CALLS`):
:class:`Ratios`. Predictions are multiplied by it before the argmin. A
measurement counts at most :data:`CLIP` above what the site expected of
the algorithm (:data:`CLIP_FIRST` for its first there) until the
algorithm's next measurement confirms it: one busy call does not price an
algorithm out, a real change is learned one call later. An algorithm the
corrected model does not pick is tried now and then
(:func:`explore_pick`): at most once in :data:`EXPLORE_EVERY` calls of a
site, within :data:`EXPLORE_WITHIN` of the best corrected prediction (so
never one predicted more than 2x slower), while the site's exploring has
cost at most :data:`EXPLORE_TIME` of its measured time. An exploring call
that changes no decision doubles the site's wait for the next one, up to
:data:`EXPLORE_BACKOFF` times :data:`EXPLORE_EVERY`; one that changes a
decision, or a site deciding calls of the same size (the same half-octave
of entries) differently than before, brings it back to
:data:`EXPLORE_EVERY`.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = [
    "DECAY", "PRIOR_CALLS", "EXPLORE_EVERY", "EXPLORE_BACKOFF", "EXPLORE_WITHIN", "EXPLORE_TIME", "MAX_RATIO",
    "CLIP", "CLIP_FIRST",
    "Timer", "Feedback", "Ratios", "explore_pick", "feedback", "start", "hold", "STATE_FORMAT", "STATE_VERSION",
    "MAX_STATE_BYTES", "MAX_STATE_SITES", "SAVE_EVERY", "SAMPLES_PER_SITE", "stable_key", "copy_mean", "library_version",
    "dump_state", "load_state", "sample", "measurements_from_state",
]

#: Each measured call at a site weighs the site's earlier measurements down by this factor, whichever
#: algorithm ran: a memory of about 30 calls, so a correction follows a machine whose load changes. What a
#: site measured of an algorithm it has since stopped running fades to the weight of one call (never less:
#: a state file keeps what the site learned), so a few noisy early calls cannot outweigh the next exploring
#: call's measurement and keep that algorithm untried. The ratios over every site forget by the same factor
#: per measurement of the algorithm.
DECAY = 0.97
#: Pseudo-calls of the prior: a site's ratio starts at the algorithm's ratio over every site, which starts
#: at the machine's, and moves to the site's own as its calls come in (one call counts half).
PRIOR_CALLS = 1.0
#: A site explores at most once in this many calls (2.9% of its calls): the first time the time budget
#: allows after this many calls since its last exploring one.
EXPLORE_EVERY = 34
#: An exploring call that changes none of the site's decisions doubles the wait for its next one, up to this
#: many times :data:`EXPLORE_EVERY` (once in 136 calls, 0.7%): a site whose runner-up keeps measuring slower
#: stops paying for it, while still checking at least every 136 calls whether drift has changed that.
EXPLORE_BACKOFF = 4
#: Only an algorithm whose corrected prediction is within this factor of the best one is tried.
EXPLORE_WITHIN = 1.5
#: ... and only while the site's exploring has cost at most this share of its measured time.
EXPLORE_TIME = 0.03
#: A measured / predicted ratio is clipped to [1 / MAX_RATIO, MAX_RATIO] (a stalled call is not a model).
MAX_RATIO = 100.0
#: A measurement counts at most this far above (in log) what the site expected of the algorithm, its
#: corrected ratio: 2.7x (e). Call times have a heavy upper tail (in the stored online runs 9% of calls take
#: over 1.5x the median of the same algorithm's calls around them, 3% over 2x, 0.6% over 3x: the last line
#: of ``tools/online_bench.py --replay profiles/measurements/online-*.json.gz``), and one busy
#: call taken at face value can price the fastest algorithm out of the exploring window for good. What is
#: clipped off is kept: the algorithm's next measurement at the site confirms it as far as it goes as high,
#: and both count up to there (a change that two calls confirm is learned; one busy call is not). Replayed
#: (``tools/online_bench.py --replay profiles/measurements/online-*.json.gz --busy 8``), the stored runs with
#: one busy call, 8x, at each site's first measurement of its fastest algorithm: six of eight at 1.012 to
#: 1.024 smoothed regret; with nothing cut (``--clip inf:inf``) all eight at 1.337 to 1.729, and with only the
#: first measurement capped (``--clip inf``) the stored live lock-out stays at 1.277. Resampled eight times each
#: (``--resample 8``): 1.041, against 1.043 with nothing cut, 1.042 with only the first capped and 1.043 at 2x
#: (``--clip 0.6931``): nothing lost where no call is busy.
CLIP = 1.0
#: ... and a site's first measurement of an algorithm at most this far above its prior (1.22x): on a
#: machine slower than its profile the second measurement confirms it.
CLIP_FIRST = 0.2
#: Exchanges a measurement may wait for every rank's figure (a CUDA event not done yet) before it is dropped.
_MAX_WAIT = 8


class Timer:
    """The time of one call's intervals on this rank: wall time on CPU, CUDA events on a GPU.

    Args:
        device: the call's device; on CUDA the intervals are events on its current stream, where the call's
            kernels go, whatever device the thread has current (an event on another device's stream would
            time nothing of the call, and open a context there).
    """

    __slots__ = ("cuda", "device", "marks")

    def __init__(self, device: Any) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list[Any] = []

    def mark(self) -> None:
        """Mark a boundary: intervals are the pairs of marks (the 1st to the 2nd, the 3rd to the 4th...)."""
        if self.cuda:
            import torch  # a timer is made by a call, which has loaded torch: the selector itself loads none

            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def fork(self) -> "Timer":
        """A timer holding this one's marks so far (a fused call's exchange, shared by its buckets)."""
        t = Timer.__new__(Timer)
        t.cuda, t.device, t.marks = self.cuda, self.device, list(self.marks)
        return t

    def us(self) -> float | None:
        """The intervals' total in microseconds, or ``None`` while the device has not reached the last mark."""
        m = self.marks
        if len(m) < 2:
            return None
        if not self.cuda:
            return sum(m[i + 1] - m[i] for i in range(0, len(m) - 1, 2)) * 1e6
        if not m[-1].query():  # no host sync: read on a later call
            return None
        return sum(m[i].elapsed_time(m[i + 1]) for i in range(0, len(m) - 1, 2)) * 1e3


class Feedback:
    """A group's measurement of its last decided call, until the next record has carried it to every rank.

    The metadata exchange asks :meth:`fields` for the record and hands the
    gathered records to :meth:`arrived`; the figure reaches ``sink`` (the
    selector) on every rank at the same exchange, as the maximum over ranks.
    """

    __slots__ = ("code", "timer", "sink", "waited")

    def __init__(self) -> None:
        self.code: int | None = None
        self.timer: Timer | None = None
        self.sink: Callable[[float], None] | None = None
        self.waited = 0

    def hold(self, code: int, timer: Timer, sink: Callable[[float], None]) -> None:
        """Hold a call's measurement (replacing one not delivered yet)."""
        self.code, self.timer, self.sink, self.waited = code, timer, sink, 0

    def fields(self) -> dict[str, int]:
        """The record's fields: the held call's code and this rank's time in microseconds (-1: none, not ready)."""
        if self.code is None or self.timer is None:
            return {"fb_code": -1, "fb_us": -1}
        us = self.timer.us()
        return {"fb_code": self.code, "fb_us": -1 if us is None else max(0, int(round(us)))}

    def arrived(self, codes: Sequence[int], times: Sequence[int]) -> None:
        """Deliver the maximum over ranks once every rank's figure of the held call is in the gathered records."""
        if self.code is None:
            return
        if any(c != self.code for c in codes):  # another call's (a rank without a selector): drop it
            self.code = None
            return
        if min(times) < 0:
            self.waited += 1
            if self.waited > _MAX_WAIT:
                self.code = None
            return
        sink, self.code, self.sink, self.timer = self.sink, None, None, None
        if sink is not None:
            sink(float(max(times)))


def feedback(comm: Any) -> Feedback:
    """Return the group's :class:`Feedback` (kept as long as the group lives)."""
    from colltune.algorithms.meta import FEEDBACK_KEY

    fb: Feedback = comm.group_state(FEEDBACK_KEY, Feedback)
    return fb


class _Mean:
    """A geometric mean that forgets: the weighted sum of log ratios and the weight.

    Of the latest log ratio added: ``excess``, what :data:`CLIP` (or
    :data:`CLIP_FIRST`) cut off it (0 when it counted whole); ``level``,
    what it counted as; ``weight``, its weight in the sum now (1 when added,
    aging with the sum). A site's means use the three to confirm a cut call
    (:meth:`Ratios.observe`); the pool's keep them unread.
    """

    __slots__ = ("s", "n", "excess", "level", "weight")

    def __init__(self) -> None:
        self.s, self.n = 0.0, 0.0
        self.excess, self.level, self.weight = 0.0, 0.0, 0.0

    def add(self, x: float, excess: float = 0.0) -> None:
        self.s, self.n = self.s * DECAY + x, self.n * DECAY + 1.0
        self.excess, self.level, self.weight = excess, x, 1.0

    def fade(self) -> None:
        """Age by one call without a measurement: the mean stays, its weight falls by :data:`DECAY` to one call's."""
        if self.n > 1.0:
            f = max(DECAY, 1.0 / self.n)
            self.s, self.n, self.weight = self.s * f, self.n * f, self.weight * f


class Ratios:
    """Measured / predicted over every site, per algorithm; the machine's is derived from them (:meth:`machine_log`).

    A site's correction of an algorithm is its own geometric mean, shrunk
    toward the algorithm's over every site, itself shrunk toward the
    machine's (:meth:`machine_log`), each by :data:`PRIOR_CALLS`
    pseudo-calls. An algorithm measured at no site starts from the
    machine's ratio shrunk toward 1 the same way, so a few calls cannot
    price it out of reach (it is tried once, and then priced by its own).
    So an algorithm the profile prices wrong is corrected from its own
    calls, while once each algorithm has been measured a machine uniformly
    slower than its profile scales every prediction alike, and what one
    site learns of an algorithm informs the others.
    """

    __slots__ = ("every",)

    def __init__(self) -> None:
        self.every: dict[str, _Mean] = {}

    def observe(self, own: dict[str, _Mean], algorithm: str, predicted_us: float, measured_us: float) -> None:
        """Add one call: ``own`` is the site's table; :data:`CLIP` applies."""
        r = min(MAX_RATIO, max(1.0 / MAX_RATIO, measured_us / max(predicted_us, 1e-3)))
        x = math.log(r)
        cap = self._log_factors(own, (algorithm,))[algorithm] + (CLIP if algorithm in own else CLIP_FIRST)
        back = 0.0
        prev = own.get(algorithm)
        if prev is not None and prev.excess > 0:  # the previous call was cut: both count up to where both went
            common = min(x, prev.level + prev.excess)
            back, cap = max(0.0, common - prev.level), max(cap, common)
        over = max(0.0, x - cap)
        for a, m in own.items():  # the site's clock: every algorithm's figures there age by one call
            if a != algorithm:
                m.fade()
        mine, every = own.setdefault(algorithm, _Mean()), self.every.setdefault(algorithm, _Mean())
        if back:  # the previous call's cut part that this call confirms, at its weight at the site now; the pool
            # takes the same amount (where that call has aged less, a little less than its share)
            mine.s += back * mine.weight
            every.s += back * mine.weight
        mine.add(x - over, over)
        every.add(x - over)

    def factor(self, own: Mapping[str, _Mean], algorithm: str) -> float:
        """The site's correction of ``algorithm``'s prediction (1 with no measurement anywhere)."""
        return self.factors(own, (algorithm,))[algorithm]

    def factors(self, own: Mapping[str, _Mean], algorithms: Iterable[str]) -> dict[str, float]:
        """:meth:`factor` of each of ``algorithms`` (the machine's ratio computed once)."""
        return {a: math.exp(v) for a, v in self._log_factors(own, algorithms).items()}

    def _log_factors(self, own: Mapping[str, _Mean], algorithms: Iterable[str]) -> dict[str, float]:
        """The logs of :meth:`factors` (what :meth:`observe` caps a measurement against)."""
        every, algorithms = self.every, list(algorithms)
        machine = self.machine_log()
        # Only an algorithm no site has measured (rare once a group has run a while) needs the shrunk prior.
        unmeasured = self.machine_log(shrunk=True) if any(a not in every for a in algorithms) else 0.0
        return {a: _shrunk(own.get(a), _shrunk(every[a], machine) if a in every else unmeasured) for a in algorithms}

    def machine_log(self, shrunk: bool = False) -> float:
        """The machine's log ratio: the smallest of the measured algorithms' own, once two or more are measured.

        With one algorithm measured, nothing tells a machine slower than its
        profile from that algorithm priced wrong: the others keep the
        profile's prices (0) until one of them is measured too. With two or
        more, the smallest is the prior of an algorithm's own ratio over
        every site: on a machine slower than its profile every ratio is
        about the same, while one algorithm priced too low (a large ratio)
        must not make the others look slow too and go untried (optimism
        where nothing is known, as a bandit's).

        ``shrunk``: each measured algorithm's ratio shrunk toward 0 by
        :data:`PRIOR_CALLS` first: the prior of an algorithm measured at no
        site, so that one busy call of another algorithm (a ratio measured
        once) cannot price it out of the exploring window for good (the
        stored run ``profiles/measurements/online-cpu2-p4-wrong-allgather-12d74b5``
        is such a case; ``tools/online_bench.py --replay`` runs it).
        """
        logs = [_shrunk(m, 0.0) if shrunk else m.s / m.n for m in self.every.values() if m.n >= 0.5]
        return min(logs) if len(logs) >= 2 else 0.0


def _shrunk(mean: _Mean | None, prior: float) -> float:
    """The log mean of ``mean`` with :data:`PRIOR_CALLS` pseudo-calls at ``prior``."""
    return prior if mean is None else (mean.s + PRIOR_CALLS * prior) / (mean.n + PRIOR_CALLS)


def explore_pick(corrected: Mapping[str, float], chosen: str, last_measured: Callable[[str], int],
                 spent_us: float, total_us: float) -> str | None:
    """Return the algorithm to try instead of ``chosen`` on an exploring call, or ``None``.

    Candidates are within :data:`EXPLORE_WITHIN` of the best corrected
    prediction and affordable within :data:`EXPLORE_TIME` of the site's
    measured time; the one the site measured longest ago is tried
    (``last_measured``: the site's call count at its latest measurement,
    -1 for never), so every runner-up gets its turn; ties: the faster
    predicted, then registry order, as ``corrected`` lists them.
    """
    best = min(corrected.values())
    names = list(corrected)
    fits = [a for a in names if a != chosen and corrected[a] <= EXPLORE_WITHIN * best
            and spent_us + corrected[a] <= EXPLORE_TIME * (total_us + corrected[a])]
    if not fits:
        return None
    return min(fits, key=lambda a: (last_measured(a), corrected[a], names.index(a)))


def start(comm: Any, selector: Any) -> Timer | None:
    """Start timing a call that ``selector`` decides (before its metadata exchange), or ``None`` when nothing learns."""
    if selector is None or not selector.online or comm.world_size < 2:
        return None
    timer = Timer(comm.device)
    timer.mark()
    return timer


def hold(comm: Any, timer: Timer | None, selector: Any, site: tuple, choice: Any) -> None:
    """End a call's timing and hold it for the group's next record; only a decision the cost model priced teaches."""
    predicted = None if timer is None or choice is None or choice.predicted_us is None else (
        choice.predicted_us.get(choice.algorithm))
    if predicted is None:
        return
    from colltune.algorithms.meta import digest

    if len(timer.marks) % 2:  # type: ignore[union-attr]
        timer.mark()  # type: ignore[union-attr]  # the call ends here (a fused bucket's ended with its run)
    algorithm, explored = choice.algorithm, choice.source == "explore"
    feedback(comm).hold(digest(repr(site), algorithm), timer,  # type: ignore[arg-type]
                        lambda us: selector.observe_time(site, algorithm, predicted, us, explored))


# --------------------------------------------------------------------------- the state file

#: What the state file says it is, and the layout it is written in (2: per-site samples; 1 is read too).
STATE_FORMAT, STATE_VERSION = "colltune-online", 2
#: The measured calls a state file keeps per site, the most recent (what ``colltune fit --online`` folds in).
SAMPLES_PER_SITE = 16
#: A sample's fields, in order: the call (its site's rows, row width, dtype and world size, and the ranks'
#: entries and union), the algorithm that ran and its time (the maximum over ranks).
SAMPLE_FIELDS = ("numel", "row_numel", "dtype", "world_size", "k_sum", "k_max", "union", "algorithm", "time_us")
#: The largest state file read (a file larger is refused at once, unread).
MAX_STATE_BYTES = 4 * 2**20
#: The most call sites a state file keeps (the most recently measured).
MAX_STATE_SITES = 4096
#: A selector with a state file saves it every this many measurements (and at exit).
SAVE_EVERY = 256


def library_version() -> str:
    """The installed colltune's version (what a state file says it was written by), or ``unknown``."""
    from importlib import metadata

    try:
        return metadata.version("colltune")
    except metadata.PackageNotFoundError:
        return "unknown"


def stable_key(site_key: tuple) -> str:
    """A call site's key without its group's serial (its last item): the same site in the next run of the job."""
    return repr(site_key[:-1])


def copy_mean(m: _Mean) -> _Mean:
    """A copy of one site's figures for one algorithm: the sum and ``n`` (a state file keeps no more, so a cut
    that waited to be confirmed stays cut)."""
    out = _Mean()
    out.s, out.n = m.s, m.n
    return out


def _mean(raw: Any, where: str) -> _Mean:
    if (not isinstance(raw, list) or len(raw) != 2 or not all(isinstance(x, (int, float)) for x in raw)
            or not all(math.isfinite(x) for x in raw) or raw[1] < 0):
        raise ValueError(f"{where}: expected [log sum, weight] of finite numbers, got {str(raw)[:60]}")
    m = _Mean()
    m.s, m.n = float(raw[0]), float(raw[1])
    return m


def sample(site_key: tuple, last_call: tuple[int, int, int], algorithm: str, measured_us: float) -> list[Any] | None:
    """One measured call of a sparse or fused site as a state file keeps it (:data:`SAMPLE_FIELDS`), else ``None``.

    ``site_key`` is ``(kind, name, n, row width, dtype, P, group)``;
    ``last_call`` the call's ``(k_sum, k_max, union)``.
    """
    if site_key[0] not in ("sparse", "fused"):
        return None
    k_sum, k_max, union = last_call
    dtype = str(site_key[4]).replace("torch.", "")
    return [int(site_key[2]), int(site_key[3]), dtype, int(site_key[5]), int(k_sum), int(k_max), int(union),
            algorithm, round(float(measured_us), 1)]


def dump_state(sites: Mapping[str, Mapping[str, _Mean]], meta: Mapping[str, Any],
               samples: Mapping[str, Sequence[Sequence[Any]]] | None = None) -> str:
    """Return the state as JSON text: each site's table (the most recent :data:`MAX_STATE_SITES`), its
    samples (:data:`SAMPLES_PER_SITE` each), and ``meta``.

    The group-wide ratios are not kept: they are learned again within a few
    calls, and a group of the next run has no stable name to find them by.
    """
    import json

    kept = list(sites.items())[-MAX_STATE_SITES:]
    samples = samples or {}
    return json.dumps({
        "format": STATE_FORMAT, "version": STATE_VERSION, **meta,
        "sites": {k: {a: [m.s, m.n] for a, m in own.items()} for k, own in kept},
        "samples": {k: [list(s) for s in samples[k][-SAMPLES_PER_SITE:]] for k, _ in kept if samples.get(k)},
    }, sort_keys=True)


def _checked_sample(raw: Any, where: str) -> list[Any]:
    from colltune.model.features import DTYPE_BYTES

    ok = isinstance(raw, list) and len(raw) == len(SAMPLE_FIELDS)
    if ok:
        n, row, dtype, p, k_sum, k_max, union, algorithm, us = raw
        ints = (n, row, p, k_sum, k_max, union)
        ok = (all(isinstance(v, int) and not isinstance(v, bool) for v in ints) and n >= 1 and row >= 1 and p >= 2
              and 0 <= k_max <= k_sum and 0 <= union <= min(k_sum, n) and dtype in DTYPE_BYTES
              and isinstance(algorithm, str) and isinstance(us, (int, float)) and math.isfinite(us) and us > 0)
    if not ok:
        raise ValueError(f"{where}: expected [{', '.join(SAMPLE_FIELDS)}] of a measured call, got {str(raw)[:80]}")
    return raw


def load_state(path: str) -> tuple[dict[str, dict[str, _Mean]], dict[str, Any]]:
    """Read a state file; return its sites' tables and its other fields.

    Raises:
        ValueError: the file is unreadable, too large, not JSON, or not a
            state of this layout (the message says which).
    """
    import json
    import os

    size = os.path.getsize(path)
    if size > MAX_STATE_BYTES:
        raise ValueError(f"{size} bytes, more than the {MAX_STATE_BYTES} a state file may have")
    with open(path, encoding="utf-8") as fh:
        raw = json.load(fh)
    if not isinstance(raw, dict) or raw.get("format") != STATE_FORMAT:
        said = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"not a colltune online-correction state (format {str(said)!r})")
    if raw.get("version") not in (1, STATE_VERSION):
        raise ValueError(f"layout version {raw.get('version')!r}, but this colltune reads 1 to {STATE_VERSION}")
    sites = raw.get("sites")
    if not isinstance(sites, dict):
        raise ValueError("sites must be a mapping")
    own: dict[str, dict[str, _Mean]] = {}
    for k, table in list(sites.items())[:MAX_STATE_SITES]:
        if not isinstance(table, dict):
            raise ValueError(f"sites.{k}: expected a mapping")
        own[str(k)] = {str(a): _mean(v, f"sites.{k}.{a}") for a, v in table.items()}
    samples = raw.get("samples", {})
    if not isinstance(samples, dict):
        raise ValueError("samples must be a mapping")
    meta = {k: v for k, v in raw.items() if k not in ("sites", "samples")}
    meta["samples"] = {str(k): [_checked_sample(s, f"samples.{k}[{i}]") for i, s in enumerate(v[-SAMPLES_PER_SITE:])]
                       for k, v in samples.items() if str(k) in own and isinstance(v, list)}
    return own, meta


def measurements_from_state(path: str) -> list[Any]:
    """The measured calls a state file keeps, as profile measurements (:class:`colltune.model.profile.Measurement`).

    Each is one call's time of the algorithm that ran (the maximum over
    ranks, one round), at its rows, row width, dtype, world size, entries
    and union; its overlap and density follow from them.

    Raises:
        ValueError: what :func:`load_state` refuses, or a file with no samples.
    """
    from colltune.model.features import Features
    from colltune.model.profile import Measurement

    _, meta = load_state(path)
    out = []
    for samples in meta["samples"].values():
        for n, row, dtype, p, k_sum, k_max, union, algorithm, us in samples:
            # The ranks' entries as evenly as their sum and maximum allow: what the features read of them.
            rest, others = k_sum - k_max, p - 1
            k_per_rank = [k_max] + [rest // others + (1 if j < rest % others else 0) for j in range(others)]
            f = Features.build(numel=n, row_numel=row, dtype=dtype, k_per_rank=k_per_rank, union=union)
            out.append(Measurement.from_features(f, algorithm, time_us=float(us)))
    if not out:
        raise ValueError("it holds no measured calls (a state written with COLLTUNE_ONLINE_STATE keeps the last "
                         f"{SAMPLES_PER_SITE} of each sparse call site)")
    return out
