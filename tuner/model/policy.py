"""YAML policy files: pin algorithms and set knobs per tensor, size and cluster.

A policy is data, never code. It is read with safe YAML semantics only (no
Python tags, nothing is ever instantiated), validated against a fixed schema,
and every mistake is reported with the file, the 1-based line, the key and
what is allowed there, for example::

    example.yaml:7: rules[0].when: unknown key 'numell'; allowed keys: tensor, numel, density, world_size, overlap, dtype, backend

This module is pure: PyYAML and the standard library. It needs no process
group and can be tested on its own.

Format (version 1)
------------------

.. code-block:: yaml

    version: 1                      # required; the only supported version is 1
    profile: cpu-gloo.yaml          # optional; relative paths resolve against
                                    # the directory of the policy file
    default: auto                   # optional (auto); auto | dense | allgather | oktopk
    knobs:                          # optional; global knobs per algorithm
      oktopk: {boundary_refresh: 64, peers_in_flight: 4, balance: true}
      allgather: {mode: auto}
    rules:                          # optional; first matching rule wins
      - name: big-embeddings        # optional label for logs and explanations
        when:                       # optional; every condition given must hold
          tensor: "embed*"          # fnmatch glob (case-sensitive), or a list of globs
          numel: [1000000, null]    # [min, max], inclusive, null = open end;
                                    # a single integer n means [n, n]
          density: [0.0, 0.01]      # within [0, 1]
          world_size: [8, null]     # a single integer n means [n, n]
          overlap: [0.5, 1.0]       # within [0, 1]
          dtype: [float16, bfloat16]  # a dtype name or a list of them
          backend: gloo             # the group's backend, or a list of them
        use: oktopk                 # optional: an algorithm or auto; omitted =
                                    # the policy default
        knobs:                      # optional; override the global knobs
          oktopk: {peers_in_flight: 8}

Rules:

- ``when`` keys: ``tensor``, ``numel``, ``density``, ``world_size``,
  ``overlap``, ``dtype``, ``backend`` (``gloo``, ``nccl``...: the process
  group's backend, lower case). A rule without ``when`` matches every call.
- dtype names: ``float32``, ``float64``, ``float16``, ``bfloat16``; the
  aliases ``float``, ``double``, ``half``, ``fp32``, ``fp64``, ``fp16``,
  ``bf16`` and a ``torch.`` prefix are accepted and normalized.
- Knobs are checked per algorithm against :func:`knob_table` (the knobs each algorithm declares). A rule that uses a
  fixed algorithm may only set knobs for that algorithm (others would never
  apply); a rule with ``use: auto`` may set knobs for any algorithm.
- A rule must say ``use`` or ``knobs`` (an empty rule is a mistake).
- Rule names must be unique.
- Booleans are not numbers: ``numel: [true, null]`` is an error, and
  numbers are not booleans: a boolean knob (``oktopk: {balance: false}``)
  takes only ``true`` or ``false`` (``yes``, ``no``, ``on``, ``off``, ``1``
  and ``"true"`` are errors).
- ``1e6`` is read as a number (YAML 1.2 style), and an integral float such as
  ``1e6`` is accepted where an integer is expected.
- ``null`` for ``knobs``, ``rules``, ``when`` or an algorithm's knob mapping
  means empty (so a key whose entries are all commented out still loads).
- Anchors, aliases and ``<<`` merge keys work; duplicate keys are errors.
  Loading is bounded (:mod:`colltune.model.yamlsafe`): a file over 16 MiB, more
  than 100,000 values (YAML nodes), aliases that repeat more than 100,000
  nodes, and nesting over 100 levels (or a recursive alias) are errors.

Matching unknown conditions
---------------------------

A condition the caller does not know yet is passed as ``None`` (for example
``overlap`` before the first call measured it, or a tensor without a name).
A rule that constrains that condition does **not** match; rules that do not
constrain it still can. So ``overlap: [null, null]`` is meaningful: "only
once overlap is known". The choice errs on the side of not pinning an
algorithm on a guess; the cost model (``auto``) handles the unknown case.
A NaN density or overlap counts as unknown.

Environment variables
---------------------

Like NCCL's, they override the file. :func:`policy_from_env` reads them.

``COLLTUNE_ALGO``
    Force one algorithm for every call (``dense``, ``allgather``, ``oktopk``)
    or ``auto`` to let the cost model decide even where a rule pins an
    algorithm. Case-insensitive. Knobs from the policy still apply.
``COLLTUNE_POLICY``
    Path of the policy file to load (relative to the working directory).
``COLLTUNE_PROFILE``
    Path of the profile whose cost model ``auto`` uses (one written by
    ``colltune profile``); it replaces a profile passed in code and the
    policy's ``profile``.
``COLLTUNE_DEBUG``
    Decision logging level: ``off`` (or ``0``, empty), ``warn``,
    ``info`` (or ``1``), ``debug`` / ``trace`` (or ``2``). Case-insensitive.
    Another value warns and logs at ``debug``: a logging setting never stops a job.
``COLLTUNE_LOG_FILE``
    Append one JSON line per decision to this file. ``%h`` is replaced by the
    host name, ``%p`` by the process id and ``%r`` by the rank (see
    :meth:`Overrides.log_file_for`), as in ``NCCL_DEBUG_FILE``. Setting it
    turns decision logging on even without ``COLLTUNE_DEBUG``.

Every rank must see the same ``COLLTUNE_ALGO`` and the same policy;
:func:`config_digest` folds both into one number to compare across ranks.

Example:
    >>> policy = parse_policy('''
    ... version: 1
    ... default: auto
    ... rules:
    ...   - name: tiny
    ...     when: {numel: [null, 4096]}
    ...     use: allgather
    ... ''', source="inline.yaml")
    >>> d = policy.match("fc.weight", 1024, 0.01, 4, None, "float32")
    >>> d.algorithm, d.rule_index, d.rule_name
    ('allgather', 0, 'tiny')
    >>> policy.match("fc.weight", 10**6, 0.01, 4, None, "float32").algorithm
    'auto'
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import math
import os
import re
import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from colltune.algorithms import registry
from colltune.algorithms.errors import ColltuneValueError
from colltune.algorithms.knobs import Knob
from colltune.model import yamlsafe

__all__ = [
    "AUTO",
    "DTYPES",
    "knob_table",
    "SUPPORTED_VERSIONS",
    "DEFAULT_POLICY",
    "PolicyError",
    "Rule",
    "Decision",
    "Policy",
    "Overrides",
    "known_algorithms",
    "parse_policy",
    "load_policy",
    "policy_from_env",
    "config_digest",
]

logger = logging.getLogger(__name__)

#: The pseudo-algorithm that defers to the cost model.
AUTO = "auto"
#: Policy format versions this module reads.
SUPPORTED_VERSIONS: tuple[int, ...] = (1,)
#: Canonical dtype names a rule may constrain.
DTYPES: tuple[str, ...] = ("float32", "float64", "float16", "bfloat16")
_DTYPE_ALIASES: dict[str, str] = {
    "float": "float32",
    "fp32": "float32",
    "double": "float64",
    "fp64": "float64",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
}

_TOP_KEYS = ("version", "profile", "default", "knobs", "rules")
_RULE_KEYS = ("name", "when", "use", "knobs")
_WHEN_KEYS = ("tensor", "numel", "density", "world_size", "overlap", "dtype", "backend")

ENV_ALGO = "COLLTUNE_ALGO"
ENV_POLICY = "COLLTUNE_POLICY"
ENV_PROFILE = "COLLTUNE_PROFILE"
ENV_DEBUG = "COLLTUNE_DEBUG"
ENV_LOG_FILE = "COLLTUNE_LOG_FILE"
_DEBUG_LEVELS: dict[str, int | None] = {
    "": None,
    "0": None,
    "off": None,
    "none": None,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "1": logging.INFO,
    "info": logging.INFO,
    "2": logging.DEBUG,
    "debug": logging.DEBUG,
    "trace": logging.DEBUG,
}


# --------------------------------------------------------------------------- errors


class PolicyError(ColltuneValueError):
    """A policy file, policy text or policy environment variable is invalid.

    The message reads ``<source>:<line>: <key>: <problem>; <allowed>``; parts
    that do not apply (no line for an environment variable, no key for a YAML
    syntax error) are left out.

    Attributes:
        problem: what is wrong.
        source: the file name (or ``<string>``, or ``environment``).
        line: 1-based line, or ``None``.
        key: dotted key path such as ``rules[0].when.numel``, or ``None``.
        allowed: what would have been accepted, or ``None``.
    """

    def __init__(
        self,
        problem: str,
        source: str | None = None,
        line: int | None = None,
        key: str | None = None,
        allowed: str | None = None,
    ) -> None:
        self.problem = problem
        self.source = source
        self.line = line
        self.key = key
        self.allowed = allowed
        super().__init__(self._format())

    def _format(self) -> str:
        where = ""
        if self.source is not None:
            where = self.source if self.line is None else f"{self.source}:{self.line}"
        parts = [p for p in (where, self.key) if p]
        text = self.problem if self.allowed is None else f"{self.problem}; {self.allowed}"
        return ": ".join(parts + [text])


# --------------------------------------------------------------------------- knobs


def knob_table() -> dict[str, dict[str, Knob]]:
    """Return the knob schema: algorithm -> knob name -> :class:`Knob`, from the algorithm registry.

    An algorithm's call knobs, then its top-k state knobs (``local_refresh``,
    ``global_refresh`` of Ok-Topk), as the algorithm declares them.
    """
    return {name: {k.name: k for k in sorted(registry.knob_specs(name), key=lambda k: k.state)}
            for name in registry.names()}


def known_algorithms() -> tuple[str, ...]:
    """Return the algorithm names a policy may use (``auto`` excluded), from the algorithm registry."""
    return tuple(n for n in registry.names() if n != AUTO)


# --------------------------------------------------------------------------- frozen data


class _FrozenDict(dict):
    """A read-only, hashable, picklable dict (decisions are shared and cached)."""

    __slots__ = ()

    def _readonly(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("policy data is read-only; copy it with dict(...) first")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]
    __ior__ = _readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_FrozenDict, (dict(self),))

    def __repr__(self) -> str:
        return dict.__repr__(self)


def _freeze_knobs(knobs: Mapping[str, Mapping[str, Any]]) -> _FrozenDict:
    return _FrozenDict({algo: _FrozenDict(kv) for algo, kv in knobs.items()})


def _merge_knobs(base: Mapping[str, Mapping[str, Any]], over: Mapping[str, Mapping[str, Any]]) -> _FrozenDict:
    out: dict[str, dict[str, Any]] = {a: dict(kv) for a, kv in base.items()}
    for algo, kv in over.items():
        out.setdefault(algo, {}).update(kv)
    return _freeze_knobs(out)


Range = tuple[Any, Any]


def _in_range(value: Any, bounds: Range) -> bool:
    lo, hi = bounds
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def _unknown(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def _dtype_name(dtype: Any) -> str | None:
    """Return the canonical name of a dtype given as a string or a ``torch.dtype``."""
    if dtype is None:
        return None
    name = str(dtype).strip().lower()
    if name.startswith("torch."):
        name = name[len("torch.") :]
    return _DTYPE_ALIASES.get(name, name)


@dataclass(frozen=True)
class Rule:
    """One validated rule of a policy.

    Attributes:
        index: 0-based position in the policy (first match wins).
        name: the rule's label, or ``None``.
        line: 1-based line of the rule in its file.
        use: the algorithm or ``auto`` (the policy default when omitted).
        tensor: globs on the tensor name, or ``None`` for any name.
        numel, density, world_size, overlap: inclusive ``(min, max)`` with
            ``None`` for an open end, or ``None`` for no constraint.
        dtype: canonical dtype names allowed, or ``None`` for any dtype.
        backend: backend names allowed (lower case), or ``None`` for any backend.
        knobs: the rule's own knobs, per algorithm.
        merged_knobs: the policy's global knobs overridden by the rule's.
    """

    index: int
    name: str | None
    line: int = field(compare=False)
    use: str = AUTO
    tensor: tuple[str, ...] | None = None
    numel: Range | None = None
    density: Range | None = None
    world_size: Range | None = None
    overlap: Range | None = None
    dtype: tuple[str, ...] | None = None
    backend: tuple[str, ...] | None = None
    knobs: Mapping[str, Mapping[str, Any]] = field(default_factory=_FrozenDict)
    merged_knobs: Mapping[str, Mapping[str, Any]] = field(default_factory=_FrozenDict)

    @property
    def label(self) -> str:
        """Return ``rule 2 'name'`` (or ``rule 2``) for messages."""
        return f"rule {self.index}" + (f" {self.name!r}" if self.name else "")

    def matches(
        self,
        name: str | None,
        numel: int | None,
        density: float | None,
        world_size: int | None,
        overlap: float | None,
        dtype: str | None,
        backend: str | None = None,
    ) -> bool:
        """Return whether a call with these conditions satisfies every ``when`` condition.

        A condition passed as ``None`` (or NaN) is unknown and fails any
        constraint on it. ``dtype`` is canonicalized (``torch.float16`` and
        ``half`` both mean ``float16``).
        """
        if self.tensor is not None:
            if name is None or not any(fnmatch.fnmatchcase(name, g) for g in self.tensor):
                return False
        for bounds, value in (
            (self.numel, numel),
            (self.density, density),
            (self.world_size, world_size),
            (self.overlap, overlap),
        ):
            if bounds is not None and (_unknown(value) or not _in_range(value, bounds)):
                return False
        if self.dtype is not None:
            if _dtype_name(dtype) not in self.dtype:
                return False
        if self.backend is not None and (backend is None or backend.lower() not in self.backend):
            return False
        return True

    def when(self) -> dict[str, Any]:
        """Return the normalized conditions as plain data (absent ones left out)."""
        out: dict[str, Any] = {}
        if self.tensor is not None:
            out["tensor"] = list(self.tensor)
        for key in ("numel", "density", "world_size", "overlap"):
            bounds = getattr(self, key)
            if bounds is not None:
                out[key] = list(bounds)
        if self.dtype is not None:
            out["dtype"] = list(self.dtype)
        if self.backend is not None:
            out["backend"] = list(self.backend)
        return out

    def as_dict(self) -> dict[str, Any]:
        """Return the normalized rule as plain data (what the digest covers)."""
        return {
            "name": self.name,
            "when": self.when(),
            "use": self.use,
            "knobs": {a: dict(kv) for a, kv in self.knobs.items()},
        }


@dataclass(frozen=True)
class Decision:
    """What a policy says about one call.

    Attributes:
        algorithm: an algorithm name, or ``auto`` to defer to the cost model.
        rule_index: index of the matching rule, or ``None`` (the default).
        rule_name: name of the matching rule, or ``None``.
        knobs: knobs per algorithm (global knobs overridden by the rule's).
            With ``auto`` the selector picks the knobs of the algorithm it runs.
        reason: one line saying why, for logs and ``colltune explain``.
        forced: whether ``COLLTUNE_ALGO`` overrode the policy.
    """

    algorithm: str
    rule_index: int | None
    rule_name: str | None
    knobs: Mapping[str, Mapping[str, Any]]
    reason: str
    forced: bool = False

    def knobs_for(self, algorithm: str) -> dict[str, Any]:
        """Return a fresh dict of the knobs set for ``algorithm`` (empty if none)."""
        return dict(self.knobs.get(algorithm, {}))

    def as_dict(self) -> dict[str, Any]:
        """Return the decision as JSON-ready plain data (one decision-log line)."""
        return {
            "algorithm": self.algorithm,
            "rule_index": self.rule_index,
            "rule_name": self.rule_name,
            "knobs": {a: dict(kv) for a, kv in self.knobs.items()},
            "reason": self.reason,
            "forced": self.forced,
        }


def _digest(data: Any) -> int:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return int.from_bytes(hashlib.blake2b(text.encode("ascii"), digest_size=8).digest(), "big", signed=True)


@dataclass(frozen=True)
class Policy:
    """A validated policy. Build it with :func:`load_policy` or :func:`parse_policy`.

    Attributes:
        version: the format version (1).
        default: the algorithm or ``auto`` used when no rule matches.
        rules: the rules, in order; the first match wins.
        knobs: global knobs per algorithm.
        profile: the profile path as written in the file, or ``None``.
        profile_path: ``profile`` resolved against the policy file's
            directory (``~`` expanded), or ``None``. Existence is not checked
            here; the profile loader reports a missing file.
        source: where the policy came from (file path as given, or a label);
            used in messages, not compared and not part of the digest.
        digest: a stable signed 64-bit hash of the normalized content
            (version, profile as written, default, knobs, rules): independent
            of key order, whitespace, comments, aliases and spellings of
            the same value, so it fits an int64 tensor to compare across ranks.
    """

    version: int
    default: str
    rules: tuple[Rule, ...]
    knobs: Mapping[str, Mapping[str, Any]]
    profile: str | None
    profile_path: Path | None
    source: str = field(compare=False)
    digest: int = field(init=False)
    _default_decision: Decision = field(init=False, repr=False, compare=False)
    _rule_decisions: tuple[Decision, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", _digest(self.as_dict()))
        object.__setattr__(
            self,
            "_default_decision",
            Decision(self.default, None, None, self.knobs, f"default of policy {self.source} (no rule matched)"),
        )
        object.__setattr__(
            self,
            "_rule_decisions",
            tuple(
                Decision(r.use, r.index, r.name, r.merged_knobs, f"{r.label} of policy {self.source}:{r.line}")
                for r in self.rules
            ),
        )

    def as_dict(self) -> dict[str, Any]:
        """Return the normalized content as plain data (what :attr:`digest` hashes)."""
        return {
            "version": self.version,
            "profile": self.profile,
            "default": self.default,
            "knobs": {a: dict(kv) for a, kv in self.knobs.items()},
            "rules": [r.as_dict() for r in self.rules],
        }

    def match(
        self,
        name: str | None,
        numel: int | None,
        density: float | None,
        world_size: int | None,
        overlap: float | None,
        dtype: str | None,
        backend: str | None = None,
    ) -> Decision:
        """Return the decision of the first rule that matches the call, else the default.

        Args:
            name: the tensor's name, or ``None`` if it has none.
            numel: number of elements of the dense tensor.
            density: fraction of nonzero rows (or selected entries), in [0, 1].
            world_size: number of ranks.
            overlap: index overlap in [0, 1] (defined in :mod:`colltune.model.features`), or
                ``None`` before it is measured.
            dtype: value dtype, as a name (``float32``) or a ``torch.dtype``.
            backend: the process group's backend (``gloo``, ``nccl``), or ``None``.

        Returns:
            A shared, read-only :class:`Decision`. Any argument may be
            ``None`` (unknown); a rule that constrains it does not match.
        """
        for rule, decision in zip(self.rules, self._rule_decisions):
            if rule.matches(name, numel, density, world_size, overlap, dtype, backend):
                return decision
        return self._default_decision

    @property
    def algorithms_used(self) -> frozenset[str]:
        """Return every algorithm (or ``auto``) this policy can answer."""
        return frozenset([self.default] + [r.use for r in self.rules])


# --------------------------------------------------------------------------- YAML loading


class _PolicyLoader(yaml.SafeLoader):
    """Safe loader that also reads ``1e6`` (no dot) as a float, as YAML 1.2 does.

    Nodes keep their start marks, so every check can name the line.
    """


_PolicyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

_T = "tag:yaml.org,2002:"
_TAG_NAMES = {
    _T + "str": "string",
    _T + "int": "integer",
    _T + "float": "float",
    _T + "bool": "boolean",
    _T + "null": "null",
    _T + "seq": "list",
    _T + "map": "mapping",
}
_ALLOWED_TAGS = frozenset(_TAG_NAMES) | {_T + "merge"}


def _describe(node: Node) -> str:
    kind = _TAG_NAMES.get(node.tag, node.tag)
    if isinstance(node, ScalarNode):
        return f"{kind} {node.value!r}" if node.tag != _T + "null" else "null"
    return f"a {kind}"


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def _flow(nodes: Iterable[Node]) -> str:
    return "[" + ", ".join(n.value if isinstance(n, ScalarNode) else "..." for n in nodes) + "]"


class _Parser:
    """Walks the composed node tree and builds a :class:`Policy`."""

    def __init__(self, text: str, source: str, base_dir: Path | None) -> None:
        self.source = source
        self.base_dir = base_dir
        self.loader = _PolicyLoader(text)

    # -- helpers


    @property
    def algorithms(self) -> tuple[str, ...]:
        """The registered algorithms, read when a name needs checking (the registry loads them)."""
        return known_algorithms()
    def fail(self, node: Node | None, key: str | None, problem: str, allowed: str | None = None) -> PolicyError:
        return PolicyError(problem, self.source, None if node is None else _line(node), key or None, allowed)

    def scalar(self, node: Node) -> Any:
        if node.tag == _T + "str":
            return node.value
        return self.loader.construct_object(node, deep=True)

    def mapping(
        self, node: Node, key: str, what: str, allowed: tuple[str, ...] | None = None
    ) -> Iterator[tuple[str, Node, Node]]:
        """Yield ``(key, key_node, value_node)``; keys must be unique strings, and in ``allowed`` if given."""
        if not isinstance(node, MappingNode):
            raise self.fail(node, key, f"expected {what}, got {_describe(node)}")
        try:
            self.loader.flatten_mapping(node)  # resolves << merge keys
        except yaml.MarkedYAMLError as e:
            raise self.fail(node, key, f"bad merge key: {e.problem}") from None
        hint = None if allowed is None else "allowed keys: " + ", ".join(allowed)
        seen: dict[str, Node] = {}
        for knode, vnode in node.value:
            if not isinstance(knode, ScalarNode) or knode.tag != _T + "str":
                raise self.fail(knode, key, f"keys must be strings, got {_describe(knode)}", hint)
            k = knode.value
            if allowed is not None and k not in allowed:
                raise self.fail(knode, key, f"unknown key {k!r}", hint)
            if k in seen:
                raise self.fail(knode, key, f"duplicate key {k!r} (first at line {_line(seen[k])})", "give each key once")
            seen[k] = knode
            yield k, knode, vnode

    def is_null(self, node: Node) -> bool:
        return isinstance(node, ScalarNode) and node.tag == _T + "null"

    def string(self, node: Node, key: str, allowed: str | None = None) -> str:
        if not isinstance(node, ScalarNode) or node.tag != _T + "str":
            raise self.fail(node, key, f"expected a string, got {_describe(node)}", allowed)
        return node.value

    def number(self, node: Node, key: str, *, integer: bool, expected: str) -> int | float:
        """Return an int (``integer``) or a finite float; booleans never pass."""
        if not isinstance(node, ScalarNode) or node.tag not in (_T + "int", _T + "float"):
            raise self.fail(node, key, f"expected {expected}, got {_describe(node)}")
        value = self.scalar(node)
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail(node, key, f"expected {expected}, got {node.value!r}", "use null for an open end")
        if integer:
            if isinstance(value, float):
                if not value.is_integer():
                    raise self.fail(node, key, f"expected {expected}, got float {node.value!r}")
                value = int(value)
            return int(value)
        return float(value)

    def boolean(self, node: Node, key: str, allowed: str | None = None) -> bool:
        """Return ``True`` or ``False`` for a YAML ``true`` or ``false`` (any case).

        Args:
            node: the value's node.
            key: the dotted key, for the message.
            allowed: what the key accepts, for the message.

        Returns:
            The boolean written.

        Raises:
            PolicyError: the value is not a boolean (a number, a string such
                as ``"yes"``, a list, ...), or is one of the YAML 1.1
                spellings ``yes``, ``no``, ``on``, ``off``: only ``true`` and
                ``false`` are booleans in YAML 1.2, so those would read
                differently elsewhere.
        """
        if not isinstance(node, ScalarNode) or node.tag != _T + "bool":
            raise self.fail(node, key, f"expected true or false, got {_describe(node)}", allowed)
        if node.value.lower() not in ("true", "false"):
            raise self.fail(node, key, f"expected true or false, got {node.value!r} (a YAML 1.1 spelling)", allowed)
        return node.value.lower() == "true"

    def algorithm(self, node: Node, key: str, *, allow_auto: bool) -> str:
        if allow_auto and isinstance(node, ScalarNode) and node.value == AUTO:
            return self.string(node, key, "allowed: auto")  # no need to load the registry
        names = ((AUTO,) if allow_auto else ()) + self.algorithms
        allowed = "allowed: " + ", ".join(names)
        name = self.string(node, key, allowed)
        if name not in names:
            problem = "'auto' is not allowed here" if name == AUTO else f"unknown algorithm {name!r}"
            raise self.fail(node, key, problem, allowed)
        return name

    # -- sections

    def parse(self) -> Policy:
        try:
            return self._parse()
        finally:
            self.loader.dispose()

    def _parse(self) -> Policy:
        root = self.compose()
        self.check_tags(root)
        items = {k: (kn, vn) for k, kn, vn in self.mapping(root, "", "a mapping of policy keys", _TOP_KEYS)}
        version = self.version(root, items)
        profile, profile_path = self.profile(items)
        default = AUTO
        if "default" in items:
            default = self.algorithm(items["default"][1], "default", allow_auto=True)
        knobs: dict[str, dict[str, Any]] = {}
        if "knobs" in items:
            knobs = self.knobs(items["knobs"][1], "knobs", None)
        frozen_knobs = _freeze_knobs(knobs)
        rules = self.rules(items["rules"][1], default, frozen_knobs) if "rules" in items else []
        return Policy(version, default, tuple(rules), frozen_knobs, profile, profile_path, self.source)

    def compose(self) -> Node:
        """Return the document's node graph, checked by :mod:`colltune.model.yamlsafe` before any value is built.

        Aliases that repeat too much or nesting too deep are refused, as are
        YAML syntax errors and an empty document, with the line.
        """
        try:
            root = yamlsafe.compose(self.loader)
        except yamlsafe.YamlLimitError as e:
            raise PolicyError(e.problem, self.source, e.line, None, e.fix) from None
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            problem = e.problem or e.context or "invalid YAML"
            if e.context and e.problem:
                at = "" if e.context_mark is None else f" (line {e.context_mark.line + 1})"
                problem = f"{e.context}{at}: {e.problem}"
            raise PolicyError(f"YAML syntax error: {problem}", self.source,
                              None if mark is None else mark.line + 1) from None
        except yaml.YAMLError as e:
            raise PolicyError(f"YAML syntax error: {e}", self.source) from None
        if root is None:
            raise PolicyError("the policy is empty", self.source, 1, None,
                              "a policy needs at least 'version: 1'")
        return root

    def version(self, root: Node, items: dict[str, tuple[Node, Node]]) -> int:
        """Return the required ``version``, one of :data:`SUPPORTED_VERSIONS`."""
        if "version" not in items:
            raise self.fail(root, None, "missing required key 'version'", "add 'version: 1' at the top")
        vnode = items["version"][1]
        if not (isinstance(vnode, ScalarNode) and vnode.tag == _T + "int"):
            raise self.fail(vnode, "version", f"expected an integer, got {_describe(vnode)}",
                            "allowed: " + ", ".join(map(str, SUPPORTED_VERSIONS)))
        version = int(self.scalar(vnode))
        if version not in SUPPORTED_VERSIONS:
            raise self.fail(vnode, "version", f"unsupported version {version}",
                            "allowed: " + ", ".join(map(str, SUPPORTED_VERSIONS)))
        return version

    def profile(self, items: dict[str, tuple[Node, Node]]) -> tuple[str | None, Path | None]:
        """Return the ``profile`` as written and as a path (relative to the policy's directory), or ``None``."""
        if "profile" not in items or self.is_null(items["profile"][1]):
            return None, None
        pnode = items["profile"][1]
        profile = self.string(pnode, "profile", "allowed: a path to a profile YAML file")
        if not profile.strip():
            raise self.fail(pnode, "profile", "empty path", "allowed: a path to a profile YAML file, or leave the key out")
        profile_path = Path(os.path.expanduser(profile))
        if not profile_path.is_absolute() and self.base_dir is not None:
            profile_path = self.base_dir / profile_path
        return profile, profile_path

    def rules(self, rnode: Node, default: str, frozen_knobs: _FrozenDict) -> list[Rule]:
        """Return the ``rules`` list, each rule checked, names unique."""
        if self.is_null(rnode):
            return []
        if not isinstance(rnode, SequenceNode):
            raise self.fail(rnode, "rules", f"expected a list of rules, got {_describe(rnode)}",
                            "write each rule as '- when: ... use: ...'")
        rules: list[Rule] = []
        names: dict[str, int] = {}
        for i, node in enumerate(rnode.value):
            rule = self.rule(node, i, default, frozen_knobs)
            if rule.name is not None:
                if rule.name in names:
                    raise self.fail(node, f"rules[{i}].name", f"duplicate rule name {rule.name!r} "
                                    f"(first at line {names[rule.name]})", "give each rule its own name")
                names[rule.name] = rule.line
            rules.append(rule)
        return rules

    def check_tags(self, root: Node) -> None:
        """Reject any tag beyond plain data (``!!python/...``, custom ``!tags``)."""
        seen: set[int] = set()
        stack: list[tuple[Node, str]] = [(root, "")]
        while stack:
            node, path = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.tag not in _ALLOWED_TAGS:
                tag = node.tag.replace(_T, "!!", 1) if node.tag.startswith(_T) else node.tag
                raise self.fail(node, path, f"unsupported YAML tag {tag!r}",
                                "policies are plain data: strings, numbers, booleans, null, lists and mappings")
            if isinstance(node, SequenceNode):
                stack.extend((v, f"{path}[{j}]") for j, v in enumerate(node.value))
            elif isinstance(node, MappingNode):
                for k, v in node.value:
                    name = k.value if isinstance(k, ScalarNode) else "?"
                    stack.extend(((k, path), (v, f"{path}.{name}" if path else name)))

    def knobs(self, node: Node, key: str, use: str | None) -> dict[str, dict[str, Any]]:
        """Parse ``{algorithm: {knob: value}}``; with ``use`` set, only that algorithm's knobs."""
        if self.is_null(node):
            return {}
        out: dict[str, dict[str, Any]] = {}
        algos = self.algorithms
        for algo, knode, vnode in self.mapping(node, key, "a mapping of algorithm names to knobs"):
            if algo not in algos:
                raise self.fail(knode, key, f"unknown algorithm {algo!r}", "allowed: " + ", ".join(algos))
            if use is not None and use != AUTO and algo != use:
                raise self.fail(knode, key, f"knobs for {algo!r} never apply because the rule uses {use!r}",
                                f"allowed: knobs for {use!r}, or 'use: auto'")
            out[algo] = self.knob_values(vnode, f"{key}.{algo}", algo)
        return out

    def knob_values(self, node: Node, key: str, algo: str) -> dict[str, Any]:
        specs = knob_table().get(algo, {})
        if self.is_null(node):
            return {}
        allowed = "allowed knobs: " + (", ".join(specs) if specs else f"none ({algo} has no knobs)")
        out: dict[str, Any] = {}
        for name, knode, vnode in self.mapping(node, key, "a mapping of knob names to values"):
            if name not in specs:
                raise self.fail(knode, key, f"unknown knob {name!r} for {algo!r}", allowed)
            out[name] = self.knob_value(specs[name], vnode, f"{key}.{name}")
        return out

    def knob_value(self, spec: Knob, node: Node, key: str) -> Any:
        allowed = "allowed: " + spec.describe()
        if spec.kind == "choice":
            choice = self.string(node, key, allowed)
            if choice not in spec.choices:
                raise self.fail(node, key, f"unknown value {choice!r}", allowed)
            return choice
        if spec.kind == "bool":
            return self.boolean(node, key, allowed)
        try:
            number = self.number(node, key, integer=spec.kind == "int", expected=spec.describe())
        except PolicyError as e:
            raise PolicyError(e.problem, e.source, e.line, e.key, allowed) from None
        if spec.minimum is not None and (number <= spec.minimum if spec.exclusive else number < spec.minimum):
            raise self.fail(node, key, f"value {node.value} is out of range", allowed)
        return number

    def rule(self, node: Node, i: int, default: str, global_knobs: _FrozenDict) -> Rule:
        key = f"rules[{i}]"
        items = {k: (kn, vn) for k, kn, vn in self.mapping(node, key, "a rule (a mapping)", _RULE_KEYS)}
        if "use" not in items and "knobs" not in items:
            raise self.fail(node, key, "the rule sets neither 'use' nor 'knobs'",
                            "add 'use: <algorithm|auto>' or 'knobs: {...}'")
        name = None
        if "name" in items:
            name = self.string(items["name"][1], f"{key}.name", "allowed: a label such as 'big-embeddings'")
        use = default
        if "use" in items:
            use = self.algorithm(items["use"][1], f"{key}.use", allow_auto=True)
        when: dict[str, Any] = {}
        if "when" in items and not self.is_null(items["when"][1]):
            when = self.when(items["when"][1], f"{key}.when")
        rule_knobs: dict[str, dict[str, Any]] = {}
        if "knobs" in items:
            rule_knobs = self.knobs(items["knobs"][1], f"{key}.knobs", use)
        return Rule(
            index=i,
            name=name,
            line=_line(node),
            use=use,
            knobs=_freeze_knobs(rule_knobs),
            merged_knobs=_merge_knobs(global_knobs, rule_knobs),
            **when,
        )

    def when(self, node: Node, key: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, _knode, vnode in self.mapping(node, key, "a mapping of conditions", _WHEN_KEYS):
            path = f"{key}.{k}"
            if k == "tensor":
                out[k] = self.globs(vnode, path)
            elif k == "dtype":
                out[k] = self.dtypes(vnode, path)
            elif k == "backend":
                out[k] = self.backends(vnode, path)
            elif k == "numel":
                out[k] = self.range(vnode, path, integer=True, lo=0, hi=None, what="an integer >= 0")
            elif k == "world_size":
                out[k] = self.range(vnode, path, integer=True, lo=1, hi=None, what="an integer >= 1")
            else:  # density, overlap
                out[k] = self.range(vnode, path, integer=False, lo=0.0, hi=1.0, what="a number in [0, 1]")
        return out

    def string_list(self, node: Node, key: str, allowed: str) -> list[tuple[str, Node]]:
        """Accept one string or a non-empty list of strings."""
        if isinstance(node, SequenceNode):
            if not node.value:
                raise self.fail(node, key, "empty list (the rule could never match)", allowed)
            return [(self.string(n, f"{key}[{j}]", allowed), n) for j, n in enumerate(node.value)]
        return [(self.string(node, key, allowed), node)]

    def globs(self, node: Node, key: str) -> tuple[str, ...]:
        allowed = "allowed: a glob such as 'embed*' or a list of globs"
        out = []
        for g, n in self.string_list(node, key, allowed):
            if not g:
                raise self.fail(n, key, "empty glob", allowed)
            out.append(g)
        return tuple(dict.fromkeys(out))

    def backends(self, node: Node, key: str) -> tuple[str, ...]:
        allowed = "allowed: a backend name such as gloo or nccl, or a list of them"
        out = []
        for b, n in self.string_list(node, key, allowed):
            if not b.strip() or not b.strip().replace("_", "").replace(":", "").replace(",", "").isalnum():
                raise self.fail(n, key, f"invalid backend name {b!r}", allowed)
            out.append(b.strip().lower())
        return tuple(dict.fromkeys(out))

    def dtypes(self, node: Node, key: str) -> tuple[str, ...]:
        allowed = "allowed: " + ", ".join(DTYPES)
        out = set()
        for d, n in self.string_list(node, key, allowed):
            canon = _dtype_name(d)
            if canon not in DTYPES:
                raise self.fail(n, key, f"unknown dtype {d!r}", allowed)
            out.add(canon)
        return tuple(sorted(out))

    def range(
        self, node: Node, key: str, *, integer: bool, lo: float, hi: float | None, what: str
    ) -> Range:
        allowed = f"allowed: [min, max] of {what}, with min <= max and null for an open end"
        if integer and isinstance(node, ScalarNode) and node.tag in (_T + "int", _T + "float"):
            v = self.number(node, key, integer=True, expected=what)
            self.bounds_check(node, key, v, lo, hi, allowed)
            return (v, v)
        if not isinstance(node, SequenceNode):
            scalar_ok = " or a single integer" if integer else ""
            raise self.fail(node, key, f"expected a [min, max] range{scalar_ok}, got {_describe(node)}", allowed)
        if len(node.value) != 2:
            raise self.fail(node, key, f"a range needs exactly 2 items, got {len(node.value)}: {_flow(node.value)}",
                            allowed)
        ends: list[Any] = []
        for j, n in enumerate(node.value):
            if self.is_null(n):
                ends.append(None)
                continue
            try:
                v = self.number(n, key, integer=integer, expected=what)
            except PolicyError as e:
                raise PolicyError(e.problem, e.source, e.line, e.key, allowed) from None
            self.bounds_check(n, key, v, lo, hi, allowed)
            ends.append(v)
        if ends[0] is not None and ends[1] is not None and ends[0] > ends[1]:
            raise self.fail(node, key, f"inverted range {_flow(node.value)}: min {node.value[0].value} "
                            f"is greater than max {node.value[1].value}", allowed)
        return (ends[0], ends[1])

    def bounds_check(self, node: Node, key: str, v: float, lo: float, hi: float | None, allowed: str) -> None:
        if v < lo or (hi is not None and v > hi):
            raise self.fail(node, key, f"value {node.value} is out of range", allowed)


# --------------------------------------------------------------------------- public entry points


def parse_policy(text: str, source: str = "<string>", *, base_dir: str | os.PathLike[str] | None = None) -> Policy:
    """Parse and validate policy text.

    Args:
        text: the YAML text.
        source: name used in messages and :attr:`Policy.source`.
        base_dir: directory against which a relative ``profile`` resolves;
            ``None`` leaves it relative (to the working directory).

    Returns:
        The validated :class:`Policy`.

    Raises:
        PolicyError: on a YAML syntax error, any schema violation, or text
            over the limits of :mod:`colltune.model.yamlsafe`, naming the source, the
            line, the key and what is allowed.
    """
    if not isinstance(text, str):
        raise PolicyError(f"policy text must be a str, got {type(text).__name__}", source, None, None,
                          "decode bytes first, or use load_policy(path)")
    try:
        yamlsafe.check_text(text)
    except yamlsafe.YamlLimitError as e:
        raise PolicyError(f"the policy text is too large: {e.problem}", source, None, None, e.fix) from None
    policy = _Parser(text, source, None if base_dir is None else Path(base_dir)).parse()
    logger.debug("loaded policy %s: %d rules, default %s, digest %016x",
                 source, len(policy.rules), policy.default, policy.digest & 0xFFFFFFFFFFFFFFFF)
    return policy


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Read, parse and validate a policy file.

    Args:
        path: the policy file. A relative ``profile`` inside it resolves
            against this file's directory.

    Returns:
        The validated :class:`Policy`, with :attr:`Policy.source` set to
        ``path`` as given.

    Raises:
        PolicyError: if the file cannot be read, is over 16 MiB or is invalid.

    Example:
        >>> policy = load_policy("profiles/policies/example.yaml")  # doctest: +SKIP
    """
    source = os.fspath(path)
    try:
        # Read as bytes within the size limit; no newline translation is needed,
        # as YAML reads \r\n and \r as line breaks itself.
        text = yamlsafe.read_bytes(source).decode("utf-8")
    except OSError as e:
        raise PolicyError(f"cannot read the policy file: {e.strerror or e}", source, None, None,
                          "allowed: a path to a readable policy YAML file") from None
    except yamlsafe.YamlLimitError as e:
        raise PolicyError(f"the policy file is too large: {e.problem}", source, None, None, e.fix) from None
    except UnicodeDecodeError as e:
        raise PolicyError(f"the policy file is not UTF-8 text ({e.reason})", source, None, None,
                          "save it as UTF-8") from None
    return parse_policy(text, source, base_dir=Path(source).parent)


#: The policy used when there is no file: no rules, everything ``auto``.
DEFAULT_POLICY: Policy = parse_policy("version: 1\n", source="<default>")


@dataclass(frozen=True)
class Overrides:
    """What the environment says, read by :func:`policy_from_env`.

    Attributes:
        algorithm: ``COLLTUNE_ALGO``: a forced algorithm or ``auto``; ``None``
            when unset.
        policy_path: ``COLLTUNE_POLICY``, or ``None``.
        profile_path: ``COLLTUNE_PROFILE``, or ``None``.
        log_level: ``COLLTUNE_DEBUG`` as a :mod:`logging` level, or ``None``
            when off.
        log_file: ``COLLTUNE_LOG_FILE`` as written (with ``%h``/``%p``/``%r``),
            or ``None``.
    """

    algorithm: str | None = None
    policy_path: str | None = None
    log_level: int | None = None
    log_file: str | None = None
    profile_path: str | None = None

    @property
    def log_decisions(self) -> bool:
        """Return whether decisions should be logged at all."""
        return self.log_level is not None or self.log_file is not None

    @property
    def digest(self) -> int:
        """Return a signed 64-bit hash of what must agree across ranks (the forced algorithm)."""
        return _digest({"algorithm": self.algorithm})

    def apply(self, decision: Decision) -> Decision:
        """Return ``decision`` with ``COLLTUNE_ALGO`` applied (unchanged when unset).

        The rule and its knobs are kept, so knobs set by the policy still
        reach the forced algorithm.
        """
        if self.algorithm is None:
            return decision
        return Decision(
            self.algorithm,
            decision.rule_index,
            decision.rule_name,
            decision.knobs,
            f"{ENV_ALGO}={self.algorithm} overrides {decision.algorithm!r} from {decision.reason}",
            forced=True,
        )

    def log_file_for(self, rank: int | None = None) -> str | None:
        """Return ``log_file`` with ``%h`` (host), ``%p`` (pid), ``%r`` (rank) and ``%%`` expanded."""
        if self.log_file is None:
            return None
        subs = {"h": socket.gethostname(), "p": str(os.getpid()), "r": "" if rank is None else str(rank), "%": "%"}
        return re.sub(r"%([hpr%])", lambda m: subs[m.group(1)], self.log_file)


def _env(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def policy_from_env(environ: Mapping[str, str] = os.environ) -> tuple[Policy | None, Overrides]:
    """Read the ``COLLTUNE_*`` environment variables (see the module docstring).

    Args:
        environ: the environment to read (``os.environ`` by default).

    Returns:
        ``(policy, overrides)``: the policy named by ``COLLTUNE_POLICY``
        (``None`` when unset; use :data:`DEFAULT_POLICY` then) and the
        :class:`Overrides`. Apply ``overrides.apply(policy.match(...))``.

    Raises:
        PolicyError: naming the variable and the allowed values when one is
            invalid, or the file and line when the policy file is.
    """
    algorithm = _env(environ, ENV_ALGO)
    if algorithm is not None:
        algorithm = algorithm.lower()
        names = (AUTO,) + known_algorithms()
        if algorithm not in names:
            raise PolicyError(f"unknown algorithm {environ[ENV_ALGO]!r}", "environment", None, ENV_ALGO,
                              "allowed: " + ", ".join(names) + ", or unset it")

    raw_debug = environ.get(ENV_DEBUG, "")
    level_key = raw_debug.strip().lower()
    if level_key not in _DEBUG_LEVELS:
        # A logging setting never stops a job (NCCL_DEBUG does not either): say so, and log in full.
        warnings.warn(f"{ENV_DEBUG}={raw_debug!r} is not a level (allowed: off, warn, info, debug, trace, or "
                      "0, 1, 2); logging decisions at debug", stacklevel=2)
        level_key = "debug"
    log_level = _DEBUG_LEVELS[level_key]

    log_file = _env(environ, ENV_LOG_FILE)
    policy_path = _env(environ, ENV_POLICY)
    policy = None
    if policy_path is not None:
        if not os.path.isfile(policy_path):
            raise PolicyError(f"policy file {policy_path!r} not found", "environment", None, ENV_POLICY,
                              "allowed: a path to a readable policy YAML file, or unset it")
        policy = load_policy(policy_path)
    profile_path = _env(environ, ENV_PROFILE)
    if profile_path is not None and not os.path.isfile(profile_path):
        raise PolicyError(f"profile file {profile_path!r} not found", "environment", None, ENV_PROFILE,
                          "allowed: a path to a profile YAML file written by colltune profile, or unset it")
    overrides = Overrides(algorithm, policy_path, log_level, log_file, profile_path)
    if overrides.log_decisions or algorithm is not None:
        logger.debug("environment overrides: %s", overrides)
    return policy, overrides


def config_digest(policy: Policy | None, overrides: Overrides | None = None) -> int:
    """Return one signed 64-bit hash of the policy and the forced algorithm.

    Ranks whose digests differ would decide differently and deadlock; compare
    this number across ranks (it fits an int64) before the first call.
    """
    return _digest({
        "policy": (policy or DEFAULT_POLICY).digest,
        "overrides": (overrides or Overrides()).digest,
    })
