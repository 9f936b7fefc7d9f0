"""Choose the algorithm of every ``algorithm="auto"`` call, the same one on every rank.

Precedence, for each call:

1. ``COLLTUNE_ALGO`` (the environment) forces an algorithm, as ``NCCL_ALGO`` does.
2. The policy: the first matching rule that names an algorithm wins.
3. The cost model of the profile: the algorithm with the smallest predicted
   time (ties go to the earlier in registry order), held back by
   hysteresis (below).
4. ``dense``, the safe default, when no profile can be loaded.

The profile is the one ``COLLTUNE_PROFILE`` names, else the one given
(:func:`configure`, :class:`Selector`), else the one the policy names, else
the profile shipped for the group's backend:
``profiles/cpu-gloo.yaml`` (measured on CPU ranks over gloo) for gloo,
``profiles/analytic-nccl.yaml`` for NCCL. A profile with a stored learned
model predicts with it; one with measurements only is fitted once on load;
one with primitives only (analytic) uses the alpha-beta model.

What a decision sees, identical on every rank
---------------------------------------------

* every rank's entry count (the metadata exchange every call makes);
* the overlap: on the first call at a call site, an estimate from the
  sketches that ride in the metadata record (each rank's smallest index
  hashes, :func:`colltune.model.features.sketch_hashes`): exact when every rank's
  indices fit, else within a band of about two standard errors, and no
  collective of its own. Only when the decision changes inside that band
  does one collective refine it (a hashed bitmap per rank, combined by
  ``all_reduce`` MAX, :func:`colltune.model.features.estimate_union_collective`).
  Afterwards, the exact overlap of the previous call at that site, which
  every rank reads off the identical result (``u = len(result.indices)``);
* the policy, the profile and the selector's settings, whose hash rides in
  the metadata record (its ``policy`` field), so that a rank configured
  differently makes every rank raise :class:`~colltune.algorithms.errors.RankMismatchError`
  instead of running another algorithm and hanging. The tensor ``name`` is
  folded into the same hash, since rules and caches depend on it.

Caching and hysteresis
----------------------

A call site is ``(mode, name, n, row size, dtype, P, group)``. Each site keeps
one decision per *bucket* of the total entry count ``K`` (half an octave
wide). A cached decision is reused while (a) fewer than ``reevaluate_every``
calls have used it, (b) ``k_max`` and ``K`` stay within a factor
``1 + count_band`` of the values it was taken at, and (c) the overlap stays
within ``overlap_band``. Otherwise the call is decided again, and the
algorithm the site ran last is kept as long as its predicted time is within
``margin`` (relative) of the best: two near-equal algorithms do not flap.
Predicted times are rounded to 6 significant digits before they are
compared, so ranks agree even if their floating point differs in the last bits.

Environment (read by :func:`colltune.model.policy.policy_from_env` when a selector is
built; pass ``environ={}`` to ignore it)
--------------------------------------------------------------------------

``COLLTUNE_ALGO``
    Force an algorithm for every ``auto`` call (an explicit ``algorithm=``
    argument is the caller's own decision and is kept).
``COLLTUNE_POLICY``
    The policy file; it replaces a policy passed in code (the environment
    overrides the code, as NCCL's variables do).
``COLLTUNE_PROFILE``
    The profile file; it replaces a profile passed in code and the one the
    policy names.
``COLLTUNE_DEBUG``
    ``info`` or ``debug``: attach a stderr handler to the ``colltune`` logger at
    that level if it has none. Decisions are logged at DEBUG, one line each,
    with their reason.
``COLLTUNE_LOG_FILE``
    Append one JSON line per decision taken (not per cached reuse) to this
    file; ``%h``, ``%p`` and ``%r`` expand to host, process id and rank.

Example:
    >>> import colltune
    >>> sel = colltune.configure(policy="profiles/policies/example.yaml")   # doctest: +SKIP
    >>> res = colltune.sparse_allreduce(idx, vals, n, name="emb.weight")     # doctest: +SKIP
    >>> res.algorithm, res.decision.reason                                # doctest: +SKIP
    ('allgather', 'cost model (learned, cpu-gloo.yaml): allgather 1.2 ms < ...')
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

from colltune import algorithms as _algorithms
from colltune.algorithms.errors import ColltuneTypeError, ColltuneValueError
from colltune.model.features import (
    Features,
    estimate_union_collective,
    features_by_algorithm,
    normalize_dtype,
    overlap_from_sketches,
    overlap_from_union,
    topk_features,
)
from colltune.model.policy import (
    AUTO,
    DEFAULT_POLICY,
    Decision,
    Overrides,
    Policy,
    config_digest,
    load_policy,
    policy_from_env,
)
from colltune.model.profile import Profile, ProfileError, load_profile
from colltune.select import online as _online

if TYPE_CHECKING:  # the cost models are imported when a profile is first used
    from colltune.model.cost_model import AnalyticModel, Domain, LearnedCostModel

__all__ = [
    "SAFE_DEFAULT",
    "SHIPPED_PROFILES",
    "Choice",
    "Selector",
    "Explanation",
    "configure",
    "get_selector",
    "selector_for",
    "profiles_dir",
    "shipped_profile",
    "format_explanation",
    "encoded_nccl_release",
    "installed_nccl_version",
    "nccl_version_warning",
    "warn_nccl_version_once",
]

logger = logging.getLogger(__name__)

#: What runs when no profile can be loaded: never wrong, never terrible.
SAFE_DEFAULT = "dense"
#: The profile shipped for each backend (file names in :func:`profiles_dir`).
SHIPPED_PROFILES: dict[str, str] = {"gloo": "cpu-gloo.yaml", "nccl": "analytic-nccl.yaml"}
#: The most call sites (name, size, row width, dtype) a selector remembers per process group; the least
#: recently used site of that group is forgotten first, and decides afresh if it comes back.
MAX_SITES = 4096
#: How many groups a selector holds sites for before it forgets those of destroyed groups (a group's
#: serial is never reused, and a living group's sites are never forgotten for another group's sake).
MAX_GROUPS = 256

Source = Literal["forced", "policy", "model", "hysteresis", "explore", "default", "single-rank", "empty", "no-values",
                 "requested"]



def candidates() -> tuple[str, ...]:
    """Return the algorithms ``auto`` chooses among: every registered one with a cost schedule, in registry order.

    The order breaks ties: the earlier wins.
    """
    return tuple(n for n in _algorithms.names() if _algorithms.get(n).TERMS)

_M64 = (1 << 64) - 1


def _signed64(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >= (1 << 63) else x


def _q(t: float) -> float:
    """Round a predicted time to 6 significant digits (ranks then agree despite last-bit differences)."""
    return float(f"{t:.6g}")


def _ranked(pred: Mapping[str, float]) -> list[str]:
    """The candidates fastest first by ``pred`` (rounded times), ties in registry order."""
    names = [a for a in candidates() if a in pred]
    return sorted(names, key=lambda a: (pred[a], names.index(a)))


@dataclass(frozen=True)
class _Call:
    """What a first-call decision needs to know of an exact call, identical on every rank."""

    name: str | None
    size: int
    row_numel: int
    dtype_name: str
    counts: tuple[int, ...]
    world_size: int
    backend: str | None = None
    ranks_per_node: int | None = None

    @property
    def numel(self) -> int:
        return self.size * self.row_numel

    @property
    def density(self) -> float:
        return sum(self.counts) / (self.world_size * self.size)

    def features(self, overlap: float) -> Features:
        """The call's features at ``overlap`` (the union it implies)."""
        k_sum, k_max = sum(self.counts), max(self.counts)
        return Features.build(numel=self.size, row_numel=self.row_numel, dtype=self.dtype_name,
                              k_per_rank=list(self.counts), union=k_sum - overlap * (k_sum - k_max),
                              ranks_per_node=self.ranks_per_node)


def _ms(us: float) -> str:
    return f"{us / 1e3:.3g} ms" if us >= 100 else f"{us:.3g} us"


# --------------------------------------------------------------------------- shipped profiles


def profiles_dir() -> Path | None:
    """Return the directory of the shipped profiles, or ``None`` when it cannot be found.

    An installed package carries them as ``colltune/profiles/`` (package
    data); a source checkout or an editable install finds ``profiles/`` next
    to the ``colltune`` package's folder.
    """
    package = Path(__file__).resolve().parent.parent
    for cand in (package / "profiles", package.parent / "profiles"):
        if (cand / SHIPPED_PROFILES["nccl"]).is_file():
            return cand
    return None


def shipped_profile(backend: str) -> Path | None:
    """Return the path of the profile shipped for ``backend`` (``gloo``, ``nccl``), or ``None``."""
    d = profiles_dir()
    name = SHIPPED_PROFILES.get(str(backend).lower())
    if d is None or name is None:
        return None
    path = d / name
    return path if path.is_file() else None


# --------------------------------------------------------------------------- the NCCL release priced

_nccl_warning_lock = threading.Lock()
#: Whether this process has warned about the NCCL release (once per process, whichever selector or command).
_nccl_warned = False


def encoded_nccl_release() -> tuple[int, int, int]:
    """Return the NCCL release the analytic NCCL model encodes: ``source.release`` of ``profiles/nccl-tuning.yaml``.

    Example:
        >>> encoded_nccl_release()  # doctest: +SKIP
        (2, 21, 5)
    """
    from colltune.model.nccl import load_tuning

    tag = str(load_tuning().source["release"])  # e.g. "v2.21.5-1": NCCL's tag, release 2.21.5, package build 1
    parts = tag.lstrip("v").split("-")[0].split(".")
    return int(parts[0]), int(parts[1]), int(parts[2])


def installed_nccl_version() -> tuple[int, ...] | None:
    """Return the NCCL release torch runs, ``(major, minor, patch)``, or ``None`` without NCCL (a CPU build).

    Reads ``torch.cuda.nccl.version()`` only when torch is loaded already: the selector imports no torch
    itself, and an NCCL group means torch is loaded.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        version = torch.cuda.nccl.version()  # a tuple on CUDA builds, (2, 28, 9) or with a suffix appended
    except Exception:  # CPU builds have no NCCL bindings (AttributeError, RuntimeError)
        return None
    if not isinstance(version, tuple) or len(version) < 3:
        return None
    return tuple(int(v) for v in version[:3])


def nccl_version_warning(installed: Sequence[int] | None,
                         encoded: tuple[int, int, int] | None = None) -> str | None:
    """Return the warning for an installed NCCL other than the release the analytic NCCL model encodes, or ``None``.

    Args:
        installed: the installed release as ``torch.cuda.nccl.version()`` gives it; ``None`` (no NCCL)
            warns of nothing.
        encoded: the model's release (default: :func:`encoded_nccl_release`).

    Returns:
        The message, or ``None`` when there is no NCCL or its major, minor and patch match.

    Example:
        >>> nccl_version_warning((2, 21, 5), (2, 21, 5)) is None
        True
    """
    if not installed or len(installed) < 3:
        return None
    have = tuple(int(v) for v in installed[:3])
    want = encoded or encoded_nccl_release()
    if have == tuple(want):
        return None
    have_s, want_s = ".".join(map(str, have)), ".".join(map(str, want))
    return (f"NCCL {have_s} is installed, but colltune's analytic NCCL model encodes NCCL {want_s} "
            f"(profiles/nccl-tuning.yaml): the NCCL algorithm and protocol it assumes per collective, and their "
            f"latencies and bandwidths, follow {want_s}, so predicted times, and auto's choice where algorithms "
            f"are close, may be off for {have_s}. A profile measured on this cluster replaces them: "
            f"run `colltune profile --backend nccl` under torchrun and point COLLTUNE_PROFILE at it.")


def warn_nccl_version_once(installed: Sequence[int] | None = None) -> str | None:
    """Log :func:`nccl_version_warning` at WARNING once per process; return the message when this call logged it.

    Args:
        installed: the installed release (default: :func:`installed_nccl_version`).
    """
    global _nccl_warned
    if _nccl_warned:
        return None
    try:
        message = nccl_version_warning(installed if installed is not None else installed_nccl_version())
    except ColltuneValueError:  # an unreadable tuning file: pricing with it raises and says why, a warning need not
        return None
    if message is None:
        return None
    with _nccl_warning_lock:
        if _nccl_warned:
            return None
        _nccl_warned = True
    logger.warning("%s", message)
    return message


# --------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Choice:
    """The selector's answer for one call (``result.decision``).

    Attributes:
        algorithm: the algorithm that runs.
        reason: one line saying why.
        source: what decided: ``forced`` (``COLLTUNE_ALGO``), ``policy``,
            ``model`` (the cost model's argmin), ``hysteresis`` (the site's
            previous algorithm kept, within ``margin`` of the best),
            ``explore`` (another algorithm tried now and then, online),
            ``default`` (no profile), ``single-rank``, ``empty`` (no entries
            anywhere), ``no-values`` (rows of no elements) or ``requested``
            (an explicit ``algorithm=``).
        knobs: the policy's knobs for ``algorithm`` (the caller's ``knobs=``
            are applied on top).
        predicted_us: predicted time of each algorithm in microseconds, when
            the cost model was consulted.
        rule: the matching policy rule (``rule 2 'name'``), if any.
        term: the model term that decided (``algorithm.term``: the term that
            adds most to the runner-up's predicted time over the winner's).
        overlap: the overlap the decision used, if any.
        overlap_source: ``sketch (exact)`` or ``sketch (+-w)`` (from the
            sketches in the metadata record, exact or within ``w``),
            ``bitmap`` (the collective estimate), ``previous call`` (the
            exact overlap of the last call at this site), ``counts`` (known
            from the counts alone), or ``None``.
        cached: whether this call reused an earlier decision.
        features: the features the cost model saw, if it was consulted.
        state_knobs: the policy's top-k state knobs for ``algorithm``.
        corrected_us: ``predicted_us`` corrected by the site's own
            measurements (online correction), what the argmin compared.
        measured_us: the latest measured time of each algorithm at the
            site (the maximum over ranks), when online correction has one.
    """

    algorithm: str
    reason: str
    source: Source
    knobs: Mapping[str, Any] = field(default_factory=dict)
    predicted_us: Mapping[str, float] | None = None
    rule: str | None = None
    term: str | None = None
    overlap: float | None = None
    overlap_source: str | None = None
    cached: bool = False
    features: Features | None = None
    state_knobs: Mapping[str, Any] = field(default_factory=dict)
    corrected_us: Mapping[str, float] | None = None
    measured_us: Mapping[str, float] | None = None

    def __str__(self) -> str:
        return f"{self.algorithm} ({self.reason})"

    def as_dict(self) -> dict[str, Any]:
        """Return the decision as JSON-ready plain data."""
        f = self.features
        return {
            "algorithm": self.algorithm,
            "source": self.source,
            "reason": self.reason,
            "knobs": dict(self.knobs),
            "predicted_us": None if self.predicted_us is None else dict(self.predicted_us),
            "rule": self.rule,
            "term": self.term,
            "overlap": self.overlap,
            "overlap_source": self.overlap_source,
            "cached": self.cached,
            "state_knobs": dict(self.state_knobs),
            "corrected_us": None if self.corrected_us is None else dict(self.corrected_us),
            "measured_us": None if self.measured_us is None else dict(self.measured_us),
            "features": None if f is None else {
                "numel": f.numel, "row_numel": f.row_numel, "dtype": f.dtype, "world_size": f.world_size,
                "k_max": f.k_max, "k_sum": f.k_sum, "union": f.union, "overlap": f.overlap,
                "density": f.density,
            },
        }

    def _as_cached(self) -> "Choice":
        return dataclasses.replace(self, cached=True)


_REQUESTED: dict[str, Choice] = {}
_EMPTY = Choice("allgather", "no entries on any rank: nothing moves", "empty")
_SINGLE = Choice("allgather", "single rank: no communication", "single-rank")
_NO_VALUES = Choice("allgather", "rows of no elements: only the union of the indices moves", "no-values")


def requested(algorithm: str) -> Choice:
    """Return the (shared) decision record of an explicitly requested algorithm."""
    got = _REQUESTED.get(algorithm)
    if got is None:
        got = Choice(algorithm, "requested by the caller", "requested")
        if algorithm in _algorithms.names():  # shared per registered name; bounded by the registry
            _REQUESTED[algorithm] = got
    return got


# --------------------------------------------------------------------------- cost models


class _Model:
    """A profile's cost model behind one interface: predicted times and (calibrated) analytic terms.

    It is a :class:`~colltune.model.cost_model.CostModel`: ``predict_times`` and
    ``predict_times_many`` are :meth:`predict` and :meth:`predict_many`.
    """

    __slots__ = ("kind", "label", "analytic", "learned", "domain")

    def __init__(self, kind: str, label: str, analytic: AnalyticModel, learned: LearnedCostModel | None,
                 domain: Domain | None = None) -> None:
        self.kind, self.label, self.analytic, self.learned = kind, label, analytic, learned
        self.domain = domain  # where the learned model was measured; it fades out beyond (None: everywhere)

    def extrapolation(self, f: Features) -> str | None:
        """Return why the learned model is not (fully) trusted for ``f``, or ``None``."""
        return None if self.learned is None or self.domain is None else self.domain.describe(f)

    def predict(self, f: Features) -> dict[str, float]:
        return self.predict_many([f])[0]

    def predict_many(self, feats: Sequence[Features]) -> list[dict[str, float]]:
        """Predict several calls at once (one pass through the learned model's trees)."""
        if self.learned is None:
            return self.analytic.predict_times_many(feats)
        want = candidates()
        out = []
        for f, got in zip(feats, self.learned.predict_times_many(feats)):
            w = 1.0 if self.domain is None else self.domain.weight(f)
            if w < 1.0 or any(a not in got for a in want):  # outside the measurements: the analytic model
                base = self.analytic.predict(f)
                got = {a: _blend(got[a], base[a], w) if a in got else base[a] for a in want}
            out.append(got)
        return out

    predict_times = predict
    predict_times_many = predict_many

    def terms(self, f: Features) -> dict[str, dict[str, float]]:
        return self.analytic.terms(f)


def _blend(learned: float, analytic: float, w: float) -> float:
    """Return ``learned ** w * analytic ** (1 - w)``: the learned model's share ``w`` in log time."""
    if w >= 1.0:
        return learned
    if w <= 0.0 or learned <= 0.0 or analytic <= 0.0:
        return analytic
    return math.exp(w * math.log(learned) + (1.0 - w) * math.log(analytic))


def model_for_profile(profile: Profile, label: str = "<profile>") -> _Model:
    """Return the cost model a profile describes.

    See :func:`colltune.model.cost_model.model_for_profile`.
    """
    from colltune.model import cost_model

    t0 = time.perf_counter()
    model, source = cost_model.model_for_profile(profile)
    if isinstance(model, cost_model.AnalyticModel):
        return _Model("analytic", label, model, None)
    if source == "fitted":
        logger.info("profile %s: fitted the learned model on %d measurements in %.1f s",
                    label, len(profile.measurements), time.perf_counter() - t0)
    # Beyond what was measured the model fades into the analytic one: NCCL's model of the profile's cluster
    # when the profile names its GPUs, else the calibrated alpha-beta constants.
    network = cost_model.Network.of(profile.meta)
    fallback = model.analytic_ if network is None else cost_model.AnalyticModel(profile.primitives, network=network)
    return _Model("learned", label, fallback, model, cost_model.Domain.of(profile.measurements))


# --------------------------------------------------------------------------- per-site state


class _Entry:
    """A cached decision and where it holds: the ``[lo, hi]`` of ``k_max``, ``K`` and the overlap it was taken at.

    A decision taken again in its bucket that comes out the same widens the
    ranges to both points (:meth:`widened`): counts and overlaps that wander
    within one bucket (a few lookups more or less per call, each call's own
    overlap) stop being decided again once both ends are confirmed.
    """

    __slots__ = ("choice", "cached", "k_max", "k_sum", "overlap", "age")

    def __init__(self, choice: Choice, k_max: int, k_sum: int, overlap: float | None) -> None:
        self.choice = choice
        self.cached = choice._as_cached()
        self.k_max, self.k_sum = (k_max, k_max), (k_sum, k_sum)
        self.overlap = None if overlap is None else (overlap, overlap)
        self.age = 1

    def widened(self, old: "_Entry | None") -> "_Entry":
        """This entry, its ranges covering ``old``'s too when ``old`` decided the same algorithm."""
        if old is not None and old.choice.algorithm == self.choice.algorithm:
            self.k_max = _cover(self.k_max, old.k_max)
            self.k_sum = _cover(self.k_sum, old.k_sum)
            if self.overlap is not None and old.overlap is not None:
                self.overlap = _cover(self.overlap, old.overlap)
        return self

    def overlap_holds(self, overlap: float | None, band: float) -> bool:
        """Whether ``overlap`` is within ``band`` of the overlaps this decision was taken at (unknown: when both are)."""
        if self.overlap is None or overlap is None:
            return self.overlap is None
        return self.overlap[0] - band <= overlap <= self.overlap[1] + band


def _cover(a: tuple[Any, Any], b: tuple[Any, Any]) -> tuple[Any, Any]:
    return min(a[0], b[0]), max(a[1], b[1])


class _Site:
    __slots__ = ("overlap", "overlap_source", "last", "latest", "entries", "ratios", "pool", "measured", "options",
                 "calls", "explored_at", "explore_gap", "measured_at", "total_us", "explore_us", "seeded", "warm",
                 "last_call", "samples")

    def __init__(self, pool: _online.Ratios | None = None) -> None:
        self.overlap: float | None = None
        self.overlap_source: str | None = None
        self.last: str | None = None  # the last decision made afresh (the incumbent)
        self.latest: str | None = None  # the last decision returned, cached or not
        self.entries: dict[int, _Entry] = {}
        # Online correction (colltune.select.online): measured / predicted per algorithm, the latest figures,
        # each algorithm's knobs from the last decision (what an exploring call runs with), calls decided by
        # the model, and the measured time of the site's calls and of its exploring ones.
        self.ratios: dict[str, Any] = {}
        # The ratios over every site of the site's group: only calls on the group teach them, so every rank of
        # the group holds the same (ranks of different subgroups learn different ones, and never share them).
        self.pool = pool if pool is not None else _online.Ratios()
        self.seeded = ""  # the site's key in a state file, once its first decision knew its backend
        self.warm = False  # whether the site's first measured call (one-off set-up included) has gone by
        self.measured: dict[str, float] = {}
        self.options: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        self.calls = 0
        self.explored_at = 0
        self.explore_gap = _online.EXPLORE_EVERY  # calls from one exploring call to the next, at least
        self.measured_at: dict[str, int] = {}  # per algorithm, the site's call count at its latest measurement
        self.total_us = 0.0
        self.explore_us = 0.0
        # The last completed call's (k_sum, k_max, union), and the site's recent measured calls (a state file
        # keeps them: colltune fit --online folds them into a profile).
        self.last_call: tuple[int, int, int] | None = None
        self.samples: list[list[Any]] = []


def _decided(site: _Site, bucket: int, algorithm: str) -> None:
    """Record a decision taken afresh in ``bucket``; a change of algorithm starts the site's exploring waits over.

    The change is against the bucket's previous decision (the site's last,
    for a bucket decided for the first time): a site whose calls alternate
    between two buckets decided differently is not changing its mind, and
    keeps the wait its exploring calls have earned.
    """
    prev = site.entries.get(bucket)
    before = prev.choice.algorithm if prev is not None else site.last
    if before is not None and before != algorithm:
        site.explore_gap = _online.EXPLORE_EVERY
    site.last = site.latest = algorithm


#: Values of ``COLLTUNE_ONLINE`` (lower case) that turn online correction off, and on.
_OFF, _ON = ("0", "off", "false", "no"), ("1", "on", "true", "yes", "")


def _online_setting(online: Any, environ: Mapping[str, str]) -> bool:
    """Return whether online correction is on: ``online`` when given, else ``COLLTUNE_ONLINE`` (on by default)."""
    if online is not None:
        if not isinstance(online, bool):
            raise ColltuneValueError(f"online must be True, False or None, but got {online!r}.")
        return online
    raw = environ.get("COLLTUNE_ONLINE", "")
    if raw.strip().lower() in _OFF:
        return False
    if raw.strip().lower() in _ON:
        return True
    raise ColltuneValueError(f"COLLTUNE_ONLINE must be 0 or 1 (off or on), but got {raw!r}; unset it for on.",
                             argument="environment")


def _save_at_exit(ref: Any) -> None:
    sel = ref()
    if sel is not None:
        sel.save_online_state()


def _bucket(k_sum: int) -> int:
    return int(2.0 * math.log2(k_sum)) if k_sum > 0 else -1


# --------------------------------------------------------------------------- the selector


def _as_policy(policy: Policy | str | os.PathLike[str] | None) -> Policy | None:
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, os.PathLike)):
        return load_policy(policy)
    raise ColltuneTypeError(
        f"policy must be a colltune.model.policy.Policy, a path to a policy YAML file, a Selector or None, "
        f"but got {type(policy).__name__}."
    )


def _as_profile(profile: Profile | str | os.PathLike[str] | None) -> tuple[Profile | None, str | None]:
    if profile is None:
        return None, None
    if isinstance(profile, Profile):
        return profile, "<profile>"
    if isinstance(profile, (str, os.PathLike)):
        return load_profile(profile), os.path.basename(os.fspath(profile))
    raise ColltuneTypeError(
        f"profile must be a colltune.model.profile.Profile, a path to a profile YAML file or None, "
        f"but got {type(profile).__name__}."
    )


_LOGGING_SET = False


def _enable_logging(level: int) -> None:
    """Give the ``colltune`` logger a stderr handler at ``level`` unless logging is configured already."""
    global _LOGGING_SET
    root = logging.getLogger("colltune")
    if level is not None and (root.level == logging.NOTSET or root.level > level):
        root.setLevel(level)
    if not _LOGGING_SET and not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("colltune %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        _LOGGING_SET = True


class _Sites:
    """Call sites per process group, each group's bounded on its own.

    A site key ends with its group's serial. Every rank of a group makes
    the same calls on that group, so evicting the least recently used site
    *of that group* forgets the same site on every rank of it. One bound
    across groups would not: ranks that belong to different subgroups make
    different calls, and would forget different sites of a group they share
    (one rank deciding afresh, with a sketch, while another does not). So
    groups are never evicted for one another: past :data:`MAX_GROUPS`, the
    sites of groups destroyed meanwhile go (:func:`~colltune.algorithms.comm.live_serials`).
    """

    __slots__ = ("groups", "pools")

    def __init__(self) -> None:
        self.groups: OrderedDict[Any, OrderedDict[tuple, _Site]] = OrderedDict()
        self.pools: dict[Any, _online.Ratios] = {}  # per group: online correction's ratios over its sites

    def get(self, key: tuple) -> _Site | None:
        sites = self.groups.get(key[-1])
        return None if sites is None else sites.get(key)

    def site(self, key: tuple) -> _Site:
        """Return the site of ``key``, made if new, and mark it the group's most recently used."""
        sites = self.groups.get(key[-1])
        if sites is None:
            if len(self.groups) >= MAX_GROUPS:
                from colltune.algorithms.comm import live_serials  # only here: the selector loads no torch itself

                alive = live_serials()
                for gone in [g for g in self.groups if g not in alive]:
                    del self.groups[gone]
                    self.pools.pop(gone, None)
            sites = self.groups[key[-1]] = OrderedDict()
        site = sites.get(key)
        if site is None:
            site = sites[key] = _Site(self.pools.setdefault(key[-1], _online.Ratios()))
            if len(sites) > MAX_SITES:
                sites.popitem(last=False)
        else:
            sites.move_to_end(key)
        return site

    def clear(self) -> None:
        self.groups.clear()
        self.pools.clear()

    def __len__(self) -> int:
        return sum(len(sites) for sites in self.groups.values())


class Selector:
    """Decide which algorithm runs each ``auto`` call, the same on every rank.

    Args:
        policy: a :class:`~colltune.model.policy.Policy` or a path to a policy file;
            ``None`` for ``COLLTUNE_POLICY`` or else no rules. A policy set in
            the environment replaces this one.
        profile: a :class:`~colltune.model.profile.Profile` or a path; ``None`` for the
            policy's ``profile``, else the profile shipped for the group's
            backend. Without any, the safe default ``dense`` runs.
        reevaluate_every: decide again after a decision served this many calls.
        margin: hysteresis: the site's previous algorithm is kept while its
            predicted time is at most ``1 + margin`` times the best.
        count_band: a cached decision holds while ``k_max`` and ``K`` stay
            within this relative factor (0.25: within x1.25 either way).
        overlap_band: ... and the overlap within this absolute distance.
        bitmap_seed: hash seed of the overlap estimate.
        environ: the environment to read (``os.environ`` by default; ``{}``
            ignores it).
        online: correct the profile's predictions with the calls' own
            measured times, and try another algorithm now and then
            (:mod:`colltune.select.online`); ``None``: on, unless
            ``COLLTUNE_ONLINE=0``. Part of the settings every rank must share.
        online_state: a file the corrections are saved to (every
            :data:`~colltune.select.online.SAVE_EVERY` measurements and at
            exit, atomically) and loaded from when the selector is made, so
            the next run of the job starts from what this one learned;
            ``None``: ``COLLTUNE_ONLINE_STATE``, else none. A file that cannot
            be read, or another colltune's, is ignored with a warning. Every
            rank must load the same file (its digest is part of the settings).

    Raises:
        PolicyError: an invalid policy (file, line and allowed values named)
            or environment variable.
        ProfileError: an unreadable or invalid profile.
        ColltuneValueError: a bad setting.
    """

    def __init__(
        self,
        policy: Policy | str | os.PathLike[str] | None = None,
        profile: Profile | str | os.PathLike[str] | None = None,
        *,
        reevaluate_every: int = 64,
        margin: float = 0.05,
        count_band: float = 0.25,
        overlap_band: float = 0.1,
        bitmap_seed: int = 0,
        environ: Mapping[str, str] | None = None,
        online: bool | None = None,
        online_state: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(reevaluate_every, bool) or not isinstance(reevaluate_every, int) or reevaluate_every < 1:
            raise ColltuneValueError(f"reevaluate_every must be an int >= 1, but got {reevaluate_every!r}.")
        for label, v in (("margin", margin), ("count_band", count_band), ("overlap_band", overlap_band)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < math.inf):
                raise ColltuneValueError(f"{label} must be a number >= 0, but got {v!r}.")
        env_policy, overrides = policy_from_env(os.environ if environ is None else environ)
        given = _as_policy(policy)
        if env_policy is not None and given is not None and env_policy.digest != given.digest:
            logger.info("COLLTUNE_POLICY=%s replaces the policy %s passed in code", overrides.policy_path, given.source)
        self.policy: Policy = env_policy or given or DEFAULT_POLICY
        self.overrides: Overrides = overrides
        if overrides.profile_path is not None:
            if profile is not None:
                logger.info("COLLTUNE_PROFILE=%s replaces the profile passed in code", overrides.profile_path)
            profile = overrides.profile_path
        self._profile, self._profile_label = _as_profile(profile)
        if self._profile is None and self.policy.profile_path is not None:
            self._profile = load_profile(self.policy.profile_path)
            self._profile_label = os.path.basename(str(self.policy.profile_path))
        self.reevaluate_every = int(reevaluate_every)
        self.margin = float(margin)
        self.count_band = float(count_band)
        self.overlap_band = float(overlap_band)
        self.bitmap_seed = int(bitmap_seed)
        self._init_online(online, online_state, os.environ if environ is None else environ)
        self._policy_uses_overlap = any(r.overlap is not None for r in self.policy.rules)
        self._models: dict[str, _Model | None] = {}
        self._digests: dict[str, int] = {}
        self._sites = _Sites()
        self._settings = _signed64(int.from_bytes(hashlib.blake2b(json.dumps(
            [self.reevaluate_every, self.margin, self.count_band, self.overlap_band, self.bitmap_seed, self.online,
             self._state_code]
        ).encode(), digest_size=8).digest(), "big"))
        if overrides.log_level is not None:
            _enable_logging(overrides.log_level)
        self._log_file_cache: dict[int | None, str | None] = {}
        self._forced_choice: Choice | None = None
        if overrides.algorithm is not None and overrides.algorithm != AUTO:
            self._forced_choice = self._forced()

    def __repr__(self) -> str:
        return (f"Selector(policy={self.policy.source!r}, profile={self._profile_label!r}, "
                f"reevaluate_every={self.reevaluate_every}, margin={self.margin})")

    # -- configuration shared across ranks -----------------------------------

    def model(self, backend: str = "gloo") -> _Model | None:
        """Return the cost model used on ``backend`` (``None``: no profile, the safe default runs)."""
        key = str(backend).lower()
        if key in self._models:
            return self._models[key]
        profile, label = self._profile, self._profile_label
        if profile is None:
            path = shipped_profile(key)
            if path is not None:
                try:
                    profile, label = load_profile(path), path.name
                except ProfileError as exc:
                    logger.warning("the shipped profile %s cannot be loaded (%s); auto falls back to %s",
                                   path.name, exc, SAFE_DEFAULT)
                    profile = None
        got = None if profile is None else model_for_profile(profile, label or "<profile>")
        if key == "nccl" and got is not None and got.learned is None and got.analytic.network is not None:
            warn_nccl_version_once()  # no measurements: NCCL's collectives are priced by one NCCL release's model
        self._models[key] = got
        self._digests[key] = self._compute_digest(profile)
        if got is None:
            logger.info("no profile for backend %s: auto runs the safe default %s", key, SAFE_DEFAULT)
        else:
            logger.debug("backend %s: cost model %s from %s", key, got.kind, got.label)
        return got

    def profile(self, backend: str = "gloo") -> Profile | None:
        """Return the profile in use on ``backend``, or ``None``."""
        if self._profile is not None:
            return self._profile
        path = shipped_profile(backend)
        return None if path is None else load_profile(path)

    def _compute_digest(self, profile: Profile | None) -> int:
        cfg = config_digest(self.policy, self.overrides)
        prof = 0 if profile is None else profile.digest
        return _signed64(cfg ^ prof ^ self._settings)

    def digest(self, backend: str = "gloo") -> int:
        """Return the signed 64-bit hash of everything that must agree across ranks.

        It covers the policy, ``COLLTUNE_ALGO``, the profile in use on
        ``backend`` and the selector's settings; :func:`colltune.sparse_allreduce`
        sends it (with the tensor name folded in) in the metadata record.
        """
        d = self._digests.get(backend)
        if d is None:
            self.model(backend)
            d = self._digests[str(backend).lower()]
            self._digests[backend] = d
        return d

    def reset(self) -> None:
        """Forget every cached decision and overlap (the next call at each site decides afresh)."""
        self._sites.clear()

    # -- the decision ---------------------------------------------------------

    def _site(self, key: tuple) -> _Site:
        return self._sites.site(key)

    def _in_band(self, e: _Entry, k_max: int, k_sum: int, overlap: float | None) -> bool:
        hi = 1.0 + self.count_band
        if not (k_sum * hi >= e.k_sum[0] and k_sum <= e.k_sum[1] * hi
                and k_max * hi >= e.k_max[0] and k_max <= e.k_max[1] * hi):
            return False
        return e.overlap_holds(overlap, self.overlap_band)

    def decide_sparse(
        self,
        site_key: tuple,
        *,
        comm: Any,
        backend: str,
        name: str | None,
        size: int,
        row_numel: int,
        dtype: Any,
        counts: Sequence[int],
        indices: Any,
        sketches: Sequence[Any] | None = None,
        ranks_per_node: int | None = None,
    ) -> Choice:
        """Return the algorithm of one exact sparse allreduce.

        Called by every rank after the metadata exchange, with the same
        ``site_key``, ``counts`` and shared arguments; ``indices`` are this
        rank's coalesced indices (used only by the overlap estimate). It runs
        a collective only when the overlap is both unknown and decisive.

        Args:
            site_key: the call site (see the module docstring); every rank the same.
            comm: the group (:class:`colltune.algorithms.Comm`).
            backend: the group's backend name (picks the shipped profile).
            name: the tensor's name for policy globs, or ``None``.
            size: rows ``n``.
            row_numel: elements per row.
            dtype: the value dtype.
            counts: every rank's entry count after coalescing.
            indices: this rank's coalesced indices.
            sketches: every rank's overlap sketch from the metadata record
                (:func:`colltune.model.features.sketch_hashes`), when :meth:`wants_sketch`
                asked for them, else ``None``.

        Returns:
            The :class:`Choice`; identical on every rank.
        """
        if self._forced_choice is not None:
            return self._forced_choice
        p = comm.world_size
        k_sum = sum(counts)
        k_max = max(counts) if counts else 0
        cached = self._cached_sparse(site_key, name, size, k_sum, k_max, p)
        if cached is not None:
            return self._explored("sparse", name, site_key, cached, comm.rank)
        if p == 1:
            return _SINGLE
        if k_sum == 0:
            return _EMPTY
        if row_numel == 0:  # the same for every algorithm, and outside what the cost model describes
            return _NO_VALUES
        site = self._seeded(site_key, backend)
        call = _Call(name, size, row_numel, normalize_dtype(dtype), tuple(counts), p, backend, ranks_per_node)
        choice = self._choose_sparse(site, call, comm, backend, indices, sketches)
        bucket = _bucket(k_sum)
        _decided(site, bucket, choice.algorithm)
        site.entries[bucket] = _Entry(choice, k_max, k_sum, choice.overlap).widened(site.entries.get(bucket))
        self._log("sparse", name, site_key, choice, comm.rank)
        return self._explored("sparse", name, site_key, choice, comm.rank)

    def _cached_sparse(self, site_key: tuple, name: str | None, size: int, k_sum: int, k_max: int,
                       p: int) -> Choice | None:
        """Return the site's cached choice for this many entries while it is young and the call in its band."""
        site = self._sites.get(site_key)
        if site is None or k_sum == 0:
            return None
        e = site.entries.get(_bucket(k_sum))
        if e is None or e.age >= self.reevaluate_every or not self._in_band(e, k_max, k_sum, site.overlap):
            return None
        e.age += 1
        site.latest = e.choice.algorithm
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("sparse %s n=%d K=%d k_max=%d P=%d -> %s (cached: %s)",
                         name or "-", size, k_sum, k_max, p, e.choice.algorithm, e.choice.reason)
        return e.cached

    def _choose_sparse(self, site: Any, call: _Call, comm: Any, backend: str, indices: Any,
                       sketches: Sequence[Any] | None) -> Choice:
        """Decide a call the cache did not: the policy, the overlap when it matters, then the cost model."""
        name, p, k_sum, k_max = call.name, call.world_size, sum(call.counts), max(call.counts)
        dtype_name, density, numel = call.dtype_name, call.density, call.numel
        overlap, source = site.overlap, site.overlap_source
        decision = self._match(name, numel, density, p, overlap, dtype_name, backend)
        pinned = decision.algorithm != AUTO and (overlap is not None or not self._policy_uses_overlap)
        model = None if pinned else self.model(backend)
        if not pinned and overlap is None and (model is not None or self._policy_uses_overlap):
            if k_sum == k_max:  # at most one rank holds entries: nothing overlaps, nothing learned
                overlap, source = 0.0, "counts"
            else:
                overlap, source = self._first_overlap(comm, indices, sketches, model, call)
                site.overlap, site.overlap_source = overlap, source
            if self._policy_uses_overlap:
                decision = self._match(name, numel, density, p, overlap, dtype_name, backend)
        if decision.algorithm != AUTO:
            return self._from_policy(decision, overlap, source)
        if model is None:
            return Choice(SAFE_DEFAULT, f"no profile for backend {backend}: the safe default {SAFE_DEFAULT}",
                          "default", _knobs_for(decision, SAFE_DEFAULT), overlap=overlap, overlap_source=source)
        f = call.features(overlap)
        return self._from_model(model, {a: f for a in candidates()}, decision, site, overlap, source)

    def last_choice(self, site_key: tuple) -> str | None:
        """Return the algorithm of the site's last decision (``None`` before its first).

        The front door asks that algorithm for its metadata payload: the
        likeliest choice again. Every rank answers the same.
        """
        if self._forced_choice is not None:
            return self._forced_choice.algorithm
        site = self._sites.get(site_key)
        return None if site is None else site.latest

    def wants_sketch(self, site_key: tuple, backend: str) -> bool:
        """Return whether the next exact call at this site should carry an overlap sketch.

        True when no overlap is known at the site yet and the decision may
        need one (a cost model, or a policy rule on overlap), unless an
        environment override forces the algorithm. Every rank answers the
        same, since every rank holds the same history of the site.
        """
        if self._forced_choice is not None:
            return False
        site = self._sites.get(site_key)
        if site is not None and site.overlap is not None:
            return False
        return self._policy_uses_overlap or self.model(backend) is not None

    def _first_overlap(
        self, comm: Any, indices: Any, sketches: Sequence[Any] | None, model: _Model | None, call: _Call
    ) -> tuple[float, str]:
        """Return the overlap of a site's first call and where it came from.

        The sketches from the metadata record give it without a collective:
        exactly when every rank's indices fit, else within a band of about
        two standard errors. Only when the decision would change inside that
        band (the policy's rule or the cost model's argmin at its two ends)
        does the one-collective bitmap estimate run.
        """
        if sketches is not None:
            u, overlap, half = overlap_from_sketches(call.counts, sketches)
            if half == 0.0:
                return overlap, "sketch (exact)"
            lo, hi = max(0.0, overlap - half), min(1.0, overlap + half)
            if self._same_decision(model, call, (overlap, lo, hi)):
                return overlap, f"sketch (+-{half:.2f})"
        _, overlap = estimate_union_collective(comm, indices, call.counts, seed=self.bitmap_seed)
        return overlap, "bitmap"

    def _same_decision(self, model: _Model | None, call: _Call, overlaps: Sequence[float]) -> bool:
        """Return whether the policy and the cost model decide alike at every one of ``overlaps``."""
        if self._policy_uses_overlap:
            rules = {self._match(call.name, call.numel, call.density, call.world_size, o, call.dtype_name,
                                 call.backend).rule_index for o in overlaps}
            if len(rules) > 1:
                return False
        if model is None:
            return True
        preds = model.predict_many([call.features(o) for o in overlaps])
        return len({_ranked({a: _q(pred[a]) for a in pred})[0] for pred in preds}) == 1

    def observe_sparse(self, site_key: tuple, counts: Sequence[int], union: int) -> None:
        """Record the exact union size a completed call revealed (the same on every rank)."""
        k_sum = sum(counts)
        k_max = max(counts) if counts else 0
        site = self._sites.get(site_key) if self.online else None
        if site is not None:
            site.last_call = (k_sum, k_max, union)
        if k_sum > k_max:  # two or more ranks held entries: the union says how much they overlap
            site = self._site(site_key)
            site.overlap = (k_sum - union) / (k_sum - k_max)
            site.overlap_source = "previous call"

    def decide_topk(
        self,
        site_key: tuple,
        *,
        world_size: int,
        rank: int,
        backend: str,
        name: str | None,
        numel: int,
        k: int,
        dtype: Any,
        ranks_per_node: int | None = None,
    ) -> Choice:
        """Return the algorithm of one top-k allreduce (no collective: numel, k, P and dtype decide).

        The cost model prices ``dense`` as a full tensor on every rank,
        ``allgather`` (TopkA) and ``oktopk`` as ``k`` entries per rank whose
        union is the last TopkA result's size at this site, or ``P k`` (no
        overlap) before one is known.
        """
        if self._forced_choice is not None:
            return self._forced_choice
        p = world_size
        site = self._sites.get(site_key)
        if site is not None:
            e = site.entries.get(0)
            if e is not None and e.age < self.reevaluate_every and (
                site.overlap is None or e.overlap_holds(site.overlap, self.overlap_band)
            ):
                e.age += 1
                site.latest = e.choice.algorithm
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug("topk %s numel=%d k=%d P=%d -> %s (cached: %s)",
                                 name or "-", numel, k, p, e.choice.algorithm, e.choice.reason)
                return self._explored("topk", name, site_key, e.cached, rank)
        if p == 1:
            return _SINGLE
        site = self._seeded(site_key, backend)
        dtype_name = normalize_dtype(dtype)
        overlap = site.overlap
        decision = self._match(name, numel, k / numel, p, overlap, dtype_name, backend)
        model = None if decision.algorithm != AUTO else self.model(backend)
        if decision.algorithm != AUTO:
            choice = self._from_policy(decision, overlap, site.overlap_source)
        elif model is None:
            choice = Choice(SAFE_DEFAULT, f"no profile for backend {backend}: the safe default {SAFE_DEFAULT}",
                            "default", _knobs_for(decision, SAFE_DEFAULT))
        else:
            sparse, dense = topk_features(numel, k, p, 0.0 if overlap is None else overlap, dtype_name, ranks_per_node)
            feats = features_by_algorithm(sparse, dense)
            choice = self._from_model(model, feats, decision, site, overlap, site.overlap_source)
        _decided(site, 0, choice.algorithm)
        site.entries[0] = _Entry(choice, k, p * k, overlap)
        self._log("topk", name, site_key, choice, rank)
        return self._explored("topk", name, site_key, choice, rank)

    def observe_topk(self, site_key: tuple, algorithm: str, k: int, world_size: int, global_count: int) -> None:
        """Record what a completed top-k call revealed: TopkA's result size is the union of the local selections."""
        site = self._sites.get(site_key)
        if site is None or algorithm != "allgather" or world_size < 2 or k < 1:
            return
        site.overlap = overlap_from_union([k] * world_size, float(global_count))
        site.overlap_source = "previous call"

    # -- pieces ---------------------------------------------------------------

    def _match(
        self, name: str | None, numel: int, density: float, p: int, overlap: float | None, dtype_name: str,
        backend: str | None,
    ) -> Decision:
        decision = self.policy.match(name, numel, density, p, overlap, dtype_name, backend)
        if self.overrides.algorithm == AUTO and decision.algorithm != AUTO:
            return self.overrides.apply(decision)  # COLLTUNE_ALGO=auto: the cost model decides, knobs stay
        return decision

    def _forced(self) -> Choice:
        algo = str(self.overrides.algorithm)
        base = self.policy.match(None, None, None, None, None, None)
        return Choice(algo, f"COLLTUNE_ALGO={algo} forces it", "forced", _knobs_for(base, algo),
                      state_knobs=_state_knobs_for(base, algo))

    def _from_policy(self, decision: Decision, overlap: float | None, source: str | None) -> Choice:
        rule = None
        if decision.rule_index is not None:
            rule = f"rule {decision.rule_index}" + (f" {decision.rule_name!r}" if decision.rule_name else "")
        return Choice(decision.algorithm, decision.reason, "policy", _knobs_for(decision, decision.algorithm),
                      rule=rule, overlap=overlap, overlap_source=source,
                      state_knobs=_state_knobs_for(decision, decision.algorithm))

    def _from_model(
        self,
        model: _Model,
        feats: Mapping[str, Features],
        decision: Decision,
        site: _Site,
        overlap: float | None,
        source: str | None,
    ) -> Choice:
        raw: dict[str, float] = {}
        memo: dict[int, dict[str, float]] = {}
        for a in feats:
            f = feats[a]
            got = memo.get(id(f))
            if got is None:
                got = memo[id(f)] = model.predict(f)
            raw[a] = got[a]
        predicted = {a: _q(raw[a]) for a in raw}
        pred = self._corrected(site, predicted)
        ranked = _ranked(pred)
        best, runner = ranked[0], ranked[1]
        chosen, src = best, "model"
        inc = site.last
        if inc is not None and inc != best and inc in pred and pred[inc] <= pred[best] * (1.0 + self.margin):
            chosen, src = inc, "hysteresis"
        term = _deciding_term(model, feats, best, runner, pred)
        order = " < ".join(f"{a} {_ms(pred[a])}" for a in ranked)
        if src == "hysteresis":
            reason = (f"hysteresis: kept {chosen} ({_ms(pred[chosen])}, within {self.margin:.0%} of "
                      f"{best} {_ms(pred[best])}); cost model ({model.kind}, {model.label}): {order}")
        else:
            reason = f"cost model ({model.kind}, {model.label}): {order}"
            if term is not None:
                reason += f"; decided by {term[0]} (+{_ms(term[1])})"
        far = model.extrapolation(next(iter(feats.values())))
        if far is not None:
            reason += f"; {far}"
        rule = None
        if decision.rule_index is not None:
            rule = f"rule {decision.rule_index}" + (f" {decision.rule_name!r}" if decision.rule_name else "")
            reason += f"; {decision.reason} says auto"
        ov_note = "" if overlap is None else f"; overlap {overlap:.2f} ({source})"
        corrected = pred if pred != predicted else None
        if corrected is not None:
            reason += "; corrected by measurements: " + ", ".join(
                f"{a} x{pred[a] / predicted[a]:.2f}" for a in ranked if predicted[a] > 0 and pred[a] != predicted[a])
        if self.online:
            site.options = {a: (_knobs_for(decision, a), _state_knobs_for(decision, a)) for a in pred}
        return Choice(chosen, reason + ov_note, src,  # type: ignore[arg-type]
                      _knobs_for(decision, chosen), predicted, rule, None if term is None else term[0], overlap,
                      source, False, feats[chosen], _state_knobs_for(decision, chosen), corrected,
                      dict(site.measured) or None)

    # -- online correction (colltune.select.online) ----------------------------
    def _corrected(self, site: _Site, predicted: Mapping[str, float],
                   memo: dict[str, float] | None = None) -> dict[str, float]:
        """``predicted`` times the site's corrections (rounded, so ranks agree), or as it is when online is off.

        ``memo`` keeps the site's factors between calls that price several
        predictions against the same measurements.
        """
        if not self.online or not (site.ratios or site.pool.every):
            return dict(predicted)
        memo = {} if memo is None else memo
        missing = [a for a in predicted if a not in memo]
        if missing:
            memo.update(site.pool.factors(site.ratios, missing))
        return {a: _q(t * memo[a]) for a, t in predicted.items()}

    def _init_online(self, online: Any, state: Any, env: Mapping[str, str]) -> None:
        """Set online correction up: on or off, and its state file (loaded now, saved at exit)."""
        self.online = _online_setting(online, env)
        given = state if state is not None else env.get("COLLTUNE_ONLINE_STATE") or None
        self._state_path = None if given is None or not self.online else os.fspath(given)
        self._saved: dict[str, dict[str, Any]] = {}  # per stable site key: the tables a state file held
        self._saved_samples: dict[str, list[list[Any]]] = {}  # ... and its measured calls
        self._state_code = self._load_state() if self._state_path is not None else 0
        self._observed = 0
        if self._state_path is not None:
            atexit.register(_save_at_exit, weakref.ref(self))

    def _seeded(self, site_key: tuple, backend: str) -> _Site:
        """The site, its corrections taken from the state file on its first decision (the same on every rank)."""
        site = self._site(site_key)
        if not site.seeded:
            site.seeded = _online.stable_key((backend, *site_key))
            saved = self._saved.get(site.seeded)
            if saved and not site.ratios:
                site.ratios = {a: _online.copy_mean(m) for a, m in saved.items()}
        return site

    def _load_state(self) -> int:
        """Read the state file, if there is one; return its digest (0 for none, or one ignored)."""
        path = self._state_path
        if path is None or not os.path.exists(path):
            return 0
        version = _online.library_version()
        try:
            sites, meta = _online.load_state(path)
            if meta.get("colltune") != version:
                raise ValueError(f"written by colltune {meta.get('colltune')!r}, this is {version}")
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            logger.warning("online-correction state %s ignored (%s): decisions start from the profile", path, exc)
            return 0
        self._saved, self._saved_samples = sites, meta["samples"]
        return _signed64(int.from_bytes(hashlib.blake2b(
            _online.dump_state(sites, {}).encode(), digest_size=8).digest(), "big"))

    def save_online_state(self, path: str | os.PathLike[str] | None = None) -> None:
        """Write what online correction learned to ``path`` (default: the selector's state file), atomically.

        Each site's table, under a key that holds in the next run (the
        backend and the site without its group); sites the file held that
        this run did not see are kept. A write that fails logs a warning.
        """
        target = os.fspath(path) if path is not None else self._state_path
        if target is None:
            return
        from colltune.model.files import write_text_atomic

        tables, samples = dict(self._saved), dict(self._saved_samples)
        for sites in self._sites.groups.values():
            for site in sites.values():
                if site.seeded and site.ratios:
                    tables.pop(site.seeded, None)
                    tables[site.seeded] = site.ratios
                    samples[site.seeded] = samples.get(site.seeded, []) + site.samples
        try:
            write_text_atomic(target, _online.dump_state(tables, {"colltune": _online.library_version()}, samples))
        except OSError as exc:
            logger.warning("cannot save the online-correction state to %s (%s)", target, exc)

    def observe_time(self, site_key: tuple, algorithm: str, predicted_us: float, measured_us: float,
                     explored: bool = False) -> None:
        """Learn from one decided call's time: the maximum over ranks, the same figure on every rank.

        Called with the next exchange on the group (:class:`colltune.select.online.Feedback`). A cached
        decision the corrected model no longer picks is decided again at its site's next call.
        """
        site = self._sites.get(site_key)
        if not self.online or site is None or not measured_us > 0:
            return
        if not site.warm:  # a site's first call pays one-off set-up (the group's twin, buffers, the sketch)
            site.warm = True
            return
        site.pool.observe(site.ratios, algorithm, predicted_us, measured_us)
        got = None if site.last_call is None else _online.sample(site_key, site.last_call, algorithm, measured_us)
        if got is not None:
            site.samples = (site.samples + [got])[-_online.SAMPLES_PER_SITE:]
        self._observed += 1
        if self._state_path is not None and self._observed % _online.SAVE_EVERY == 0:
            self.save_online_state()
        site.measured[algorithm] = measured_us
        site.total_us += measured_us
        if explored:
            site.explore_us += measured_us
        factors: dict[str, float] = {}  # the same measurements price every cached decision of the site
        changed = False  # whether this measurement overturns a cached decision (one not overturned already)
        for e in site.entries.values():
            pred = e.choice.predicted_us
            if e.choice.source in ("model", "hysteresis") and pred and e.age < self.reevaluate_every:
                corr = self._corrected(site, pred, factors)
                if corr[e.choice.algorithm] > min(corr.values()) * (1.0 + self.margin):
                    e.age = self.reevaluate_every
                    changed = True
        site.measured_at[algorithm] = site.calls
        if explored:  # the runner-up confirmed slower: wait longer for the next try; else try again as often
            site.explore_gap = (_online.EXPLORE_EVERY if changed
                                else min(2 * site.explore_gap, _online.EXPLORE_BACKOFF * _online.EXPLORE_EVERY))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("measured %s %s: %s, predicted %s (x%.2f now)", _site_label(site_key), algorithm,
                         _ms(measured_us), _ms(predicted_us), site.pool.factor(site.ratios, algorithm))

    def _explored(self, kind: str, name: str | None, site_key: tuple, choice: Choice, rank: int) -> Choice:
        """:meth:`_explore` at ``site_key``, logging an exploring call."""
        site = self._sites.get(site_key) if self.online else None
        got = choice if site is None else self._explore(site, choice)
        if got is not choice:
            self._log(kind, name, site_key, got, rank)
        return got

    def _explore(self, site: _Site, choice: Choice) -> Choice:
        """Return ``choice``, or on a site's exploring call (:func:`colltune.select.online.explore_pick`) another."""
        if not self.online or choice.source not in ("model", "hysteresis") or not choice.predicted_us:
            return choice
        site.calls += 1
        if site.calls - site.explored_at < site.explore_gap:
            return choice
        corr = self._corrected(site, choice.predicted_us)
        other = _online.explore_pick(corr, choice.algorithm, lambda a: site.measured_at.get(a, -1),
                                     site.explore_us, site.total_us)
        if other is None:
            return choice
        site.explored_at = site.calls
        knobs, state_knobs = site.options.get(other, ({}, {}))
        return Choice(other, f"exploring {other} (corrected {_ms(corr[other])}, {choice.algorithm} "
                      f"{_ms(corr[choice.algorithm])}): one call in {site.explore_gap} at most",
                      "explore", knobs, choice.predicted_us, choice.rule, None, choice.overlap, choice.overlap_source,
                      False, choice.features, state_knobs, corr, dict(site.measured) or None)

    def _log(self, kind: str, name: str | None, site_key: tuple, choice: Choice, rank: int) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s %s %s -> %s (%s)", kind, name or "-", _site_label(site_key), choice.algorithm,
                         choice.reason)
        if self.overrides.log_file is None:
            return
        path = self._log_file_cache.get(rank)
        if path is None:
            path = self._log_file_cache[rank] = self.overrides.log_file_for(rank)
        record = {"time": time.time(), "rank": rank, "kind": kind, "name": name, "site": _site_label(site_key)}
        record.update(choice.as_dict())
        try:
            with open(path, "a", encoding="utf-8") as fh:  # type: ignore[arg-type]
                fh.write(json.dumps(record, allow_nan=False, default=str) + "\n")
        except (OSError, ValueError) as exc:
            logger.warning("cannot append the decision to %s (%s)", path, exc)

    # -- offline --------------------------------------------------------------

    def explain(self, features: Features, *, name: str | None = None, backend: str = "gloo") -> "Explanation":
        """Return what the selector would decide for a call with these features, and why (no process group).

        The features' overlap is taken as known (a policy rule on overlap can match).
        """
        f = features
        decision = self._match(name, f.numel * f.row_numel, f.density, f.world_size, f.overlap, f.dtype, backend)
        model = self.model(backend)
        site = _Site()
        if self._forced_choice is not None:
            choice = self._forced_choice
        elif f.world_size == 1:
            choice = _SINGLE
        elif decision.algorithm != AUTO:
            choice = self._from_policy(decision, f.overlap, "given")
        elif model is None:
            why = f"no profile for backend {backend}: the safe default {SAFE_DEFAULT}"
            choice = Choice(SAFE_DEFAULT, why, "default")
        else:
            choice = self._from_model(model, {a: f for a in candidates()}, decision, site, f.overlap, "given")
        rows = []
        if model is not None:
            pred = model.predict(f)
            terms = model.terms(f)
            for a in candidates():
                analytic = math.fsum(terms[a].values())
                top = max(terms[a], key=terms[a].get)  # type: ignore[arg-type]
                rows.append(_Row(a, pred[a], analytic, pred[a] / analytic if analytic > 0 else float("nan"),
                                 top, terms[a][top], dict(terms[a])))
        return Explanation(f, choice, tuple(rows), None if model is None else f"{model.kind} ({model.label})",
                           self.policy.source, name)


#: Policy knobs of ``oktopk`` that belong to the top-k state (:class:`colltune.algorithms.TopkState`).
def _state_knobs_for(decision: Decision, algorithm: str) -> dict[str, Any]:
    """Return the policy's knobs for ``algorithm`` that live in the top-k state (``Knob.state``)."""
    knobs = decision.knobs.get(algorithm)
    if not knobs:
        return {}
    try:
        state = {k.name for k in _algorithms.get(algorithm).knob_specs if k.state}
    except ColltuneValueError:
        return {}
    return {k: v for k, v in knobs.items() if k in state}


def _knobs_for(decision: Decision, algorithm: str) -> dict[str, Any]:
    """Return the policy's knobs for ``algorithm`` that the algorithm itself takes.

    Knobs of the top-k state (``Knob.state``: Ok-Topk's ``local_refresh``,
    ``global_refresh``) are applied by :func:`colltune.topk_allreduce` to the
    state, not passed here.
    """
    knobs = decision.knobs.get(algorithm)
    if not knobs:
        return {}
    try:
        accepted = _algorithms.get(algorithm).knobs
    except ColltuneValueError:
        return {}
    return {k: v for k, v in knobs.items() if k in accepted}


def _site_label(site_key: tuple) -> str:
    try:
        kind, name, size, row, dtype, p = site_key[:6]
        if isinstance(name, tuple):  # a fused call's bucket: (label, its tensors' positions)
            name = name[0]
        return f"[{name or '-'} n={size} row={row} {dtype} P={p}]"
    except (TypeError, ValueError):
        return str(site_key)


def _deciding_term(
    model: _Model, feats: Mapping[str, Features], best: str, runner: str, pred: Mapping[str, float]
) -> tuple[str, float] | None:
    """Return the term that adds most to the runner-up's time over the winner's, with the difference.

    Terms are the alpha-beta terms, each algorithm's scaled by its learned
    correction (predicted over alpha-beta time), so they add up to the predictions.
    """

    def scaled(alg: str) -> dict[str, float]:
        terms = model.terms(feats[alg])[alg]
        total = math.fsum(terms.values())
        factor = pred[alg] / total if total > 0 else 1.0
        return {t: v * factor for t, v in terms.items()}

    tb, tr = scaled(best), scaled(runner)
    diffs = {}
    for t in set(tb) | set(tr):
        diffs[t] = tr.get(t, 0.0) - tb.get(t, 0.0)
    if not diffs:
        return None
    t = max(sorted(diffs), key=lambda x: diffs[x])
    if diffs[t] <= 0:
        return None
    owner = runner if t in tr else best
    return f"{owner}.{t}", diffs[t]


# --------------------------------------------------------------------------- explanations


@dataclass(frozen=True)
class _Row:
    algorithm: str
    predicted_us: float
    analytic_us: float
    correction: float
    top_term: str
    top_term_us: float
    terms: dict[str, float]


@dataclass(frozen=True)
class Explanation:
    """What :meth:`Selector.explain` returns: the call, the choice, and each algorithm's prediction.

    Attributes:
        features: the call.
        choice: the decision and its reason.
        rows: per algorithm: predicted time, the (calibrated) analytic time,
            the learned correction factor, and the largest analytic term.
        model: ``kind (profile)`` of the cost model, or ``None`` without one.
        policy: the policy's source.
        name: the tensor name given.
    """

    features: Features
    choice: Choice
    rows: tuple[_Row, ...]
    model: str | None
    policy: str
    name: str | None

    def as_dict(self) -> dict[str, Any]:
        """Return the explanation as JSON-ready plain data."""
        return {
            "choice": self.choice.as_dict(),
            "model": self.model,
            "policy": self.policy,
            "name": self.name,
            "algorithms": [
                {"algorithm": r.algorithm, "predicted_us": r.predicted_us, "analytic_us": r.analytic_us,
                 "correction": r.correction, "largest_term": r.top_term, "terms_us": r.terms}
                for r in self.rows
            ],
        }


def format_explanation(e: Explanation) -> str:
    """Return the explanation as a table and the reason, for ``colltune explain``."""
    f = e.features
    lines = [
        f"call: n={f.numel} rows x {f.row_numel}, {f.dtype}, P={f.world_size}, density {f.density:.3g}, "
        f"k_max={f.k_max}, K={f.k_sum}, union {f.union:.0f}, overlap {f.overlap:.2f}"
        + (f", name {e.name!r}" if e.name else ""),
        f"cost model: {e.model or 'none (no profile)'}; policy: {e.policy}",
        "",
    ]
    if e.rows:
        head = f"{'algorithm':<10} {'predicted':>12} {'analytic':>12} {'correction':>10}  largest term"
        lines += [head, "-" * (len(head) + 24)]
        for r in e.rows:
            mark = " *" if r.algorithm == e.choice.algorithm else "  "
            lines.append(
                f"{r.algorithm:<10} {_ms(r.predicted_us):>12} {_ms(r.analytic_us):>12} {r.correction:>9.2f}x"
                f"{mark}{r.top_term} ({_ms(r.top_term_us)})"
            )
        lines.append("")
    lines.append(f"choice: {e.choice.algorithm}   (decided by: {e.choice.source}"
                 + (f", {e.choice.rule}" if e.choice.rule else "")
                 + (f", term {e.choice.term}" if e.choice.term else "") + ")")
    lines.append(f"why: {e.choice.reason}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the process-wide selector


_global: Selector | None = None
_by_policy: dict[Any, Selector] = {}
_lock = threading.Lock()


def configure(
    policy: Policy | str | os.PathLike[str] | None = None,
    profile: Profile | str | os.PathLike[str] | None = None,
    *,
    selector: Selector | None = None,
    **settings: Any,
) -> Selector:
    """Set the selector every ``auto`` call of this process uses; return it.

    Call it the same way on every rank (ranks configured differently raise
    :class:`~colltune.algorithms.errors.RankMismatchError` at their next ``auto`` call).
    With no arguments it rebuilds the default selector from the environment
    and forgets every cached decision.

    Args:
        policy: a policy or a path (see :class:`Selector`).
        profile: a profile or a path (see :class:`Selector`).
        selector: a ready :class:`Selector` (then give neither ``policy`` nor
            ``profile`` nor settings).
        **settings: :class:`Selector` keyword arguments (``reevaluate_every``, ``margin``...).

    Example:
        >>> colltune.configure(policy="my-policy.yaml", profile="my-cluster.yaml")  # doctest: +SKIP
    """
    global _global
    if selector is not None:
        if policy is not None or profile is not None or settings:
            raise ColltuneValueError(
                "configure() takes either selector= or policy=/profile=/settings, but got both; "
                "build the Selector with those arguments instead."
            )
        if not isinstance(selector, Selector):
            raise ColltuneTypeError(f"selector must be a colltune.Selector, but got {type(selector).__name__}.")
        new = selector
    else:
        new = Selector(policy, profile, **settings)
    with _lock:
        _global = new
        _by_policy.clear()
    return new


def get_selector() -> Selector:
    """Return the process-wide selector, building the default one (from the environment) on first use."""
    global _global
    sel = _global
    if sel is None:
        with _lock:
            if _global is None:
                _global = Selector()
            sel = _global
    return sel


def selector_for(policy: Any) -> Selector:
    """Return the selector a call's ``policy=`` argument stands for.

    ``None`` is the process-wide selector; a :class:`Selector` is itself; a
    :class:`~colltune.model.policy.Policy` or a path gets a selector of its own, kept
    (with its cache) for later calls with the same policy.
    """
    if policy is None:
        return _global if _global is not None else get_selector()
    if isinstance(policy, Selector):
        return policy
    if isinstance(policy, Policy):
        key: Any = ("policy", policy.digest)
    elif isinstance(policy, (str, os.PathLike)):
        key = ("path", os.path.abspath(os.fspath(policy)))
    else:
        raise ColltuneTypeError(
            "policy must be a colltune.model.policy.Policy, a path to a policy YAML file, a colltune.Selector "
            f"or None, but got {type(policy).__name__}."
        )
    sel = _by_policy.get(key)
    if sel is None:
        sel = Selector(policy)
        with _lock:
            _by_policy[key] = sel
    return sel
