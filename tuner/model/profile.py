"""The profile file: measurements and fitted cost-model parameters, as plain YAML.

A profile is written by the offline profiler (``colltune profile``/``fit``) and
read by the selector. It is data, never code: it is read with a YAML *safe*
loader only, and a fitted model is stored as plain numbers, never pickled.

Format (version 1)::

    format: colltune-profile        # required, exactly this
    version: 1                      # required; other versions are refused
    checksum: 'c0ffee0123456789'    # optional; written by save_profile()
    kind: measured                  # measured | analytic
    meta:                           # free-form description; these keys are typed
      backend: nccl                 # required (str)
      world_sizes: [2, 4, 8]        # list of int
      nodes: 1                      # int
      ranks_per_node: 8             # int: the layout assumed when a call's own is unknown
      gpu: h100                     # str: a GPU generation of profiles/nccl-tuning.yaml; with it
                                    # an NCCL profile prices collectives with NCCL's tuning model
      nic_gbps: 400                 # number: inter-node bandwidth per GPU, Gbit/s (default: the
                                    # generation's)
      p2p:                          # measured point-to-point figures replacing the NCCL model's
        intra_node: {latency_us: 11.8, bandwidth_GBps: 360}   # defaults (every key optional):
        inter_node: {latency_us: 22.4, bandwidth_GBps: 48}    # one message, a rank's GB/s
      torch_version: 2.13.0         # str
      host: node001                 # str
      date: '2025-01-31'            # str (a bare YAML date is accepted)
      notes: free text              # str
      statistic: median             # median | lower-quartile: what time_us holds (below)
    primitives:                     # alpha-beta cost of each primitive
      all_reduce: {alpha_us: 3.4, beta_us_per_byte: 2.8e-06, launch_us: 8.4}
      all_gather: {...}
      all_to_all: {...}
      p2p: {...}                    # these four are required
      local: {...}                  # optional: on-device memory traffic (densify, merge)
    model: {...}                    # optional: fitted parameters, plain data
    measurements:                   # optional (empty for analytic profiles)
    - {algorithm: dense, numel: 1048576, row_numel: 1, dtype: float32,
       world_size: 8, k_max: 10486, k_sum: 83886, union: 80012.0,
       overlap: 0.05, density: 0.01, time_us: 812.5, spread_us: 11.0,
       repeats: 20, bytes_sent: 7340032}

``launch_us`` (optional, default 0) is a fixed cost per call of the primitive
(NCCL's "base latency"); ``alpha_us`` is paid per message step and
``beta_us_per_byte`` per byte a rank sends.

A measurement's time comes from ``repeats`` timed rounds; in each round every
algorithm runs once and the round's sample is one call's wall time, the max
over ranks. ``time_us`` (microseconds per call) is one statistic of those
samples, named by ``meta.statistic``:

- ``median`` (the default of ``colltune profile``): the median of the rounds;
- ``lower-quartile`` (``colltune profile --statistic lower-quartile``): their
  25th percentile, robust on a machine shared with other jobs, whose load
  only ever adds time.

Without ``meta.statistic`` (active profiling, ``colltune profile
--active``, writes none) the times are medians. ``meta.statistic`` names the
statistic of the run that wrote the file; measurements a ``--resume`` carried
over from an existing output profile keep the value they had, and with
``lower-quartile`` a configuration whose round times the journal lacks keeps
its median. The loader does not check ``meta.statistic``.

``spread_us`` is the interquartile range of the rounds (the 75th minus the
25th percentile), whichever statistic ``time_us`` holds, and ``bytes_sent``
what this rank put on the wire in one call. ``union`` is the exact union
size; ``overlap`` and ``density`` must agree with
``(k_sum - union) / (k_sum - k_max)`` and ``k_sum / (world_size * numel)``.

``checksum`` is the hexadecimal :attr:`Profile.digest` of everything else; a
file whose content no longer matches it (truncated in a copy, or edited after
it was saved) is refused. Delete the ``checksum`` line after editing a file
by hand on purpose.

Example:
    >>> prof = load_profile("profiles/analytic-nccl.yaml")  # doctest: +SKIP
    >>> prof.kind, sorted(prof.primitives)                 # doctest: +SKIP
    ('analytic', ['all_gather', 'all_reduce', 'all_to_all', 'local', 'p2p'])
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Literal, Mapping, Sequence

import numpy as np
import yaml

from colltune.algorithms.errors import ColltuneError, ColltuneValueError
from colltune.algorithms.registry import BUILTIN_NAMES
from colltune.model import yamlsafe
from colltune.model.features import DTYPE_BYTES, Features, index_bytes_for
from colltune.model.nccl import P2P

__all__ = [
    "FORMAT",
    "VERSION",
    "KINDS",
    "REQUIRED_PRIMITIVES",
    "PRIMITIVES",
    "MEASUREMENT_FIELDS",
    "ProfileError",
    "Primitive",
    "Measurement",
    "Profile",
    "load_profile",
    "save_profile",
    "measurement_to_features",
    "profile_from_measurements",
    "learned_columns",
]

FORMAT = "colltune-profile"
VERSION = 1
KINDS: tuple[str, ...] = ("measured", "analytic")
REQUIRED_PRIMITIVES: tuple[str, ...] = ("all_reduce", "all_gather", "all_to_all", "p2p")
#: Every primitive a profile may describe, in file order.
PRIMITIVES: tuple[str, ...] = REQUIRED_PRIMITIVES + ("local",)
MEASUREMENT_FIELDS: tuple[str, ...] = (
    "algorithm", "numel", "row_numel", "dtype", "world_size", "k_max", "k_sum", "union",
    "overlap", "density", "time_us", "spread_us", "repeats", "bytes_sent",
)
_META_TYPES: dict[str, tuple[type, ...]] = {
    "backend": (str,), "world_sizes": (list,), "nodes": (int,), "ranks_per_node": (int,),
    "torch_version": (str,), "host": (str,), "date": (str,), "notes": (str,),
    "gpu": (str,), "nic_gbps": (int, float), "host_call_us": (int, float), "host_sync_us": (int, float),
    "host_kernel_us": (int, float), "host_source": (str,),
}
_TOP_KEYS = ("format", "version", "checksum", "kind", "meta", "primitives", "model", "measurements")

_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class ProfileError(ColltuneValueError):
    """A profile file or object is unreadable, corrupt, of another version, or missing a field.

    The message names the file (or ``<profile>`` for an object) and the field.
    """


# ---------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Primitive:
    """Alpha-beta cost of one collective primitive: ``launch + steps * alpha + bytes * beta``.

    Attributes:
        alpha_us: latency per message step, in microseconds.
        beta_us_per_byte: time per byte a rank sends (1 / bandwidth), in microseconds.
        launch_us: fixed cost per call, in microseconds.
    """

    alpha_us: float
    beta_us_per_byte: float
    launch_us: float = 0.0

    def to_dict(self) -> dict[str, float]:
        """Return the plain-data form written to a profile."""
        return {"alpha_us": self.alpha_us, "beta_us_per_byte": self.beta_us_per_byte, "launch_us": self.launch_us}


@dataclass(frozen=True)
class Measurement:
    """One timed configuration of one algorithm (a row of ``measurements``).

    Attributes mirror the file fields; see the module docstring. ``time_us``
    is the statistic of the timed rounds that the profile's
    ``meta.statistic`` names (the median when it is absent).
    """

    algorithm: str
    numel: int
    row_numel: int
    dtype: str
    world_size: int
    k_max: int
    k_sum: int
    union: float
    overlap: float
    density: float
    time_us: float
    spread_us: float
    repeats: int
    bytes_sent: int

    @classmethod
    def from_features(
        cls,
        features: Features,
        algorithm: str,
        *,
        time_us: float,
        spread_us: float = 0.0,
        repeats: int = 1,
        bytes_sent: int = 0,
    ) -> "Measurement":
        """Build a measurement of ``algorithm`` on the configuration ``features``.

        Args:
            features: the configuration (with the exact union).
            algorithm: the algorithm name.
            time_us: time per call, microseconds: the statistic of the timed
                rounds that the profile's ``meta.statistic`` names (the
                median, or the lower quartile; see the module docstring).
            spread_us: interquartile range of the timed rounds, microseconds.
            repeats: number of timed rounds.
            bytes_sent: bytes this rank sent per call.

        Returns:
            The measurement; ``overlap`` and ``density`` come from ``features``.
        """
        return cls(
            algorithm=algorithm, numel=features.numel, row_numel=features.row_numel, dtype=features.dtype,
            world_size=features.world_size, k_max=features.k_max, k_sum=features.k_sum,
            union=float(features.union), overlap=float(features.overlap), density=float(features.density),
            time_us=float(time_us), spread_us=float(spread_us), repeats=int(repeats), bytes_sent=int(bytes_sent),
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the plain-data form written to a profile, in file field order."""
        return {name: getattr(self, name) for name in MEASUREMENT_FIELDS}

    def features(self) -> Features:
        """Return the :class:`Features` of this configuration (see :func:`measurement_to_features`)."""
        return measurement_to_features(self)


def measurement_to_features(m: Measurement | Mapping[str, Any]) -> Features:
    """Return the :class:`Features` of a measured configuration.

    Args:
        m: a :class:`Measurement` or its plain-data form.

    Returns:
        Features with ``value_bytes`` from the dtype and ``index_bytes`` from ``numel``.

    Raises:
        ColltuneValueError: inconsistent counts or an unknown dtype.
    """
    get: Callable[[str], Any] = m.__getitem__ if isinstance(m, Mapping) else (lambda k: getattr(m, k))
    try:
        dtype = str(get("dtype"))
        numel = int(get("numel"))
        return Features(
            numel=numel,
            row_numel=int(get("row_numel")),
            value_bytes=DTYPE_BYTES.get(dtype, 0),
            index_bytes=index_bytes_for(numel),
            world_size=int(get("world_size")),
            k_max=int(get("k_max")),
            k_sum=int(get("k_sum")),
            union=float(get("union")),
            overlap=float(get("overlap")),
            dtype=dtype,
        )
    except (KeyError, AttributeError) as exc:
        raise ColltuneValueError(f"`m` must be a measurement, but it lacks the field {exc.args[0]!r}.") from None


@dataclass
class Profile:
    """A profile in memory: what the file holds, validated.

    Attributes:
        kind: ``"measured"`` (from the profiler) or ``"analytic"`` (hand-set constants).
        meta: description; ``backend`` is required, see the module docstring.
        primitives: alpha-beta constants by primitive name.
        measurements: timed configurations (may be empty).
        model: fitted cost-model parameters as plain data, or ``None``.
        version: format version; always :data:`VERSION` in memory.
    """

    kind: Literal["measured", "analytic"]
    meta: dict[str, Any]
    primitives: dict[str, Primitive]
    measurements: list[Measurement] = field(default_factory=list)
    model: dict[str, Any] | None = None
    version: int = VERSION

    def to_dict(self) -> dict[str, Any]:
        """Return the plain-data form of the file, without ``checksum``."""
        out: dict[str, Any] = {
            "format": FORMAT,
            "version": self.version,
            "kind": self.kind,
            "meta": dict(self.meta),
            "primitives": {name: p.to_dict() for name, p in self.primitives.items()},
        }
        if self.model is not None:
            out["model"] = self.model
        out["measurements"] = [m.to_dict() for m in self.measurements]
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "<profile>") -> "Profile":
        """Validate plain data (as loaded from YAML) and return a :class:`Profile`.

        Args:
            data: the parsed document.
            source: what to call it in error messages (the file path).

        Returns:
            The profile.

        Raises:
            ProfileError: naming ``source`` and the offending field.
        """
        return _parse(data, source)

    @property
    def digest(self) -> int:
        """Return a stable 64-bit digest of the content (non-negative, fits in ``int64``).

        Equal profiles have equal digests on every machine and Python version:
        it is SHA-256 of canonical JSON (sorted keys, shortest float repr).
        Ranks can all-gather it to check that they loaded the same profile.
        Computed on each access: a hash over every measurement.
        """
        return _digest(self.to_dict())


def _digest(doc: Mapping[str, Any]) -> int:
    payload = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)
    head = hashlib.sha256(payload.encode("utf-8")).digest()[:8]
    return int.from_bytes(head, "big") & (2**63 - 1)


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _err(source: str, where: str, message: str) -> ProfileError:
    return ProfileError(f"{source}: field `{where}`: {message}")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _get(mapping: Mapping[str, Any], key: str, source: str, where: str, required: bool = True) -> Any:
    if key not in mapping:
        if required:
            raise _err(source, where, "is missing; it is required (see the profile format in colltune.model.profile).")
        return None
    return mapping[key]


def _number(value: Any, source: str, where: str, *, low: float = 0.0, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _err(source, where, f"expected a number, got {_type_name(value)} {value!r}.")
    v = float(value)
    if not math.isfinite(v) or v < low or (positive and v <= 0.0):
        bound = "> 0" if positive else f">= {low}"
        raise _err(source, where, f"expected a finite number {bound}, got {value!r}.")
    return v


def _integer(value: Any, source: str, where: str, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _err(source, where, f"expected an integer, got {_type_name(value)} {value!r}.")
    if value < low:
        raise _err(source, where, f"expected an integer >= {low}, got {value}.")
    return int(value)


def _plain(value: Any, source: str, where: str) -> Any:
    """Return ``value`` as JSON-ready plain data (dates become ISO strings)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _err(source, where, f"expected a finite number, got {value!r}.")
        return value
    if isinstance(value, (_dt.date, _dt.datetime)):
        return value.isoformat()
    if isinstance(value, (list, tuple)):  # before Mapping, whose isinstance is slow on a list
        return [_plain(v, source, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise _err(source, f"{where}.{k}", f"keys must be strings, got {_type_name(k)} {k!r}.")
            out[k] = _plain(v, source, f"{where}.{k}")
        return out
    raise _err(source, where, f"expected plain data (mapping, list, string, number, bool, null), got {_type_name(value)}.")


def _parse_meta(value: Any, source: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _err(source, "meta", f"expected a mapping, got {_type_name(value)}.")
    meta = _plain(value, source, "meta")
    backend = _get(meta, "backend", source, "meta.backend")
    if not isinstance(backend, str) or not backend:
        raise _err(source, "meta.backend", f"expected the backend name (gloo, nccl, ...), got {backend!r}.")
    for key, types in _META_TYPES.items():
        if key in meta and meta[key] is not None and not isinstance(meta[key], types):
            raise _err(source, f"meta.{key}", f"expected {types[0].__name__}, got {_type_name(meta[key])} {meta[key]!r}.")
        if key in ("nodes", "ranks_per_node") and isinstance(meta.get(key), bool):
            raise _err(source, f"meta.{key}", f"expected int, got bool {meta[key]!r}.")
    for i, w in enumerate(meta.get("world_sizes") or []):
        _integer(w, source, f"meta.world_sizes[{i}]", low=1)
    for key in ("host_call_us", "host_sync_us", "host_kernel_us"):
        if isinstance(meta.get(key), bool) or (meta.get(key) is not None and not 0 <= meta[key] < float("inf")):
            raise _err(source, f"meta.{key}", f"expected a number of microseconds >= 0, got {meta[key]!r}.")
    if meta.get("p2p") is not None:  # the NCCL model reads these figures; it checks them
        try:
            P2P.from_meta(meta["p2p"])
        except ColltuneValueError as exc:
            raise _err(source, "meta.p2p", str(exc)) from None
    return meta


def _parse_primitives(value: Any, source: str) -> dict[str, Primitive]:
    if not isinstance(value, Mapping):
        raise _err(source, "primitives", f"expected a mapping of primitive names, got {_type_name(value)}.")
    for name in value:
        if name not in PRIMITIVES:
            raise _err(source, f"primitives.{name}", f"unknown primitive; allowed: {', '.join(PRIMITIVES)}.")
    out: dict[str, Primitive] = {}
    for name in PRIMITIVES:
        where = f"primitives.{name}"
        entry = _get(value, name, source, where, required=name in REQUIRED_PRIMITIVES)
        if entry is None and name not in REQUIRED_PRIMITIVES:
            continue
        if not isinstance(entry, Mapping):
            raise _err(source, where, f"expected a mapping with alpha_us and beta_us_per_byte, got {_type_name(entry)}.")
        for key in entry:
            if key not in ("alpha_us", "beta_us_per_byte", "launch_us"):
                raise _err(source, f"{where}.{key}", "unknown key; allowed: alpha_us, beta_us_per_byte, launch_us.")
        out[name] = Primitive(
            alpha_us=_number(_get(entry, "alpha_us", source, f"{where}.alpha_us"), source, f"{where}.alpha_us"),
            beta_us_per_byte=_number(
                _get(entry, "beta_us_per_byte", source, f"{where}.beta_us_per_byte"), source, f"{where}.beta_us_per_byte"
            ),
            launch_us=_number(entry.get("launch_us", 0.0), source, f"{where}.launch_us"),
        )
    return out


def _parse_measurement(value: Any, source: str, i: int) -> Measurement:
    where = f"measurements[{i}]"
    if not isinstance(value, Mapping):
        raise _err(source, where, f"expected a mapping, got {_type_name(value)}.")
    for key in value:
        if key not in MEASUREMENT_FIELDS:
            raise _err(source, f"{where}.{key}", f"unknown key; allowed: {', '.join(MEASUREMENT_FIELDS)}.")
    raw = {k: _get(value, k, source, f"{where}.{k}") for k in MEASUREMENT_FIELDS}
    algorithm = raw["algorithm"]
    if not isinstance(algorithm, str) or not algorithm:
        raise _err(source, f"{where}.algorithm", f"expected a non-empty string, got {algorithm!r}.")
    dtype = raw["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise _err(source, f"{where}.dtype", f"expected one of {', '.join(DTYPE_BYTES)}, got {dtype!r}.")
    m = Measurement(
        algorithm=algorithm,
        numel=_integer(raw["numel"], source, f"{where}.numel", low=1),
        row_numel=_integer(raw["row_numel"], source, f"{where}.row_numel", low=1),
        dtype=dtype,
        world_size=_integer(raw["world_size"], source, f"{where}.world_size", low=1),
        k_max=_integer(raw["k_max"], source, f"{where}.k_max"),
        k_sum=_integer(raw["k_sum"], source, f"{where}.k_sum"),
        union=_number(raw["union"], source, f"{where}.union"),
        overlap=_number(raw["overlap"], source, f"{where}.overlap"),
        density=_number(raw["density"], source, f"{where}.density"),
        time_us=_number(raw["time_us"], source, f"{where}.time_us", positive=True),
        spread_us=_number(raw["spread_us"], source, f"{where}.spread_us"),
        repeats=_integer(raw["repeats"], source, f"{where}.repeats", low=1),
        bytes_sent=_integer(raw["bytes_sent"], source, f"{where}.bytes_sent"),
    )
    try:
        feats = measurement_to_features(m)
    except ColltuneError as exc:
        raise ProfileError(f"{source}: {where}: inconsistent configuration: {exc}") from None
    lo, hi = m.k_max, min(m.k_sum, m.numel)
    tol = 1e-9 * max(1.0, hi)
    if not (lo - tol <= m.union <= hi + tol):
        raise _err(
            source, f"{where}.union",
            f"expected the exact union size in [k_max, min(k_sum, numel)] = [{lo}, {hi}], got {m.union!r}.",
        )
    want = 0.0 if m.k_sum == m.k_max else (m.k_sum - m.union) / (m.k_sum - m.k_max)
    if abs(m.overlap - want) > 1e-6:
        raise _err(source, f"{where}.overlap", f"expected (k_sum - union) / (k_sum - k_max) = {want!r}, got {m.overlap!r}.")
    if abs(m.density - feats.density) > 1e-9 + 1e-6 * feats.density:
        raise _err(source, f"{where}.density", f"expected k_sum / (world_size * numel) = {feats.density!r}, got {m.density!r}.")
    return m


_INT_FIELDS = ("numel", "row_numel", "world_size", "k_max", "k_sum", "repeats", "bytes_sent")
_INT_LOW = {"numel": 1, "row_numel": 1, "world_size": 1, "k_max": 0, "k_sum": 0, "repeats": 1, "bytes_sent": 0}
_FLOAT_FIELDS = ("union", "overlap", "density", "time_us", "spread_us")
_FIELD_SET = frozenset(MEASUREMENT_FIELDS)
#: Integers below this convert to float exactly, so NumPy's float arithmetic on them is Python's.
_EXACT = 2**53


def _measurements_all_valid(raw: list[Any]) -> list[Measurement] | None:
    """Return the measurements of ``raw`` when every one passes every check of :func:`_parse_measurement`, else ``None``.

    The same checks, on columns: NumPy does in milliseconds what costs
    seconds a row at a time for a profile at the size limit. Anything it does
    not decide exactly as Python would (an integer past 2**53, a type other
    than ``int``, ``float`` or ``str``) returns ``None`` too, and the caller
    checks row by row, which also names the first bad row.
    """
    if any(type(m) is not dict or m.keys() != _FIELD_SET for m in raw):
        return None
    col = {name: [m[name] for m in raw] for name in MEASUREMENT_FIELDS}
    if not all(set(map(type, col[k])) <= {str} for k in ("algorithm", "dtype")):
        return None
    if "" in set(col["algorithm"]) or not set(col["dtype"]) <= DTYPE_BYTES.keys():
        return None
    if not all(set(map(type, col[k])) <= {int} for k in _INT_FIELDS):
        return None
    if not all(set(map(type, col[k])) <= {int, float} for k in _FLOAT_FIELDS):
        return None
    try:
        ints = {k: np.array(col[k], dtype=np.int64) for k in _INT_FIELDS}
        nums = {k: np.array(col[k], dtype=np.float64) for k in _FLOAT_FIELDS}
    except OverflowError:
        return None
    if not all(((a >= _INT_LOW[k]) & (a < _EXACT)).all() for k, a in ints.items()):
        return None
    numel, ws, k_max, k_sum = ints["numel"], ints["world_size"], ints["k_max"], ints["k_sum"]
    union, overlap, density = nums["union"], nums["overlap"], nums["density"]
    with np.errstate(all="ignore"):
        ok = np.isfinite(np.stack(list(nums.values()))).all(axis=0)
        ok &= (union >= 0) & (overlap >= 0) & (overlap <= 1) & (density >= 0) & (nums["spread_us"] >= 0)
        ok &= nums["time_us"] > 0
        # Features: k_max <= numel and k_max <= k_sum <= world_size * k_max (as ceil(k_sum / P) <= k_max).
        ok &= (k_max <= numel) & (k_max <= k_sum) & (-(-k_sum // ws) <= k_max)
        # k_sum / (P n) as Python divides integers only while P n converts to float exactly.
        ok &= numel <= (_EXACT - 1) // ws
        hi = np.minimum(k_sum, numel).astype(np.float64)
        tol = 1e-9 * np.maximum(1.0, hi)
        ok &= (k_max.astype(np.float64) - tol <= union) & (union <= hi + tol)
        spread = k_sum - k_max
        want = np.where(spread == 0, 0.0, (k_sum.astype(np.float64) - union) / np.maximum(spread, 1).astype(np.float64))
        ok &= ~(np.abs(overlap - want) > 1e-6)
        dens = k_sum.astype(np.float64) / (ws * numel).astype(np.float64)
        ok &= ~(np.abs(density - dens) > 1e-9 + 1e-6 * dens)
    if not ok.all():
        return None
    for k in _FLOAT_FIELDS:
        col[k] = list(map(float, col[k]))
    return [Measurement(*row) for row in zip(*(col[name] for name in MEASUREMENT_FIELDS))]


def _parse_measurements(raw: list[Any], source: str) -> list[Measurement]:
    checked = _measurements_all_valid(raw)
    if checked is not None:
        return checked
    return [_parse_measurement(m, source, i) for i, m in enumerate(raw)]


def _parse(data: Any, source: str) -> Profile:
    if data is None:
        raise ProfileError(f"{source}: the file is empty; expected a colltune profile (format: {FORMAT}).")
    if not isinstance(data, Mapping):
        raise ProfileError(f"{source}: expected a mapping at the top level, got {_type_name(data)}; is this a colltune profile?")
    fmt = _get(data, "format", source, "format")
    if fmt != FORMAT:
        raise _err(source, "format", f"expected {FORMAT!r}, got {fmt!r}; this file is not a colltune profile.")
    version = _get(data, "version", source, "version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise _err(source, "version", f"expected an integer, got {_type_name(version)} {version!r}.")
    if version != VERSION:
        raise _err(
            source, "version",
            f"version {version} is not supported; this colltune reads version {VERSION}. "
            "Use the colltune release that wrote it, or profile again.",
        )
    for key in data:
        if key not in _TOP_KEYS:
            raise _err(source, str(key), f"unknown key; allowed: {', '.join(_TOP_KEYS)}.")
    kind = _get(data, "kind", source, "kind")
    if kind not in KINDS:
        raise _err(source, "kind", f"expected one of {', '.join(KINDS)}, got {kind!r}.")
    meta = _parse_meta(_get(data, "meta", source, "meta"), source)
    primitives = _parse_primitives(_get(data, "primitives", source, "primitives"), source)
    model = data.get("model")
    if model is not None:
        if not isinstance(model, Mapping):
            raise _err(source, "model", f"expected a mapping of fitted parameters, got {_type_name(model)}.")
        model = _plain(model, source, "model")
    raw_ms = data.get("measurements")
    if raw_ms is None:
        raw_ms = []
    if not isinstance(raw_ms, list):
        raise _err(source, "measurements", f"expected a list, got {_type_name(raw_ms)}.")
    measurements = _parse_measurements(raw_ms, source)
    profile = Profile(kind=kind, meta=meta, primitives=primitives, measurements=measurements, model=model)
    checksum = data.get("checksum")
    if checksum is not None:
        if not isinstance(checksum, str) or len(checksum) != 16:
            raise _err(source, "checksum", f"expected 16 hexadecimal digits, got {checksum!r}.")
        if checksum != f"{profile.digest:016x}":
            raise _err(
                source, "checksum",
                "does not match the content: the file was truncated or changed after it was saved. "
                "Restore it, or if you edited it on purpose, delete the `checksum` line.",
            )
    return profile


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate a profile file.

    Only a YAML safe loader is used: a profile can hold data, never code.
    The load is bounded (see :mod:`colltune.model.yamlsafe`): a file over
    16 MiB is refused before it is read; YAML of more than 100,000 nodes,
    aliases that repeat more than 100,000 nodes, or nesting over 100 levels
    are refused before any value is built.

    Its cost follows the measurements, read without YAML when each is one
    ``- {...}`` line after ``measurements:`` (the layout :func:`save_profile`
    writes; blank and comment lines among them are fine, and a hand-edited
    line is read with YAML on its own): about 0.1 s and 15 MiB per MB of
    profile, so a file at the 16 MiB limit (some 60,000 measurements) takes
    about 2 s and 250 MiB, most of it checking every measurement and the
    checksum. The rest of a profile, and a profile in another layout, is YAML
    and within the 100,000 node limit: at most a second or two and 100 MiB
    (a block-style list of measurements holds some 3,000).

    Args:
        path: the YAML file.

    Returns:
        The validated profile.

    Raises:
        ProfileError: the file is unreadable, over a limit of
            :mod:`colltune.model.yamlsafe`, not YAML, truncated, of another version, or
            has a missing or wrong field; the message names the file and the
            field (or the line and the limit).
    """
    source = os.fspath(path)
    try:
        raw = yamlsafe.read_bytes(source)
    except OSError as exc:
        raise ProfileError(f"{source}: cannot read the profile: {exc.strerror or exc}.") from None
    except yamlsafe.YamlLimitError as exc:
        raise ProfileError(f"{source}: the file is too large for a profile: {exc}.") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{source}: not UTF-8 text (byte {exc.start}); is this a colltune profile?") from None
    try:
        yamlsafe.check_text(text)
        data = _load_fast(text)
        if data is None:
            data = yamlsafe.load(text)  # a bounded safe loader (C parser where PyYAML has libyaml)
    except yamlsafe.YamlLimitError as exc:
        if exc.limit == "nodes":
            where = "" if exc.line is None else f"line {exc.line}: "
            raise ProfileError(f"{source}: {where}{exc.problem}; {_NODES_FIX}.") from None
        raise ProfileError(f"{source}: {exc}.") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ProfileError(f"{source}: not valid YAML{where}: {problem}; the file may be truncated or corrupt.") from None
    return _parse(data, source)


_NODES_FIX = (
    "check that this is the right file. Measurements do not count when each is one `- {...}` line after "
    "`measurements:`, the layout colltune writes; to rewrite a profile so, run "
    "save_profile(Profile.from_dict(yaml.safe_load(open(path))), path) with colltune.model.profile's names"
)
_MEASUREMENTS = "\nmeasurements:\n"
_ITEM = re.compile(r"- \{(.*)\}")
_KEY = re.compile(r"[a-z_][a-z0-9_]*")
_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_FLOAT = re.compile(r"-?(?:0|[1-9][0-9]*)\.[0-9]+(?:e[-+][0-9]+)?")
_WORD = re.compile(r"[a-z][a-z0-9_]*")
#: Plain words YAML reads as something other than a string.
_YAML_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "y", "n", "null"})
_NOT_PLAIN = object()
_NUMBER = _INT.pattern + r"(?:\.[0-9]+(?:e[-+][0-9]+)?)?"  # an int or a float as above
#: A measurement as save_profile writes it: every field, in file order, one plain word or number each.
_ROW = re.compile(
    r"- \{"
    + ", ".join(f"{name}: ({_WORD.pattern if name in ('algorithm', 'dtype') else _NUMBER})" for name in MEASUREMENT_FIELDS)
    + r"\}"
)
#: Line breaks to YAML besides \n (\r\n is made \n first).
_OTHER_BREAKS = ("\r", "\x85", "\u2028", "\u2029")
#: A line YAML skips inside a block sequence: blank, or only a comment.
_SKIP = re.compile(r" *(?:#.*)?")


def _plain_scalar(token: str) -> Any:
    """Return ``token`` as YAML's safe loader reads it, for the plain scalars a saved profile holds; else a marker."""
    if _INT.fullmatch(token):
        return int(token)
    if _FLOAT.fullmatch(token):
        return float(token)
    if _WORD.fullmatch(token) and token not in _YAML_WORDS:
        return token
    return _NOT_PLAIN


def _numbers(tokens: Sequence[str]) -> list[int | float]:
    """Return number tokens as YAML reads them: a float where there is a dot, else an int."""
    dots = "".join(tokens).count(".")  # at most one a token
    if dots == 0:
        return list(map(int, tokens))
    if dots == len(tokens):
        return list(map(float, tokens))
    return [float(t) if "." in t else int(t) for t in tokens]


def _read_item(line: str) -> dict[str, Any] | None:
    """Return the mapping a ``- {key: value, ...}`` line of plain scalars holds, or ``None``."""
    m = _ITEM.fullmatch(line)
    if m is None:
        return None
    item: dict[str, Any] = {}
    for pair in m.group(1).split(", "):
        key, sep, token = pair.partition(": ")
        value = _plain_scalar(token)
        if not sep or not _KEY.fullmatch(key) or key in item or value is _NOT_PLAIN:
            return None
        item[key] = value
    return item


_ROW_ITEM = object()  # an entry of items still to come from the rows read by _ROW


def _load_fast(text: str) -> dict[str, Any] | None:
    """Return the data of a profile in the layout :func:`save_profile` writes, reading its measurements without YAML.

    The measurements come last, one flow mapping of plain scalars per line;
    they are most of a measured profile, and YAML reads them ten times
    slower than this, in 400 bytes a value. Blank and comment lines among
    them are skipped, as YAML skips them; the lines that are not plain
    (a quoted value, a number in another notation, a trailing comment: a hand
    edit) are read with YAML, all in one document. Anything else (a line that
    is not a ``- {`` entry at column 0, an alias, a YAML error, an entry over
    two lines) returns ``None``, and the caller reads the whole text with
    YAML: the result is the same either way.
    """
    if "\r" in text:
        text = text.replace("\r\n", "\n")  # YAML reads \r\n as \n
    cut = text.find(_MEASUREMENTS)
    if cut < 0:
        return None
    section = text[cut + len(_MEASUREMENTS):]
    if any(c in section for c in _OTHER_BREAKS):
        return None  # lines YAML breaks where split("\n") does not
    items: list[Any] = []
    rows: list[tuple[str, ...]] = []  # the fields of lines _ROW reads, every one in file order
    others: list[tuple[int, str]] = []  # (index in items, line) of the entries left to YAML
    for line in section.split("\n"):
        row = _ROW.fullmatch(line)
        if row is not None:
            rows.append(row.groups())
            items.append(_ROW_ITEM)
            continue
        item = _read_item(line)
        if item is not None:
            items.append(item)
        elif line.startswith("- {"):  # a flow mapping: no skipped line below can belong to it unnoticed
            others.append((len(items), line))
            items.append(None)
        elif not _SKIP.fullmatch(line):
            return None
    if not items:
        return None  # `measurements:` and no entry is null to YAML, not an empty list
    if rows:
        # Converted a field at a time: the per-token work is the bulk of reading a large profile.
        cols: list[Sequence[Any]] = list(zip(*rows))
        if _YAML_WORDS.intersection(cols[0]) or _YAML_WORDS.intersection(cols[3]):
            return None
        cols = [col if i in (0, 3) else _numbers(col) for i, col in enumerate(cols)]
        read = iter([dict(zip(MEASUREMENT_FIELDS, values)) for values in zip(*cols)])
        items = [next(read) if item is _ROW_ITEM else item for item in items]
    if others:
        # Entries on one line each, at column 0, make a block sequence alone as they do after `measurements:`;
        # an alias of a value above them does not resolve here, and the whole text goes to YAML.
        try:
            parsed = yamlsafe.load("\n".join(line for _, line in others) + "\n")
        except (yaml.YAMLError, yamlsafe.YamlLimitError):
            return None  # the whole text tells the line
        if not isinstance(parsed, list) or len(parsed) != len(others):
            return None
        for (i, _), value in zip(others, parsed):
            items[i] = value
    data = yamlsafe.load(text[: cut + 1])
    if not isinstance(data, dict) or "measurements" in data:
        return None
    data["measurements"] = items
    return data


def _dump_text(profile: Profile) -> str:
    doc = profile.to_dict()
    # Validate before anything touches the disk; a bad object never becomes a file.
    checked = _parse(doc, "<profile>")
    doc = checked.to_dict()
    head = {"format": doc.pop("format"), "version": doc.pop("version"), "checksum": f"{checked.digest:016x}"}
    head.update(doc)
    text = yaml.dump(head, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=10**9, allow_unicode=True)
    return "# colltune profile: data only; see colltune.model.profile for the format.\n" + text


def _write_text(fh: IO[str], text: str) -> None:
    fh.write(text)


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Write a profile atomically: a temporary file in the same directory, then ``os.replace``.

    A reader sees the old file or the new one, never half of one; if anything
    fails, the old file is left untouched and the temporary file removed.

    Args:
        profile: the profile; it is validated first.
        path: the destination; its directory must exist.

    Raises:
        ProfileError: the profile is invalid or the file cannot be written.
    """
    dest = os.fspath(path)
    text = _dump_text(profile)
    directory = os.path.dirname(os.path.abspath(dest))
    try:
        mode = os.stat(dest).st_mode & 0o777
    except OSError:
        mode = 0o644
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dest)}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise ProfileError(f"{dest}: cannot create a temporary file in {directory}: {exc.strerror or exc}.") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            _write_text(fh, text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise ProfileError(f"{dest}: cannot write the profile: {exc.strerror or exc}.") from exc
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def profile_from_measurements(
    measurements: Sequence[Measurement],
    primitives: Mapping[str, Primitive],
    meta: Mapping[str, Any],
    *,
    model: Mapping[str, Any] | None = None,
) -> Profile:
    """Return a ``measured`` profile (a convenience for the profiler).

    Args:
        measurements: the timed configurations.
        primitives: alpha-beta constants (fitted or prior).
        meta: description; must hold ``backend``.
        model: fitted parameters as plain data, if any.

    Returns:
        The validated profile.
    """
    prof = Profile(kind="measured", meta=dict(meta), primitives=dict(primitives),
                   measurements=list(measurements), model=dict(model) if model is not None else None)
    return _parse(prof.to_dict(), "<profile>")


def learned_columns(measurements: Sequence[Measurement]) -> list[Measurement]:
    """The measurements of the built-in algorithms (``cost_model.ALGORITHMS``), the learned model's columns.

    A plugin's measurements stay in a profile (the report and ``simulate``
    read them), but the learned model has no column for them: it prices a
    plugin by its schedule.
    """
    return [m for m in measurements if m.algorithm in BUILTIN_NAMES]
