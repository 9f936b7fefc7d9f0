"""Predict the time of each sparse allreduce algorithm: an analytic prior and a learned model.

Two models, both pure (no process group). Predicting, and loading a stored
model, take NumPy only; fitting a learned model imports scikit-learn and SciPy.
Both follow one contract, :class:`CostModel`: :meth:`~CostModel.predict_times`
prices one call, :meth:`~CostModel.predict_times_many` many, each as
``{algorithm: microseconds}``.

* :class:`AnalyticModel` counts the messages and bytes of each algorithm's
  schedule and prices every primitive call with the alpha-beta constants of a
  profile (``launch + steps * alpha + bytes * beta``). :meth:`AnalyticModel.terms`
  breaks a prediction into named terms, so the selector can say which one decided.
* :class:`LearnedCostModel` follows the scikit-learn estimator conventions
  (``get_params``, ``set_params``, ``clone``) and is fitted on measured
  profiles. It first recalibrates the alpha-beta constants on the measurements
  (a non-negative least-squares fit of relative error, with one constant
  overhead per algorithm), then learns, per algorithm, a regressor of the
  remaining log-time error from :data:`FEATURE_NAMES`. Fitted parameters are
  plain numbers (:meth:`LearnedCostModel.to_dict`), never pickled; trees are
  exported node by node and evaluated by a small NumPy routine, so a model
  loaded from a profile predicts exactly what the fitted one did, and loading
  costs no refit.

Each algorithm owns its schedule (``Algorithm.schedule``, in ``algorithms/``):
the steps it runs at the call's world size and mode (``Features.mode``:
``exact`` or ``topk``), each a primitive with its calls, latency-bound
steps and bytes. In short (``P`` ranks, ``n`` rows, ``K = k_sum``)::

    every algorithm   the metadata record's all_gather (its eager slot carries
                      allgather's first entries, a first-call sketch and
                      Ok-Topk's counts per region at every P)
    dense             all_reduce of n rows in the accumulation dtype (the value
                      dtype with wire=value; the union rides in the sign of
                      zero, no mask travels); local densify and extract
    allgather         the entries beyond the slot: a padded all_gather, an
                      all_to_all of exact sizes, or (rows of 32 bytes or more)
                      point-to-point messages; a local merge of K entries
    oktopk            boundaries every ``boundary_refresh`` calls (amortized),
                      P-1 rotated point-to-point messages (``peers_in_flight`` per
                      call), a local reduce of the region, then the reduced
                      union gathered (regions denser than SparCML's break-even
                      travel dense); in top-k mode about k entries (the
                      re-selected global top-k, within Eq. 3's 6k(P-1)/P words),
                      the exact threshold's radix select every
                      ``global_refresh`` calls and the balance of the kept entries

Without a :class:`Network`, primitives are priced under ring schedules:
``all_reduce`` of L bytes takes ``2(P-1)`` steps sending ``2 L (P-1)/P``
bytes, ``all_gather`` of L bytes per rank ``P-1`` steps sending ``(P-1) L``,
``all_to_all`` ``P-1`` messages, one per peer, and the rotated
point-to-point exchange ``P-1`` messages in ``ceil((P-1) / peers_in_flight)``
calls. With a :class:`Network` (an NCCL profile naming its GPUs) they follow
NCCL's own tuning model on the call's layout (:mod:`colltune.model.nccl`).
With ``P = 1`` no primitive is called. Local work is priced by the ``local``
primitive: ``alpha`` per kernel, ``beta`` per byte of memory traffic.

Example:
    >>> from colltune.model.cost_model import DEFAULT_PRIMITIVES, AnalyticModel
    >>> from colltune.model.features import Features
    >>> f = Features.build(numel=1 << 20, row_numel=1, dtype="float32",
    ...                    k_per_rank=[1000] * 8, union=7000.0)
    >>> model = AnalyticModel(DEFAULT_PRIMITIVES)
    >>> min(model.predict(f), key=model.predict(f).get)
    'allgather'
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, ClassVar, Hashable, Literal, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from colltune.algorithms import registry
from colltune.algorithms.errors import ColltuneTypeError, ColltuneValueError
from colltune.algorithms.schedule import Pricing, Step
from colltune.model import nccl
from colltune.model.features import DTYPE_BYTES, Features
from colltune.model.profile import PRIMITIVES, Measurement, Primitive, Profile, learned_columns, measurement_to_features

__all__ = [
    "ALGORITHMS",
    "DEFAULT_PRIMITIVES",
    "feature_names",
    "PARAM_NAMES",
    "Step",
    "CostModel",
    "predict_matrix",
    "AnalyticModel",
    "LearnedCostModel",
    "feature_vector",
    "default_group",
    "cross_validate",
    "model_for_profile",
    "even_layout",
]

logger = logging.getLogger(__name__)

#: The built-in algorithms: the learned model's feature layout (a stored
#: model's columns depend on it). The analytic model prices every registered
#: algorithm that has a schedule, in registry order (the first wins a tie).
ALGORITHMS: tuple[str, ...] = registry.BUILTIN_NAMES

#: Representative constants for GPUs on an InfiniBand network, used when no
#: profile is given; the same numbers as ``profiles/analytic-nccl.yaml``,
#: whose ``meta.notes`` say where each comes from.
DEFAULT_PRIMITIVES: dict[str, Primitive] = {
    "all_reduce": Primitive(alpha_us=14.0, beta_us_per_byte=2.2e-05, launch_us=8.4),
    "all_gather": Primitive(alpha_us=14.0, beta_us_per_byte=2.2e-05, launch_us=8.4),
    "all_to_all": Primitive(alpha_us=14.0, beta_us_per_byte=2.2e-05, launch_us=8.4),
    "p2p": Primitive(alpha_us=14.0, beta_us_per_byte=2.2e-05, launch_us=5.0),
    "local": Primitive(alpha_us=4.0, beta_us_per_byte=6.7e-07, launch_us=0.0),
}

_PARAM_FIELDS: tuple[str, ...] = ("launch_us", "alpha_us", "beta_us_per_byte")
#: Names of the entries of :meth:`AnalyticModel.parameter_vector`.
PARAM_NAMES: tuple[str, ...] = tuple(f"{p}.{f}" for p in PRIMITIVES for f in _PARAM_FIELDS)
_PARAM_INDEX = {name: i for i, name in enumerate(PARAM_NAMES)}

_TINY_US = 1e-3  # floor of a term before its log: 1 ns


def _as_primitive(name: str, value: Any) -> Primitive:
    if isinstance(value, Primitive):
        return value
    if isinstance(value, Mapping):
        try:
            return Primitive(
                alpha_us=float(value["alpha_us"]),
                beta_us_per_byte=float(value["beta_us_per_byte"]),
                launch_us=float(value.get("launch_us", 0.0)),
            )
        except KeyError as exc:
            raise ColltuneValueError(
                f"`primitives[{name!r}]` must have alpha_us and beta_us_per_byte, but {exc.args[0]} is missing."
            ) from None
    raise ColltuneTypeError(
        f"`primitives[{name!r}]` must be a Primitive or a mapping, but got {type(value).__name__}."
    )


def _check_algorithm(name: str) -> str:
    if name not in ALGORITHMS:
        raise ColltuneValueError(
            f"`algorithm` must be one of {list(ALGORITHMS)}, but got {name!r}; "
            "the cost model has no schedule for it."
        )
    return name


@runtime_checkable
class CostModel(Protocol):
    """What every cost model offers: each algorithm's predicted time, for one call or for many.

    :class:`AnalyticModel`, :class:`LearnedCostModel` and the selector's model
    of a profile implement it. An algorithm the model cannot price (one
    without a schedule, or never measured) is absent from its mapping; a
    caller that wants a matrix fills the gap with ``inf``.

    Example:
        >>> isinstance(AnalyticModel(DEFAULT_PRIMITIVES), CostModel)
        True
    """

    def predict_times(self, features: Features) -> dict[str, float]:
        """Return ``{algorithm: predicted microseconds}`` for one call."""
        ...

    def predict_times_many(self, feats: Sequence[Features]) -> list[dict[str, float]]:
        """Return :meth:`predict_times` of each call, in order (one pass where the model batches)."""
        ...


def predict_matrix(model: CostModel, feats: Sequence[Features], algorithms: Sequence[str]) -> np.ndarray:
    """Return ``model``'s predicted times (us) as a ``(len(feats), len(algorithms))`` matrix, ``inf`` where it has none."""
    rows = [[p.get(a, np.inf) for a in algorithms] for p in model.predict_times_many(feats)]
    return np.array(rows, dtype=np.float64).reshape(len(feats), len(algorithms))


class AnalyticModel:
    """Alpha-beta prediction of each algorithm's time, term by term.

    Args:
        primitives: constants by primitive name (:class:`Primitive` or plain
            mappings), or a :class:`Profile`. ``all_reduce``, ``all_gather``,
            ``all_to_all`` and ``p2p`` are required; ``local`` defaults to
            ``DEFAULT_PRIMITIVES["local"]``.
        metadata_bytes: bytes per rank of the metadata all_gather every
            algorithm pays; ``None`` (default) takes the real record's size,
            its int64 fields plus the eager slot for the world size.
        boundary_period: calls between Ok-Topk's boundary recomputations
            (knob ``oktopk.boundary_refresh``).
        peers_in_flight: Ok-Topk's rotated steps posted per point-to-point
            call (knob ``oktopk.peers_in_flight``).
        dense_fallback_ratio: Ok-Topk sends a region dense when its sparse
            bytes reach this multiple of its dense bytes (knob
            ``oktopk.dense_fallback_ratio``).
        network: a GPU cluster (:class:`Network`): its collectives, all-to-all
            and point-to-point steps are priced with NCCL's tuning model
            (:mod:`colltune.model.nccl`) on the call's layout instead of the
            alpha-beta constants; local work keeps ``primitives["local"]``.
            The schedules are then the device path's (CUDA tensors on NCCL:
            ``auto`` gathers collectively across nodes, see
            :func:`colltune.algorithms.schedule.p2p_gathers`); without a
            network, the host path's.

    Raises:
        ColltuneValueError: a required primitive is missing, a constant is negative.
    """

    #: The terms of each algorithm, in the order :meth:`terms` returns them
    #: (read from the algorithms' ``TERMS``).
    TERMS: ClassVar[Mapping[str, tuple[str, ...]]]

    def __init__(
        self,
        primitives: Mapping[str, Primitive | Mapping[str, float]] | Profile,
        *,
        metadata_bytes: int | None = None,
        boundary_period: int | None = None,
        peers_in_flight: int | None = None,
        dense_fallback_ratio: float | None = None,
        knobs: Mapping[str, Mapping[str, Any]] | None = None,
        network: "Network | None" = None,
    ) -> None:
        if isinstance(primitives, Profile):
            primitives = primitives.primitives
        if not isinstance(primitives, Mapping):
            raise ColltuneTypeError(
                f"`primitives` must be a mapping of primitive names or a Profile, but got {type(primitives).__name__}."
            )
        unknown = sorted(set(primitives) - set(PRIMITIVES))
        if unknown:
            raise ColltuneValueError(f"`primitives` has unknown names {unknown}; allowed: {list(PRIMITIVES)}.")
        prims: dict[str, Primitive] = {}
        for name in PRIMITIVES:
            if name in primitives:
                prims[name] = _as_primitive(name, primitives[name])
            elif name == "local":
                prims[name] = DEFAULT_PRIMITIVES["local"]
            else:
                raise ColltuneValueError(
                    f"`primitives` must describe {name}; got only {sorted(primitives)}. "
                    "Load a complete profile, e.g. profiles/analytic-nccl.yaml."
                )
            for fld in _PARAM_FIELDS:
                v = getattr(prims[name], fld)
                if not (math.isfinite(v) and v >= 0):
                    raise ColltuneValueError(f"`primitives[{name!r}].{fld}` must be a finite number >= 0, but got {v!r}.")
        if metadata_bytes is not None and int(metadata_bytes) < 0:
            raise ColltuneValueError(f"`metadata_bytes` must be >= 0, but got {metadata_bytes}.")
        own = {k: v for k, v in (("boundary_refresh", boundary_period), ("peers_in_flight", peers_in_flight),
                                 ("dense_fallback_ratio", dense_fallback_ratio)) if v is not None}
        merged = {a: dict(kn) for a, kn in (knobs or {}).items()}
        if own:
            merged["oktopk"] = {**merged.get("oktopk", {}), **own}
        self.primitives: dict[str, Primitive] = prims
        self.metadata_bytes = None if metadata_bytes is None else int(metadata_bytes)
        #: Knobs the schedules are priced with, per algorithm (the rest take their defaults).
        self.knobs: dict[str, dict[str, Any]] = merged
        for a, kn in merged.items():
            try:
                registry.get(a).check_knobs(kn)
            except ColltuneValueError as exc:
                raise ColltuneValueError(f"`knobs` for {a!r}: {exc}") from None
        self._theta = np.array(
            [getattr(prims[p], f) for p in PRIMITIVES for f in _PARAM_FIELDS], dtype=np.float64
        )
        self.network = network

    def __repr__(self) -> str:
        extra = "" if self.network is None else f", network={self.network!r}"
        return f"AnalyticModel(primitives={self.primitives!r}{extra})"

    @classmethod
    def from_profile(cls, profile: Profile, **kwargs: Any) -> "AnalyticModel":
        """Return the analytic model of a profile's primitives."""
        return cls(profile.primitives, **kwargs)

    @classmethod
    def from_parameter_vector(cls, theta: Sequence[float] | np.ndarray, **kwargs: Any) -> "AnalyticModel":
        """Return a model whose constants are ``theta``, ordered as :data:`PARAM_NAMES`."""
        theta = np.asarray(theta, dtype=np.float64).reshape(-1)
        if theta.size != len(PARAM_NAMES):
            raise ColltuneValueError(f"`theta` must have {len(PARAM_NAMES)} entries ({PARAM_NAMES}), but has {theta.size}.")
        prims = {}
        for i, p in enumerate(PRIMITIVES):
            launch, alpha, beta = (float(x) for x in theta[3 * i : 3 * i + 3])
            prims[p] = Primitive(alpha_us=alpha, beta_us_per_byte=beta, launch_us=launch)
        return cls(prims, **kwargs)

    def parameter_vector(self) -> np.ndarray:
        """Return the constants as a vector ordered as :data:`PARAM_NAMES` (a copy)."""
        return self._theta.copy()

    # -- schedules -----------------------------------------------------------

    def schedule(self, features: Features) -> dict[str, list[Step]]:
        """Return the priced steps of every registered algorithm that has a schedule, in :attr:`TERMS` order.

        Args:
            features: the call's global statistics.

        Returns:
            ``{algorithm: [Step, ...]}`` in registry order.
        """
        # None: the real record at this world size (colltune.algorithms.sizes, no torch). A network prices
        # NCCL's device path, on the call's layout or else the network's; without one, the host path.
        net = self.network
        pricing = Pricing(features, self.metadata_bytes, record_known=self.metadata_bytes is not None,
                          host=net is None, ranks_per_node=None if net is None else net.ranks_per_node)
        out: dict[str, list[Step]] = {}
        for name in registry.names():
            algo = registry.get(name)
            try:
                out[name] = algo.schedule(pricing, {**algo.knobs, **self.knobs.get(name, {})})
            except NotImplementedError:
                continue
        return out

    def _cost(self, s: Step, features: Features | None = None) -> float:
        if self.network is not None and features is not None and s.primitive != "local":
            return self.network.price(s, features)
        prim = self.primitives[s.primitive]
        return s.calls * prim.launch_us + s.steps * prim.alpha_us + s.nbytes * prim.beta_us_per_byte

    def terms(self, features: Features) -> dict[str, dict[str, float]]:
        """Return every algorithm's predicted time split into named terms, in microseconds.

        Args:
            features: the call's global statistics.

        Returns:
            ``{algorithm: {term: us}}`` with the terms of :attr:`TERMS`, and
            ``host`` where the :attr:`network` prices the host's cost; the
            terms of an algorithm sum to its :meth:`predict` value.
        """
        out = {alg: {s.term: self._cost(s, features) for s in steps} for alg, steps in self.schedule(features).items()}
        if self.network is not None and self.network.prices_host:
            mode = getattr(features, "mode", "exact") or "exact"
            for alg, terms in out.items():
                terms["host"] = self.network.host_us(alg, mode)
        return out

    def predict(self, features: Features) -> dict[str, float]:
        """Return the predicted time of every algorithm, in microseconds."""
        return {alg: math.fsum(t.values()) for alg, t in self.terms(features).items()}

    predict_times = predict

    def predict_times_many(self, feats: Sequence[Features]) -> list[dict[str, float]]:
        """Return :meth:`predict` of each call, in order."""
        return [self.predict(f) for f in feats]

    def select(self, features: Features) -> str:
        """Return the algorithm with the smallest predicted time (ties go to the earlier registered)."""
        pred = self.predict(features)
        order = list(pred)
        return min(order, key=lambda a: (pred[a], order.index(a)))

    def design(self, features: Features) -> dict[str, np.ndarray]:
        """Return, per algorithm, the coefficients of its time on :data:`PARAM_NAMES`.

        ``predict(f)[alg] == design(f)[alg] @ parameter_vector()`` (up to
        rounding) without a :attr:`network`: the time is linear in the
        constants, which is what lets :class:`LearnedCostModel` recalibrate
        them by least squares. (With a network the collectives follow NCCL's
        model, which is not linear in them.)
        """
        out = {}
        for alg, steps in self.schedule(features).items():
            row = np.zeros(len(PARAM_NAMES))
            for s in steps:
                row[_PARAM_INDEX[f"{s.primitive}.launch_us"]] += s.calls
                row[_PARAM_INDEX[f"{s.primitive}.alpha_us"]] += s.steps
                row[_PARAM_INDEX[f"{s.primitive}.beta_us_per_byte"]] += s.nbytes
            out[alg] = row
        return out


# ---------------------------------------------------------------------------
# Feature vector
# ---------------------------------------------------------------------------

#: The call's statistics the learned correction sees, in bytes and counts only: no dtype code, no row width.
#: A bfloat16 row of 32 and a float32 row of 16 put the same bytes on the wire, so a correction learned
#: on one dtype and row width carries over to another through the bytes it moves (leaving the row width
#: out lets the trees split only where the bytes do, not on which of the profile's widths a row matches).
_BASE_FEATURES: tuple[str, ...] = (
    "log_dense_bytes", "log_k_sum", "log_gather_bytes", "log_union_bytes", "log_kmax_bytes",
    "world_size", "log_world_size", "overlap", "density", "log_density",
)


class _Terms(Mapping[str, tuple[str, ...]]):
    """The registered algorithms' ``TERMS`` by name, read from the registry when asked."""

    def __getitem__(self, name: str) -> tuple[str, ...]:
        return tuple(registry.get(name).TERMS)

    def __iter__(self) -> Any:
        return iter(registry.names())

    def __len__(self) -> int:
        return len(registry.names())


AnalyticModel.TERMS = _Terms()


def feature_names() -> tuple[str, ...]:
    """Return the columns of :func:`feature_vector` (also :data:`FEATURE_NAMES`).

    Statistics of the call in bytes and counts (the dense tensor's bytes on
    the wire, in the accumulation dtype; the entries ``K``; the bytes of the
    ``K`` entries, of the union's and of the largest rank's, each entry its
    index and row), the world size, overlap and density, then the log of each
    built-in algorithm's analytic time (``t.<alg>``) and of each of its terms
    (``t.<alg>.<term>``), in microseconds, floored at 1 ns.
    """
    analytic = tuple(name for alg in ALGORITHMS
                     for name in (f"t.{alg}", *(f"t.{alg}.{t}" for t in AnalyticModel.TERMS[alg])))
    return _BASE_FEATURES + analytic


def __getattr__(name: str) -> Any:
    # FEATURE_NAMES reads the algorithms' terms, which loads them: not at import time.
    if name == "FEATURE_NAMES":
        return feature_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def feature_vector(
    features: Features, analytic: AnalyticModel, terms: Mapping[str, Mapping[str, float]] | None = None
) -> np.ndarray:
    """Return the learned model's input for one call, ordered as :data:`FEATURE_NAMES`.

    Args:
        features: the call's global statistics.
        analytic: the model whose terms become features.
        terms: ``analytic.terms(features)``, when the caller has them already.

    Returns:
        A float64 vector of ``len(feature_names())`` entries.
    """
    f = features
    e = f.entry_bytes
    base = [
        math.log(f.numel * f.row_numel * f.accum_bytes), math.log1p(f.k_sum), math.log1p(f.k_sum * e),
        math.log1p(f.union * e), math.log1p(f.k_max * e), float(f.world_size), math.log(f.world_size),
        f.overlap, f.density, math.log(max(f.density, 1e-12)),
    ]
    if terms is None:
        terms = analytic.terms(f)
    extra = []
    for alg in ALGORITHMS:
        t = terms[alg]
        extra.append(math.log(max(math.fsum(t.values()), _TINY_US)))
        extra.extend(math.log(max(t[name], _TINY_US)) for name in AnalyticModel.TERMS[alg])
    return np.array(base + extra, dtype=np.float64)


# ---------------------------------------------------------------------------
# Plain-data regressors
# ---------------------------------------------------------------------------


def _export_trees(trees: Sequence[Any], init: float, scale: float) -> dict[str, Any]:
    """Concatenate fitted sklearn trees into flat node arrays (global child indices)."""
    left, right, feature, threshold, value, roots = [], [], [], [], [], []
    offset = 0
    for est in trees:
        t = est.tree_
        cl = t.children_left.astype(np.int64)
        cr = t.children_right.astype(np.int64)
        leaf = cl < 0
        left.append(np.where(leaf, -1, cl + offset))
        right.append(np.where(leaf, -1, cr + offset))
        feature.append(np.where(leaf, 0, t.feature.astype(np.int64)))
        threshold.append(np.where(leaf, 0.0, t.threshold.astype(np.float64)))
        value.append(t.value.reshape(-1).astype(np.float64))
        roots.append(offset)
        offset += t.node_count
    return {
        "kind": "trees",
        "init": float(init),
        "scale": float(scale),
        "roots": np.asarray(roots, dtype=np.int64),
        "left": np.concatenate(left),
        "right": np.concatenate(right),
        "feature": np.concatenate(feature),
        "threshold": np.concatenate(threshold),
        "value": np.concatenate(value),
    }


def _eval_regressor(model: Mapping[str, Any], X: np.ndarray) -> np.ndarray:
    """Evaluate an exported regressor on the rows of ``X``."""
    kind = model["kind"]
    if kind == "constant":
        return np.full(X.shape[0], float(model["value"]))
    if kind == "linear":
        Z = (X - model["mean"]) / model["scale"]
        return Z @ model["coef"] + float(model["intercept"])
    # Trees compare float32 inputs with float64 thresholds, as scikit-learn does.
    X32 = X.astype(np.float32)
    left, right, feat, thr = model["left"], model["right"], model["feature"], model["threshold"]
    idx = np.broadcast_to(model["roots"], (X.shape[0], model["roots"].size)).copy()
    rows = np.arange(X.shape[0])[:, None]
    while True:
        lft = left[idx]
        is_leaf = lft < 0
        if is_leaf.all():
            break
        go_left = X32[rows, feat[idx]] <= thr[idx]
        idx = np.where(is_leaf, idx, np.where(go_left, lft, right[idx]))
    return float(model["init"]) + float(model["scale"]) * model["value"][idx].sum(axis=1)


def _encode_array(a: np.ndarray) -> str:
    """Return an array as space-separated decimal text (exact: shortest round-trip repr)."""
    if a.dtype.kind == "i":
        return " ".join(str(int(x)) for x in a)
    return " ".join(repr(float(x)) for x in a)


def _decode_array(value: Any, dtype: type) -> np.ndarray:
    """Invert :func:`_encode_array`; plain lists of numbers are accepted too."""
    if isinstance(value, str):
        items: Any = value.split()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        items = [value]
    else:
        items = list(value)
    if dtype is np.int64:
        return np.fromiter((int(x) for x in items), dtype=np.int64, count=len(items))
    return np.fromiter((float(x) for x in items), dtype=np.float64, count=len(items))


def _regressor_to_plain(model: Mapping[str, Any]) -> dict[str, Any]:
    # Arrays become one string each: a YAML loader reads one long scalar far
    # faster than thousands of small ones, and the numbers stay exact.
    return {k: _encode_array(v) if isinstance(v, np.ndarray) else v for k, v in model.items()}


def _regressor_from_plain(data: Mapping[str, Any], where: str, n_features: int) -> dict[str, Any]:
    if not isinstance(data, Mapping) or data.get("kind") not in ("trees", "linear", "constant"):
        raise ColltuneValueError(f"`{where}` must be a mapping with kind trees, linear or constant, but got {data!r:.80}.")
    out: dict[str, Any] = dict(data)
    try:
        if out["kind"] == "trees":
            for k in ("roots", "left", "right", "feature"):
                out[k] = _decode_array(data[k], np.int64)
            for k in ("threshold", "value"):
                out[k] = _decode_array(data[k], np.float64)
            sizes = {out[k].size for k in ("left", "right", "feature", "threshold", "value")}
            nodes = out["left"].size
            if len(sizes) != 1 or out["roots"].size == 0:
                raise ValueError("node arrays differ in length")
            for k in ("left", "right"):
                if np.any(out[k] >= nodes) or np.any(out[k] < -1):
                    raise ValueError(f"{k} points outside the node arrays")
            if np.any(out["roots"] < 0) or np.any(out["roots"] >= nodes):
                raise ValueError("roots point outside the node arrays")
            if np.any(out["feature"] < 0) or np.any(out["feature"] >= n_features):
                raise ValueError("feature index out of range")
            if np.any((out["left"] < 0) != (out["right"] < 0)):
                raise ValueError("a node has one child")
            out["init"], out["scale"] = float(data["init"]), float(data["scale"])
        elif out["kind"] == "linear":
            for k in ("mean", "scale", "coef"):
                out[k] = _decode_array(data[k], np.float64)
                if out[k].shape != (n_features,):
                    raise ValueError(f"{k} must have {n_features} entries")
            out["intercept"] = float(data["intercept"])
        else:
            out["value"] = float(data["value"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ColltuneValueError(f"`{where}` is not a valid exported regressor: {exc}; refit the model.") from None
    return out


# ---------------------------------------------------------------------------
# Learned model
# ---------------------------------------------------------------------------

MeasurementsLike = Sequence[Measurement] | Sequence[Mapping[str, Any]] | Profile


def _measurements_of(X: Any) -> list[Measurement]:
    if isinstance(X, Profile):
        return list(X.measurements)
    out = []
    for i, m in enumerate(X):
        if isinstance(m, Measurement):
            out.append(m)
        elif isinstance(m, Mapping):
            missing = [k for k in Measurement.__dataclass_fields__ if k not in m]
            if missing:
                raise ColltuneValueError(f"`X[{i}]` must be a measurement, but it lacks {missing}.")
            out.append(Measurement(**{k: m[k] for k in Measurement.__dataclass_fields__}))
        else:
            raise ColltuneTypeError(
                f"`X[{i}]` must be a Measurement or its mapping, but got {type(m).__name__}; "
                "pass Features together with `y` (times) and `algorithms` instead."
            )
    return out


def _training_rows(X: Any, y: Any, algorithms: Any) -> tuple[list[Features], list[str], np.ndarray]:
    if y is None and algorithms is None:
        given = _measurements_of(X)
        ms = learned_columns(given)
        if given and not ms:
            raise ColltuneValueError(
                f"`X` holds no measurement of an algorithm the learned model predicts ({', '.join(ALGORITHMS)}), "
                f"only of {sorted({m.algorithm for m in given})}, which the cost model prices by their schedules."
            )
        feats = [measurement_to_features(m) for m in ms]
        algs = [m.algorithm for m in ms]
        times = np.array([m.time_us for m in ms], dtype=np.float64)
    elif y is not None and algorithms is not None:
        feats = list(X)
        algs = [str(a) for a in algorithms]
        times = np.asarray(y, dtype=np.float64).reshape(-1)
        for i, f in enumerate(feats):
            if not isinstance(f, Features):
                raise ColltuneTypeError(f"`X[{i}]` must be Features when `y` is given, but got {type(f).__name__}.")
        if not (len(feats) == len(algs) == times.size):
            raise ColltuneValueError(
                f"`X`, `y` and `algorithms` must have the same length, but got {len(feats)}, {times.size} and {len(algs)}."
            )
    else:
        raise ColltuneValueError(
            "pass either measurements alone (`fit(measurements)`), or Features with both `y` "
            "(times in us) and `algorithms`; got only one of `y` and `algorithms`."
        )
    if not feats:
        raise ColltuneValueError("`X` must hold at least one measurement, but it is empty.")
    for a in algs:
        _check_algorithm(a)
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ColltuneValueError("`y` (times in us) must be finite and > 0.")
    return feats, algs, times


class LearnedCostModel:
    """Per-algorithm time predictor fitted on measurements (a scikit-learn style estimator).

    Fitting has two stages. (1) Calibration: the alpha-beta constants of the
    :class:`AnalyticModel` (15 of them, see :data:`PARAM_NAMES`) and one
    constant overhead per algorithm are fitted by non-negative least squares
    of the relative error over all measurements; constants the data do not
    exercise keep their prior value. (2) Correction: per algorithm, a
    regressor learns ``log(measured) - log(calibrated)`` from
    :func:`feature_vector` computed with the calibrated model. Prediction is
    ``calibrated * exp(correction)``. Everything is deterministic for a fixed
    ``random_state``.

    The model keeps scikit-learn's estimator contract (``get_params``,
    ``set_params``, ``sklearn.base.clone``) without deriving from its base
    class, so that a model loaded with :meth:`from_dict` predicts with NumPy
    alone: only :meth:`fit` imports scikit-learn and SciPy.

    Args:
        estimator: the correction regressor: ``"gbr"`` (gradient boosting),
            ``"rf"`` (random forest), ``"ridge"`` (linear), or ``"none"``
            (the calibrated analytic model alone).
        n_estimators: trees for ``gbr`` and ``rf``.
        max_depth: tree depth (``None`` lets ``rf`` trees grow fully; large files).
        learning_rate: shrinkage of ``gbr``.
        min_samples_leaf: smallest leaf of ``gbr`` and ``rf``.
        alpha: L2 penalty of ``ridge``.
        calibrate: whether to refit the alpha-beta constants (stage 1).
        primitives: prior constants (plain mapping of primitive name to
            ``{alpha_us, beta_us_per_byte, launch_us}``); ``None`` uses
            :data:`DEFAULT_PRIMITIVES`.
        random_state: seed of the tree ensembles.

    Attributes:
        algorithms_: algorithms seen in training, in :data:`ALGORITHMS` order.
        primitives_: the calibrated constants.
        overhead_us_: constant overhead per algorithm.
        residual_: exported correction regressor per algorithm (plain arrays).
        feature_names_in_: the names of :data:`FEATURE_NAMES`.
        n_features_in_: their number.
        n_samples_: measurements fitted on.

    Example:
        >>> model = LearnedCostModel(estimator="gbr").fit(profile.measurements)  # doctest: +SKIP
        >>> model.predict_times(features)                                        # doctest: +SKIP
        {'dense': 812.0, 'allgather': 95.1, 'oktopk': 130.4}
    """

    _FORMAT: ClassVar[str] = "colltune.LearnedCostModel"
    _FORMAT_VERSION: ClassVar[int] = 1

    def __init__(
        self,
        estimator: Literal["gbr", "rf", "ridge", "none"] = "gbr",
        *,
        n_estimators: int = 200,
        max_depth: int | None = 3,
        learning_rate: float = 0.05,
        min_samples_leaf: int = 2,
        alpha: float = 1.0,
        calibrate: bool = True,
        primitives: Mapping[str, Mapping[str, float]] | None = None,
        random_state: int = 0,
    ) -> None:
        self.estimator = estimator
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.min_samples_leaf = min_samples_leaf
        self.alpha = alpha
        self.calibrate = calibrate
        self.primitives = primitives
        self.random_state = random_state

    # -- parameters (the scikit-learn estimator contract) ---------------------

    @classmethod
    def _get_param_names(cls) -> list[str]:
        """Return the constructor's parameter names, sorted (as scikit-learn lists them)."""
        sig = inspect.signature(cls.__init__)
        return sorted(p.name for p in sig.parameters.values() if p.name != "self" and p.kind != p.VAR_KEYWORD)

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """Return the constructor's parameters by name (``deep`` is accepted for scikit-learn; none nest)."""
        return {name: getattr(self, name) for name in self._get_param_names()}

    def set_params(self, **params: Any) -> "LearnedCostModel":
        """Set constructor parameters by name; return ``self``.

        Raises:
            ColltuneValueError: a name that is not a parameter of the constructor.
        """
        valid = self._get_param_names()
        for name, value in params.items():
            if name not in valid:
                raise ColltuneValueError(
                    f"Invalid parameter {name!r} for LearnedCostModel; valid parameters are {valid}."
                )
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        defaults = {p.name: p.default for p in inspect.signature(type(self).__init__).parameters.values()}
        shown = [f"{k}={v!r}" for k, v in self.get_params(deep=False).items() if v != defaults.get(k)]
        return f"{type(self).__name__}({', '.join(shown)})"

    # -- fitting -------------------------------------------------------------

    def _check_params(self) -> None:
        if self.estimator not in ("gbr", "rf", "ridge", "none"):
            raise ColltuneValueError(
                f"The 'estimator' parameter of LearnedCostModel must be a str among "
                f"{{'gbr', 'rf', 'ridge', 'none'}}. Got {self.estimator!r} instead."
            )
        if isinstance(self.n_estimators, bool) or not isinstance(self.n_estimators, int) or self.n_estimators < 1:
            raise ColltuneValueError(f"`n_estimators` must be an int >= 1, but got {self.n_estimators!r}.")
        if self.max_depth is not None and (not isinstance(self.max_depth, int) or self.max_depth < 1):
            raise ColltuneValueError(f"`max_depth` must be None or an int >= 1, but got {self.max_depth!r}.")

    def _prior(self) -> AnalyticModel:
        return AnalyticModel(DEFAULT_PRIMITIVES if self.primitives is None else self.primitives)

    def fit(
        self,
        X: MeasurementsLike | Sequence[Features],
        y: Sequence[float] | np.ndarray | None = None,
        algorithms: Sequence[str] | None = None,
    ) -> "LearnedCostModel":
        """Fit the model.

        Args:
            X: measurements (:class:`Measurement`, their mappings, or a
                :class:`Profile`), or :class:`Features` when ``y`` and
                ``algorithms`` are given.
            y: measured times in microseconds, one per row of ``X`` (with Features).
            algorithms: the algorithm of each row (with Features).

        Returns:
            ``self``.

        Raises:
            ColltuneValueError: empty input, unknown algorithms, non-positive
                times, or bad hyperparameters.
        """
        self._check_params()
        feats, algs, times = _training_rows(X, y, algorithms)
        seen = [a for a in ALGORITHMS if a in set(algs)]
        A = self._design_matrix(feats, algs, seen)
        n_theta = len(PARAM_NAMES)
        if self.calibrate:
            theta, overhead = _calibrate(A, times, self._prior().parameter_vector(), n_theta)
        else:
            theta, overhead = self._prior().parameter_vector(), np.zeros(len(seen))
        analytic = AnalyticModel.from_parameter_vector(theta)
        vectors: dict[Features, np.ndarray] = {}
        for f in feats:
            if f not in vectors:
                vectors[f] = feature_vector(f, analytic)
        Xf = np.stack([vectors[f] for f in feats])
        base = A[:, :n_theta] @ theta + A[:, n_theta:] @ overhead
        resid = np.log(times) - np.log(np.maximum(base, _TINY_US))
        algs_arr = np.asarray(algs)
        residual = {a: self._fit_regressor(Xf[algs_arr == a], resid[algs_arr == a]) for a in seen}
        alg_col = {a: i for i, a in enumerate(seen)}
        self.algorithms_ = tuple(seen)
        self.primitives_ = dict(analytic.primitives)
        self.overhead_us_ = {a: float(overhead[alg_col[a]]) for a in seen}
        self.residual_ = residual
        self.feature_names_in_ = np.asarray(feature_names(), dtype=object)
        self.n_features_in_ = len(feature_names())
        self.n_samples_ = len(feats)
        self._analytic_ = analytic
        logger.debug("fitted LearnedCostModel(%s) on %d measurements of %s", self.estimator, len(feats), seen)
        return self

    def _design_matrix(self, feats: list[Features], algs: list[str], seen: list[str]) -> np.ndarray:
        """Return each row's coefficients on the prior's constants, then a one-hot overhead column per algorithm."""
        prior = self._prior()
        designs: dict[Features, dict[str, np.ndarray]] = {}
        for f in feats:
            if f not in designs:
                designs[f] = prior.design(f)
        n_theta = len(PARAM_NAMES)
        col = {a: n_theta + i for i, a in enumerate(seen)}
        A = np.zeros((len(feats), n_theta + len(seen)))
        for i, (f, a) in enumerate(zip(feats, algs)):
            A[i, :n_theta] = designs[f][a]
            A[i, col[a]] = 1.0
        return A

    def _fit_regressor(self, X: np.ndarray, r: np.ndarray) -> dict[str, Any]:
        if self.estimator == "none" or r.size < 5:
            return {"kind": "constant", "value": float(np.mean(r)) if self.estimator != "none" else 0.0}
        if self.estimator == "ridge":
            from sklearn.linear_model import Ridge

            mean = X.mean(axis=0)
            scale = X.std(axis=0)
            scale[scale == 0] = 1.0
            reg = Ridge(alpha=self.alpha).fit((X - mean) / scale, r)
            return {"kind": "linear", "mean": mean, "scale": scale, "coef": np.asarray(reg.coef_, dtype=np.float64),
                    "intercept": float(reg.intercept_)}
        if self.estimator == "gbr":
            from sklearn.ensemble import GradientBoostingRegressor

            reg = GradientBoostingRegressor(
                n_estimators=self.n_estimators, max_depth=self.max_depth, learning_rate=self.learning_rate,
                min_samples_leaf=self.min_samples_leaf, subsample=1.0, random_state=self.random_state,
            ).fit(X, r)
            return _export_trees(reg.estimators_[:, 0], float(reg.init_.constant_.reshape(-1)[0]), self.learning_rate)
        from sklearn.ensemble import RandomForestRegressor

        reg = RandomForestRegressor(
            n_estimators=self.n_estimators, max_depth=self.max_depth, min_samples_leaf=self.min_samples_leaf,
            random_state=self.random_state, n_jobs=1,
        ).fit(X, r)
        return _export_trees(reg.estimators_, 0.0, 1.0 / len(reg.estimators_))

    # -- prediction ----------------------------------------------------------

    def _check_fitted(self) -> None:
        if hasattr(self, "algorithms_") and hasattr(self, "residual_"):
            return
        msg = (f"This {type(self).__name__} instance is not fitted yet. Call 'fit' with appropriate "
               "arguments, or load a fitted model with 'from_dict', before using this estimator.")
        try:
            from sklearn.exceptions import NotFittedError
        except ImportError:  # scikit-learn is needed to fit, not to predict
            raise ColltuneValueError(msg) from None
        raise NotFittedError(msg)

    @property
    def analytic_(self) -> AnalyticModel:
        """The calibrated analytic model (fitted)."""
        self._check_fitted()
        return self._analytic_

    def predict(self, X: Sequence[Features]) -> np.ndarray:
        """Return predicted times, shape ``(len(X), len(algorithms_))``, in microseconds.

        Args:
            X: the calls' features.

        Returns:
            Column ``j`` holds the prediction for ``algorithms_[j]``.

        Raises:
            sklearn.exceptions.NotFittedError: before :meth:`fit` (``ColltuneValueError``
                where scikit-learn is not installed; both are ``ValueError``).
        """
        self._check_fitted()
        feats = list(X)
        if not feats:
            return np.zeros((0, len(self.algorithms_)))
        analytic = self._analytic_
        rows, bases = [], []
        for f in feats:
            if not isinstance(f, Features):
                raise ColltuneTypeError(f"`X` must hold Features, but got {type(f).__name__}.")
            terms = analytic.terms(f)
            rows.append(feature_vector(f, analytic, terms))
            bases.append([math.fsum(terms[a].values()) + self.overhead_us_[a] for a in self.algorithms_])
        Xf = np.stack(rows)
        base = np.maximum(np.asarray(bases, dtype=np.float64), _TINY_US)
        out = np.empty_like(base)
        for j, a in enumerate(self.algorithms_):
            out[:, j] = base[:, j] * np.exp(_eval_regressor(self.residual_[a], Xf))
        return out

    def predict_times(self, features: Features) -> dict[str, float]:
        """Return the predicted time of every fitted algorithm for one call, in microseconds."""
        return self.predict_times_many([features])[0]

    def predict_times_many(self, feats: Sequence[Features]) -> list[dict[str, float]]:
        """Return :meth:`predict_times` of each call, from one :meth:`predict` (one pass through the trees)."""
        return [{a: float(t) for a, t in zip(self.algorithms_, row)} for row in self.predict(feats)]

    def select(self, features: Features) -> str:
        """Return the algorithm predicted fastest (ties go to the earlier in :data:`ALGORITHMS`)."""
        pred = self.predict_times(features)
        return min(self.algorithms_, key=lambda a: (pred[a], ALGORITHMS.index(a)))

    # -- plain-data export ---------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Return the fitted model as plain data (for a profile's ``model`` field).

        Returns:
            A mapping of strings, numbers and lists only; :meth:`from_dict`
            rebuilds a model that predicts exactly the same values.
        """
        self._check_fitted()
        params = self.get_params(deep=False)
        if params["primitives"] is not None:
            params["primitives"] = {k: _as_primitive(k, v).to_dict() for k, v in params["primitives"].items()}
        return {
            "type": self._FORMAT,
            "format_version": self._FORMAT_VERSION,
            "params": params,
            "algorithms": list(self.algorithms_),
            "feature_names": list(feature_names()),
            "primitives": {k: p.to_dict() for k, p in self.primitives_.items()},
            "overhead_us": dict(self.overhead_us_),
            "residual": {a: _regressor_to_plain(self.residual_[a]) for a in self.algorithms_},
            "n_samples": int(self.n_samples_),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LearnedCostModel":
        """Rebuild a fitted model from :meth:`to_dict` output, without refitting.

        Args:
            data: the plain-data form.

        Returns:
            A fitted model.

        Raises:
            ColltuneValueError: the data are not a model of this version, or
                were fitted on another feature definition (refit from the measurements).
        """
        if not isinstance(data, Mapping) or data.get("type") != cls._FORMAT:
            raise ColltuneValueError(
                f"`data` must be a {cls._FORMAT} mapping from to_dict(), but its type is "
                f"{data.get('type') if isinstance(data, Mapping) else type(data).__name__!r}."
            )
        if data.get("format_version") != cls._FORMAT_VERSION:
            raise ColltuneValueError(
                f"`data.format_version` must be {cls._FORMAT_VERSION}, but got {data.get('format_version')!r}; "
                "refit the model from the profile's measurements."
            )
        if list(data.get("feature_names", [])) != list(feature_names()):
            raise ColltuneValueError(
                "`data.feature_names` differ from this colltune's feature definition; "
                "refit the model from the profile's measurements."
            )
        try:
            model = cls(**dict(data["params"]))
            algorithms = tuple(_check_algorithm(a) for a in data["algorithms"])
            analytic = AnalyticModel(data["primitives"])
            overhead = {a: float(data["overhead_us"][a]) for a in algorithms}
            residual = {
                a: _regressor_from_plain(data["residual"][a], f"data.residual.{a}", len(feature_names()))
                for a in algorithms
            }
            n_samples = int(data["n_samples"])
        except KeyError as exc:
            raise ColltuneValueError(f"`data` lacks the field {exc.args[0]!r}; it is not a complete fitted model.") from None
        except TypeError as exc:
            raise ColltuneValueError(f"`data` has a field of the wrong type: {exc}.") from None
        model._check_params()
        model.algorithms_ = algorithms
        model.primitives_ = dict(analytic.primitives)
        model.overhead_us_ = overhead
        model.residual_ = residual
        model.feature_names_in_ = np.asarray(feature_names(), dtype=object)
        model.n_features_in_ = len(feature_names())
        model.n_samples_ = n_samples
        model._analytic_ = analytic
        return model


def _calibrate(A: np.ndarray, times: np.ndarray, theta0: np.ndarray, n_theta: int) -> tuple[np.ndarray, np.ndarray]:
    """Fit non-negative constants minimizing relative error, shrunk gently toward the prior.

    Columns the data never exercise keep their prior value. Deterministic.
    """
    from scipy.optimize import lsq_linear

    W = A / times[:, None]  # relative error: (A x - t) / t
    target = np.ones(times.size)
    norms = np.sqrt((W**2).sum(axis=0))
    active = norms > 0
    prior = np.concatenate([theta0, np.zeros(A.shape[1] - n_theta)])
    x = prior.copy()
    if not np.any(active):
        return x[:n_theta], x[n_theta:]
    cols = np.flatnonzero(active)
    Ws = W[:, cols] / norms[cols]
    phi0 = prior[cols] * norms[cols]
    # Free the inactive columns' contribution (they are zero) and add a weak
    # pull toward the prior so that collinear constants stay physical.
    lam = 1e-3
    M = np.vstack([Ws, math.sqrt(lam) * np.eye(cols.size)])
    b = np.concatenate([target, math.sqrt(lam) * phi0])
    res = lsq_linear(M, b, bounds=(0.0, np.inf), method="bvls")
    x[cols] = np.maximum(res.x, 0.0) / norms[cols]
    return x[:n_theta], x[n_theta:]


# ---------------------------------------------------------------------------
# A GPU cluster under NCCL
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Network:
    """The GPU cluster an NCCL profile describes, for pricing steps with NCCL's tuning model.

    A call's layout comes from its features (``ranks_per_node``, learned from
    the process group) or else from :attr:`ranks_per_node`; a group of ``P``
    ranks spans ``ceil(P / ranks_per_node)`` nodes, as evenly as it can, and a
    group inside one node is priced as intra-node.

    A call's local cost on the host joins its priced steps as the term
    ``host``: ``host_call_us`` per call (the front door's Python, the
    selector, the record), ``host_kernel_us`` per kernel launch (with the
    Python that dispatches it), times the algorithm's
    :attr:`~colltune.algorithms.base.Algorithm.HOST_KERNELS`, and
    ``host_sync_us`` per host synchronization (the host waits for the
    device's queue to drain and refills it), times its
    :attr:`~colltune.algorithms.base.Algorithm.HOST_SYNCS`. All three come
    from the profile's ``meta`` (0 when absent).

    Attributes:
        gpu: the GPU generation (a section of ``profiles/nccl-tuning.yaml``).
        ranks_per_node: ranks per node when a call does not say (8 on DGX nodes).
        nic_gbps: inter-node bandwidth per GPU in Gbit/s, or ``None`` for the generation's.
        host_call_us: the host's fixed cost of a call, in microseconds.
        host_sync_us: the cost of one host synchronization, in microseconds.
        host_kernel_us: the host's cost of one kernel launch, in microseconds.
        p2p: point-to-point figures measured on the cluster (``meta.p2p``), replacing the NCCL model's
            defaults per level, or ``None``.
    """

    gpu: str
    ranks_per_node: int = 8
    nic_gbps: float | None = None
    host_call_us: float = 0.0
    host_sync_us: float = 0.0
    p2p: nccl.P2P | None = None
    host_kernel_us: float = 0.0

    @classmethod
    def of(cls, meta: Mapping[str, Any]) -> "Network | None":
        """Return the network an NCCL profile's ``meta`` names (``gpu``, ``ranks_per_node``, ``nic_gbps``), or ``None``."""
        if str(meta.get("backend", "")).lower() != "nccl" or not meta.get("gpu"):
            return None
        return cls(str(meta["gpu"]), int(meta.get("ranks_per_node") or 8), meta.get("nic_gbps"),
                   float(meta.get("host_call_us") or 0.0), float(meta.get("host_sync_us") or 0.0),
                   None if meta.get("p2p") is None else nccl.P2P.from_meta(meta["p2p"]),
                   float(meta.get("host_kernel_us") or 0.0))

    @property
    def prices_host(self) -> bool:
        """Whether the profile gives the host's cost of a call (any of its three figures)."""
        return bool(self.host_call_us or self.host_sync_us or self.host_kernel_us)

    def host_us(self, algorithm: str, mode: str) -> float:
        """Return the host's cost of one call of ``algorithm`` in ``mode`` (``exact`` or ``topk``), in microseconds."""
        if not self.prices_host:
            return 0.0
        alg = registry.get(algorithm)
        return (self.host_call_us + self.host_kernel_us * alg.HOST_KERNELS.get(mode, 0)
                + self.host_sync_us * alg.HOST_SYNCS.get(mode, 0))

    def topology(self, features: Features) -> nccl.Topology:
        """Return the :class:`colltune.model.nccl.Topology` of a call with these features."""
        return _layout(self, features.world_size, features.ranks_per_node or self.ranks_per_node)

    def price(self, s: Step, features: Features) -> float:
        """Return the time of step ``s`` (not ``local``) in microseconds, with NCCL's model on the call's layout."""
        p = features.world_size
        if s.calls <= 0 or p == 1:
            return 0.0
        topo = self.topology(features)
        if s.primitive == "all_reduce":  # Pricing: nbytes = calls * 2 (P-1)/P * L
            size = s.nbytes / (s.calls * 2 * (p - 1) / p)
            return s.calls * nccl.collective_time_us("all_reduce", round(size), topo)
        if s.primitive == "all_gather":  # nbytes = calls * (P-1) * L; NCCL counts the whole output, P L
            size = s.nbytes / (s.calls * (p - 1)) * p
            return s.calls * nccl.collective_time_us("all_gather", round(size), topo)
        if s.primitive == "all_to_all":  # nbytes = calls * (P-1) * per peer
            return s.calls * nccl.all_to_all_time_us(round(s.nbytes / (s.calls * (p - 1))), topo)
        return self._rotated(s, topo)

    @staticmethod
    def _rotated(s: Step, topo: Any) -> float:
        """Price ``steps`` point-to-point messages of ``nbytes / steps`` each, ``steps / calls`` in flight per call.

        The peers are spread as the group is: a share ``(G-1)/(P-1)`` on the
        rank's own node, over NVLink, the rest over the node's NICs. Both go
        at the same time, each in rounds of its share of the messages in
        flight; the step takes as long as the slower of the two.
        """
        msgs = max(s.steps, 1.0)
        size, per_call = round(s.nbytes / msgs), max(1.0, msgs / s.calls)
        p, g = topo.world_size, topo.gpus_per_node
        times = [0.0]
        for share, inter in (((g - 1) / (p - 1), False), ((p - g) / (p - 1), True)):
            m = msgs * share
            if m <= 0:
                continue
            at_once = max(1, min(round(per_call * share), math.ceil(m)))
            times.append(math.ceil(m / at_once) * nccl.p2p_time_us(size, topo, at_once, inter_node=inter))
        return max(times)


def even_layout(world_size: int, ranks_per_node: int) -> tuple[int, int]:
    """Return the nodes and ranks per node an NCCL profile prices ``world_size`` ranks on.

    The ranks go on ``ceil(P / ranks_per_node)`` nodes with
    ``ceil(P / nodes)`` on each: NCCL's tuning model assumes every node holds
    as many ranks, so when ``nodes`` does not divide ``P`` the layout priced
    holds more ranks than ``P`` (1020 ranks at 8 per node are priced as
    128 x 8). Callers that show a layout compare ``nodes * per_node`` to ``P``.
    """
    nodes = -(-world_size // min(ranks_per_node, world_size))
    return nodes, -(-world_size // nodes)


@lru_cache(maxsize=1024)
def _layout(network: Network, p: int, rpn: int) -> nccl.Topology:
    """The topology :func:`even_layout` gives (cached: every step asks)."""
    nodes, per_node = even_layout(p, rpn)
    return nccl.Topology(nodes=nodes, gpus_per_node=per_node, gpu=network.gpu, nic_gbps=network.nic_gbps,
                         p2p=network.p2p)


# ---------------------------------------------------------------------------
# Where a learned model was measured
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Domain:
    """The calls a learned model was measured on: ranges of world size, rows and row bytes, and the dtypes.

    A learned model is trusted inside its domain and fades out beyond it:
    :meth:`weight` is 1 inside, falls linearly with the distance outside
    (in factors of 2 along the farthest dimension) and reaches 0 at
    :data:`FADE_DOUBLINGS`, where the analytic model alone decides. So a
    profile measured at P = 2 to 8 blends at P = 16 and is not trusted at all
    from P = 32 on.

    The row width counts in bytes (``row_numel * value_bytes``), as the
    learned model sees it (:func:`feature_vector`): a row between the
    narrowest and the widest measured lies inside, whatever its dtype and
    element count; a narrower or wider one lies outside. A dtype whose value
    size was never measured lies outside too, by its factor from the nearest
    measured size: its bytes transfer, but its arithmetic (16-bit values
    accumulate in float32; float64 adds cost more) was never timed. The
    value size stands for the arithmetic: bfloat16 and float16 both travel
    in 2 B and accumulate in float32, so measuring either puts both inside
    (the shipped gloo profile measured both, and float64, at rows of 64).

    Attributes:
        world_size, numel: inclusive ``(min, max)`` measured.
        row_bytes: inclusive ``(min, max)`` of the bytes of one row of values measured.
        value_bytes: the value sizes measured (bytes per element of each dtype).
    """

    world_size: tuple[int, int]
    numel: tuple[int, int]
    row_bytes: tuple[int, int]
    value_bytes: tuple[int, ...]

    @classmethod
    def of(cls, measurements: Sequence[Measurement]) -> "Domain | None":
        """Return the domain of ``measurements``, or ``None`` for none."""
        if not measurements:
            return None
        ps = [m.world_size for m in measurements]
        ns = [m.numel for m in measurements]
        rb = [m.row_numel * DTYPE_BYTES[m.dtype] for m in measurements]
        sizes = sorted({DTYPE_BYTES[m.dtype] for m in measurements})
        return cls((min(ps), max(ps)), (min(ns), max(ns)), (min(rb), max(rb)), tuple(sizes))

    def distances(self, f: Features) -> dict[str, float]:
        """Return, per dimension outside the domain, how far outside ``f`` lies (in factors of 2)."""
        out: dict[str, float] = {}
        for what, value, (lo, hi) in (("world size", f.world_size, self.world_size), ("rows", f.numel, self.numel),
                                      ("row width", f.row_bytes, self.row_bytes)):
            if value < lo or value > hi:
                out[what] = abs(math.log2(max(value, 1) / (lo if value < lo else hi)))
        if f.value_bytes not in self.value_bytes:
            out["dtype"] = min(abs(math.log2(f.value_bytes / b)) for b in self.value_bytes)
        return out

    def weight(self, f: Features) -> float:
        """Return how much the learned model counts for ``f``: 1 inside the domain, down to 0 far outside."""
        d = self.distances(f)
        return 1.0 if not d else max(0.0, 1.0 - max(d.values()) / FADE_DOUBLINGS)

    def describe(self, f: Features) -> str | None:
        """Return why ``f`` is outside the domain and what that does, or ``None`` inside it."""
        d = self.distances(f)
        if not d:
            return None
        measured = {"world size": f"P {self.world_size[0]}..{self.world_size[1]}",
                    "rows": f"n {self.numel[0]}..{self.numel[1]}",
                    "row width": f"rows of {self.row_bytes[0]}..{self.row_bytes[1]} B",
                    "dtype": "values of " + "/".join(f"{b} B" for b in self.value_bytes)}
        w = self.weight(f)
        what = "the analytic model alone" if w == 0 else f"{w:.0%} learned, {1 - w:.0%} analytic"
        return ("extrapolating (" + ", ".join(f"{k} outside the measured {measured[k]}" for k in d)
                + f"): {what}")


#: Doublings outside a learned model's domain at which it no longer counts (:class:`Domain`).
FADE_DOUBLINGS = 2.0


# ---------------------------------------------------------------------------
# Cross-validation
# ---------------------------------------------------------------------------


def default_group(m: Measurement) -> tuple[Hashable, ...]:
    """Return the configuration a measurement belongs to: ``(numel, density, overlap, world_size)``.

    Density and overlap are rounded (4 significant digits, 3 decimals) so that
    repeated runs of one configuration share a group.
    """
    return (m.numel, f"{m.density:.4g}", round(m.overlap, 3), m.world_size)


def _config_key(m: Measurement) -> tuple[Hashable, ...]:
    return (m.numel, m.row_numel, m.dtype, m.world_size, m.k_max, m.k_sum, m.union)


#: The fewest measurements (of at least two algorithms) a profile without a stored model is fitted on.
MIN_MEASUREMENTS_TO_FIT = 10


def model_for_profile(profile: Profile) -> tuple[AnalyticModel | LearnedCostModel, str]:
    """Return the cost model a profile describes, and where it came from.

    A stored learned model (``model:``) is rebuilt without refitting
    (``stored``); a profile with at least :data:`MIN_MEASUREMENTS_TO_FIT`
    measurements of two or more algorithms and no usable stored model is
    fitted once, deterministically, with its primitives as the prior
    (``fitted``); otherwise the alpha-beta model of its primitives
    (``analytic``). An unusable stored model is logged and refitted.
    """
    if profile.model is not None:
        try:
            return LearnedCostModel.from_dict(profile.model), "stored"
        except ColltuneValueError as exc:
            logger.warning("a profile's stored model cannot be used (%s); refitting from the measurements", exc)
    fits = learned_columns(profile.measurements)
    if len(fits) >= MIN_MEASUREMENTS_TO_FIT and len({m.algorithm for m in fits}) >= 2:
        try:
            import sklearn  # noqa: F401 - fitting needs it; evaluating a stored model does not
        except ImportError:
            logger.warning("a profile without a stored model needs scikit-learn to fit one, and it is not installed "
                           "(pip install 'colltune[cli]'); using its analytic model. Store the model once with "
                           "colltune fit PROFILE so that training jobs need no fitting")
            return AnalyticModel(profile.primitives, network=Network.of(profile.meta)), "analytic"
        prior = {k: p.to_dict() for k, p in profile.primitives.items()}
        return LearnedCostModel(primitives=prior).fit(profile.measurements), "fitted"
    return AnalyticModel(profile.primitives, network=Network.of(profile.meta)), "analytic"


def cross_validate(
    measurements: MeasurementsLike,
    groups: Sequence[Hashable] | Callable[[Measurement], Hashable] | None = None,
    *,
    model: LearnedCostModel | None = None,
    n_splits: int | None = None,
) -> dict[str, Any]:
    """Estimate prediction error and selection regret on held-out configurations.

    Every fold fits a fresh clone of ``model`` on the other groups and predicts
    the held-out group's measurements. Selection regret compares, for each
    held-out configuration measured with two or more algorithms, the measured
    time of the algorithm the model picks with the fastest measured one.

    Args:
        measurements: the measurements (or a :class:`Profile`).
        groups: a group label per measurement, or a function of a measurement;
            default :func:`default_group`.
        model: the estimator to validate; default ``LearnedCostModel()``.
        n_splits: ``None`` for leave-one-group-out; an int for ``GroupKFold``
            with that many folds (faster on many groups).

    Returns:
        A plain mapping::

            {"n_measurements": int, "n_groups": int, "n_folds": int,
             "per_algorithm": {alg: {"n", "median_rel_error", "p90_rel_error"}},
             "regret": {"n_configs", "geomean", "p95", "max", "optimal_fraction"}}

        Relative error is ``|predicted - measured| / measured``; regret is
        ``time(chosen) / time(best)`` (1 is perfect).

    Raises:
        ColltuneValueError: fewer than two groups, or mismatched ``groups``.
    """
    from sklearn.base import clone
    from sklearn.model_selection import GroupKFold, LeaveOneGroupOut

    ms = _measurements_of(measurements)
    group_ids, n_groups = _group_ids(ms, groups)
    splitter = LeaveOneGroupOut() if n_splits is None else GroupKFold(n_splits=min(int(n_splits), n_groups))
    base_model = model if model is not None else LearnedCostModel()
    rel_err: dict[str, list[float]] = {}
    regrets: list[float] = []
    n_folds = 0
    for train, test in splitter.split(np.zeros((len(ms), 1)), groups=group_ids):
        n_folds += 1
        fitted = clone(base_model).fit([ms[i] for i in train])
        _score_fold(fitted, [ms[i] for i in test], rel_err, regrets)
    per_alg = {
        a: {"n": len(v), "median_rel_error": float(np.median(v)), "p90_rel_error": float(np.percentile(v, 90))}
        for a, v in ((a, rel_err[a]) for a in ALGORITHMS if a in rel_err)
    }
    return {
        "n_measurements": len(ms),
        "n_groups": n_groups,
        "n_folds": n_folds,
        "per_algorithm": per_alg,
        "regret": _regret_summary(np.asarray(regrets, dtype=np.float64)),
    }


def _group_ids(
    ms: list[Measurement], groups: Sequence[Hashable] | Callable[[Measurement], Hashable] | None
) -> tuple[np.ndarray, int]:
    """Return a group number per measurement and the number of groups (at least two)."""
    labels: list[Hashable]
    if groups is None:
        labels = [default_group(m) for m in ms]
    elif callable(groups):
        labels = [groups(m) for m in ms]
    else:
        labels = list(groups)
        if len(labels) != len(ms):
            raise ColltuneValueError(f"`groups` must have one label per measurement ({len(ms)}), but has {len(labels)}.")
    distinct = sorted(set(labels), key=repr)
    if len(distinct) < 2:
        raise ColltuneValueError(f"cross-validation needs at least 2 groups, but got {len(distinct)}.")
    code = {g: i for i, g in enumerate(distinct)}
    return np.array([code[g] for g in labels]), len(distinct)


def _score_fold(
    fitted: LearnedCostModel, held_out: list[Measurement], rel_err: dict[str, list[float]], regrets: list[float]
) -> None:
    """Add the held-out measurements' relative errors and their configurations' selection regrets."""
    configs: dict[tuple[Hashable, ...], list[Measurement]] = {}
    for m in held_out:
        configs.setdefault(_config_key(m), []).append(m)
    for rows in configs.values():
        pred = fitted.predict_times(measurement_to_features(rows[0]))
        measured: dict[str, float] = {}
        for m in rows:
            if m.algorithm in pred:
                rel_err.setdefault(m.algorithm, []).append(abs(pred[m.algorithm] - m.time_us) / m.time_us)
            measured[m.algorithm] = min(measured.get(m.algorithm, math.inf), m.time_us)
        candidates = [a for a in ALGORITHMS if a in measured and a in pred]
        if len(candidates) >= 2:
            chosen = min(candidates, key=lambda a: (pred[a], ALGORITHMS.index(a)))
            regrets.append(measured[chosen] / min(measured[a] for a in candidates))


def _regret_summary(r: np.ndarray) -> dict[str, Any]:
    """Return the geometric mean, 95th percentile, maximum and optimal fraction of the regrets ``r``."""
    nan = float("nan")
    return {
        "n_configs": int(r.size),
        "geomean": float(np.exp(np.mean(np.log(r)))) if r.size else nan,
        "p95": float(np.percentile(r, 95)) if r.size else nan,
        "max": float(r.max()) if r.size else nan,
        "optimal_fraction": float(np.mean(r <= 1.0)) if r.size else nan,
    }
