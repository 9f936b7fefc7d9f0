"""Tests of colltune.model.policy: parsing, matching, errors, digests, environment (no process group)."""

from __future__ import annotations

import ast
import logging
import pickle
import textwrap
from pathlib import Path
from typing import Any

import pytest

from colltune import algorithms
from colltune.algorithms.errors import ColltuneError, ColltuneValueError
from colltune.algorithms.registry import BUILTIN_NAMES
from colltune.model import policy as P
from colltune.model.policy import (
    DEFAULT_POLICY,
    Overrides,
    Policy,
    PolicyError,
    config_digest,
    knob_table,
    known_algorithms,
    load_policy,
    parse_policy,
    policy_from_env,
)

POLICY_DIR = Path(__file__).resolve().parents[2] / "profiles" / "policies"
#: The registered algorithms as the error messages list them, in registry order.
LISTED = ", ".join(algorithms.names())


def parse(text: str, source: str = "t.yaml") -> Policy:
    return parse_policy(textwrap.dedent(text), source)


def error(text: str, source: str = "t.yaml") -> PolicyError:
    with pytest.raises(PolicyError) as info:
        parse(text, source)
    return info.value


FULL = """\
version: 1
profile: cpu-gloo.yaml
default: dense
knobs:
  oktopk: {boundary_refresh: 64, peers_in_flight: 4, dense_fallback_ratio: 1.0}
  allgather: {mode: auto}
rules:
  - name: big-embeddings
    when:
      tensor: "embed*"
      numel: [1000000, null]
      density: [0.0, 0.01]
      world_size: [8, null]
      overlap: [0.5, 1.0]
      dtype: [float16, bfloat16]
    use: oktopk
    knobs: {oktopk: {peers_in_flight: 8}}
  - when: {numel: [null, 4096]}
    use: allgather
  - name: catch-all
    use: auto
"""


# --------------------------------------------------------------------------- parsing


def test_parse_full_policy() -> None:
    p = parse(FULL)
    assert p.version == 1
    assert p.default == "dense"
    assert p.profile == "cpu-gloo.yaml"
    assert p.source == "t.yaml"
    assert [r.name for r in p.rules] == ["big-embeddings", None, "catch-all"]
    assert [r.line for r in p.rules] == [8, 18, 20]
    r0 = p.rules[0]
    assert r0.tensor == ("embed*",)
    assert r0.numel == (1000000, None)
    assert r0.density == (0.0, 0.01)
    assert r0.world_size == (8, None)
    assert r0.overlap == (0.5, 1.0)
    assert r0.dtype == ("bfloat16", "float16")
    assert r0.use == "oktopk"
    assert dict(r0.knobs) == {"oktopk": {"peers_in_flight": 8}}
    assert r0.merged_knobs["oktopk"] == {"boundary_refresh": 64, "peers_in_flight": 8, "dense_fallback_ratio": 1.0}
    assert p.knobs["allgather"] == {"mode": "auto"}
    assert p.algorithms_used == {"dense", "oktopk", "allgather", "auto"}


def test_minimal_policy_defaults_to_auto() -> None:
    p = parse("version: 1\n")
    assert p.default == "auto" and p.rules == () and dict(p.knobs) == {} and p.profile is None
    assert p.match(None, 10, 0.5, 2, None, "float32").algorithm == "auto"
    assert DEFAULT_POLICY.default == "auto" and DEFAULT_POLICY.rules == ()


def test_null_containers_mean_empty() -> None:
    p = parse("version: 1\nknobs:\nrules:\n  - when:\n    use: dense\n    knobs: {dense: }\n")
    assert dict(p.knobs) == {}
    assert p.rules[0].when() == {}
    assert p.match("x", 1, 0.0, 1, 0.0, "float32").algorithm == "dense"


def test_numbers_scalars_and_aliases_are_normalized() -> None:
    p = parse(
        """\
        version: 1
        rules:
          - when: {numel: [1e6, 2.0e6], world_size: 4, density: [0, 1], dtype: [half, torch.bfloat16, fp16]}
            use: dense
          - when: {dtype: float}
            use: allgather
        """
    )
    r = p.rules[0]
    assert r.numel == (1000000, 2000000) and all(type(v) is int for v in r.numel)
    assert r.world_size == (4, 4)
    assert r.density == (0.0, 1.0) and all(type(v) is float for v in r.density)
    assert r.dtype == ("bfloat16", "float16")
    assert p.rules[1].dtype == ("float32",)


def test_tensor_glob_list_and_case_sensitivity() -> None:
    p = parse(
        """\
        version: 1
        rules:
          - when: {tensor: ["embed*", "*.emb.weight"]}
            use: oktopk
        """
    )
    m = lambda name: p.match(name, 10, 0.1, 2, 0.0, "float32").rule_index  # noqa: E731
    assert m("embed_user") == 0
    assert m("model.emb.weight") == 0
    assert m("Embed_user") is None  # globs are case-sensitive on every platform
    assert m(None) is None


def test_profile_resolves_against_policy_directory(tmp_path: Path) -> None:
    f = tmp_path / "sub" / "pol.yaml"
    f.parent.mkdir()
    f.write_text("version: 1\nprofile: ../prof.yaml\n")
    p = load_policy(f)
    assert p.profile == "../prof.yaml"
    assert p.profile_path == f.parent / "../prof.yaml"
    f.write_text(f"version: 1\nprofile: {tmp_path / 'abs.yaml'}\n")
    assert load_policy(f).profile_path == tmp_path / "abs.yaml"
    assert parse("version: 1\nprofile: rel.yaml\n").profile_path == Path("rel.yaml")


def test_merge_keys_and_anchors_work() -> None:
    p = parse(
        """\
        version: 1
        rules:
          - name: a
            when: &big {numel: [1000, null], world_size: [4, null]}
            use: oktopk
          - name: b
            when:
              <<: *big
              dtype: float16
            use: dense
        """
    )
    assert p.rules[1].numel == (1000, None) and p.rules[1].world_size == (4, None)
    assert p.rules[1].dtype == ("float16",)


# --------------------------------------------------------------------------- matching


def test_first_match_wins() -> None:
    p = parse(FULL)
    hit = p.match("embed_user", 2_000_000, 0.001, 8, 0.7, "float16")
    assert (hit.algorithm, hit.rule_index, hit.rule_name) == ("oktopk", 0, "big-embeddings")
    assert hit.knobs_for("oktopk") == {"boundary_refresh": 64, "peers_in_flight": 8, "dense_fallback_ratio": 1.0}
    small = p.match("embed_user", 100, 0.001, 8, 0.7, "float16")
    assert (small.algorithm, small.rule_index, small.rule_name) == ("allgather", 1, None)
    rest = p.match("fc.weight", 2_000_000, 0.001, 8, 0.7, "float16")
    assert (rest.algorithm, rest.rule_index, rest.rule_name) == ("auto", 2, "catch-all")
    assert rest.knobs_for("oktopk")["peers_in_flight"] == 4
    assert rest.knobs_for("dense") == {}


def test_default_when_nothing_matches() -> None:
    p = parse("version: 1\ndefault: allgather\nknobs: {allgather: {mode: pad}}\nrules:\n  - {when: {world_size: 2}, use: dense}\n")
    d = p.match("x", 10, 0.1, 4, 0.0, "float32")
    assert (d.algorithm, d.rule_index, d.rule_name) == ("allgather", None, None)
    assert d.knobs_for("allgather") == {"mode": "pad"}
    assert "default" in d.reason
    assert p.match("x", 10, 0.1, 2, 0.0, "float32").algorithm == "dense"


@pytest.mark.parametrize(
    ("cond", "value", "inside"),
    [
        ("numel: [10, 20]", 10, True),
        ("numel: [10, 20]", 20, True),
        ("numel: [10, 20]", 21, False),
        ("numel: [10, 20]", 9, False),
        ("density: [0.0, 0.01]", 0.01, True),
        ("density: [0.0, 0.01]", 0.0100001, False),
        ("world_size: [8, null]", 1024, True),
        ("world_size: [8, null]", 7, False),
        ("overlap: [null, 0.5]", 0.0, True),
    ],
)
def test_ranges_are_inclusive(cond: str, value: float, inside: bool) -> None:
    p = parse(f"version: 1\nrules:\n  - when: {{{cond}}}\n    use: dense\n")
    key = cond.split(":")[0]
    args: dict[str, Any] = {"name": "x", "numel": 15, "density": 0.005, "world_size": 8, "overlap": 0.3, "dtype": "float32"}
    args[key] = value
    assert (p.match(**args).rule_index == 0) is inside


@pytest.mark.parametrize("key", ["numel", "density", "world_size", "overlap", "dtype", "tensor"])
def test_unknown_condition_does_not_match_a_rule_that_constrains_it(key: str) -> None:
    when = {
        "numel": "numel: [null, null]",
        "density": "density: [null, null]",
        "world_size": "world_size: [null, null]",
        "overlap": "overlap: [null, null]",
        "dtype": "dtype: [float32]",
        "tensor": "tensor: '*'",
    }[key]
    p = parse(f"version: 1\nrules:\n  - when: {{{when}}}\n    use: dense\n  - use: allgather\n")
    args: dict[str, Any] = {"name": "x", "numel": 15, "density": 0.005, "world_size": 8, "overlap": 0.3, "dtype": "float32"}
    assert p.match(**args).algorithm == "dense"
    args["name" if key == "tensor" else key] = None
    assert p.match(**args).algorithm == "allgather"
    if key in ("density", "overlap"):
        args[key] = float("nan")
        assert p.match(**args).algorithm == "allgather"


def test_unconstrained_unknowns_still_match() -> None:
    p = parse("version: 1\nrules:\n  - when: {numel: [0, 100]}\n    use: dense\n")
    assert p.match(None, 50, None, None, None, None).algorithm == "dense"


def test_dtype_accepts_torch_dtype_objects() -> None:
    torch = pytest.importorskip("torch")
    p = parse("version: 1\nrules:\n  - {when: {dtype: bfloat16}, use: dense}\n")
    assert p.match("x", 1, 0.1, 2, 0.0, torch.bfloat16).algorithm == "dense"
    assert p.match("x", 1, 0.1, 2, 0.0, torch.float32).algorithm == "auto"


def test_decisions_are_shared_and_read_only() -> None:
    p = parse(FULL)
    d1 = p.match("embed", 2_000_000, 0.001, 8, 0.7, "float16")
    d2 = p.match("embed", 3_000_000, 0.002, 16, 0.9, "bfloat16")
    assert d1 is d2
    with pytest.raises(TypeError):
        d1.knobs["oktopk"]["peers_in_flight"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        d1.knobs["dense"] = {}  # type: ignore[index]
    copy = d1.knobs_for("oktopk")
    copy["peers_in_flight"] = 1
    assert d1.knobs["oktopk"]["peers_in_flight"] == 8


def test_policy_and_decision_pickle_and_hash() -> None:
    p = parse(FULL)
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.digest == p.digest and hash(q) == hash(p)
    d = p.match("embed", 2_000_000, 0.001, 8, 0.7, "float16")
    e = pickle.loads(pickle.dumps(d))
    assert e == d and e.knobs_for("oktopk") == d.knobs_for("oktopk")
    assert q.match("embed", 2_000_000, 0.001, 8, 0.7, "float16") == d


def test_decision_as_dict_is_json_ready() -> None:
    import json

    d = parse(FULL).match("embed", 2_000_000, 0.001, 8, 0.7, "float16")
    row = json.loads(json.dumps(d.as_dict()))
    assert row["algorithm"] == "oktopk" and row["rule_name"] == "big-embeddings" and row["forced"] is False
    assert row["knobs"]["oktopk"]["peers_in_flight"] == 8


def test_bool_knob_round_trips_and_is_applied() -> None:
    import yaml

    from colltune.select.selector import _knobs_for

    p = parse(
        """\
        version: 1
        knobs:
          oktopk: {balance: false, peers_in_flight: 2}
        rules:
          - name: balanced
            when: {numel: [1000000, null]}
            use: oktopk
            knobs: {oktopk: {balance: True}}
        """
    )
    assert p.knobs["oktopk"] == {"balance": False, "peers_in_flight": 2}
    assert p.knobs["oktopk"]["balance"] is False and p.rules[0].merged_knobs["oktopk"]["balance"] is True
    # Written back as YAML (as ``colltune tune`` does), it loads as the same policy.
    again = parse_policy(yaml.safe_dump({"version": 1, "knobs": p.as_dict()["knobs"], "rules": [
        {"name": "balanced", "when": {"numel": [1000000, None]}, "use": "oktopk", "knobs": {"oktopk": {"balance": True}}}
    ]}))
    assert again == p and again.digest == p.digest
    assert pickle.loads(pickle.dumps(p)) == p
    assert parse("version: 1\nknobs: {oktopk: {balance: true}}\n").digest != parse(
        "version: 1\nknobs: {oktopk: {balance: false}}\n").digest
    # The decision hands the knob to the algorithm, which takes it.
    okt = algorithms.get("oktopk")
    small, big = p.match("w", 10, 0.5, 4, None, "float32"), p.match("w", 2_000_000, 0.5, 4, None, "float32")
    assert _knobs_for(small, "oktopk") == {"balance": False, "peers_in_flight": 2}
    assert okt.check_knobs(_knobs_for(small, "oktopk"))["balance"] is False
    assert okt.check_knobs(_knobs_for(big, "oktopk"))["balance"] is True
    assert okt.check_knobs({})["balance"] is True  # the default is untouched


def test_every_choice_an_algorithm_takes_is_a_valid_policy_value() -> None:
    # The policy's choices come from the algorithms: a mode the algorithm takes (p2p) is not refused here.
    pairs = [(algo, knob) for algo in algorithms.names() for knob in algorithms.get(algo).knob_choices]
    assert pairs, "no registered algorithm has a choice knob"
    for algo, knob in pairs:
        for value in algorithms.get(algo).knob_choices[knob]:
            p = parse(f"version: 1\nknobs:\n  {algo}: {{{knob}: {value}}}\n")
            assert p.knobs[algo][knob] == value
            assert algorithms.get(algo).check_knobs(p.knobs[algo])[knob] == value


# --------------------------------------------------------------------------- errors


BAD = [
    # (id, text, line, key, fragments)
    ("syntax", "version: 1\nrules:\n  - use: dense\n   when: {}\n", 4, None, ["YAML syntax error"]),
    ("syntax-flow", "version: 1\nrules: [\n", 3, None, ["YAML syntax error"]),
    ("tab", "version: 1\nrules:\n\t- use: dense\n", 3, None, ["YAML syntax error"]),
    ("unknown-top-key", "version: 1\nrulez: []\n", 2, None, ["unknown key 'rulez'", "allowed keys: version, profile, default, knobs, rules"]),
    ("unknown-rule-key", "version: 1\nrules:\n  - use: dense\n    wen: {}\n", 4, "rules[0]", ["unknown key 'wen'", "allowed keys: name, when, use, knobs"]),
    (
        "unknown-when-key",
        "version: 1\nrules:\n  - use: dense\n    when:\n      numel: [1, 2]\n      numell: [1, 2]\n",
        6,
        "rules[0].when",
        ["unknown key 'numell'", "allowed keys: tensor, numel, density, world_size, overlap, dtype"],
    ),
    ("unknown-algorithm", "version: 1\nrules:\n  - when: {}\n    use: ring\n", 4, "rules[0].use", ["unknown algorithm 'ring'", f"allowed: auto, {LISTED}"]),
    ("unknown-default", "version: 1\ndefault: nccl\n", 2, "default", ["unknown algorithm 'nccl'", f"allowed: auto, {LISTED}"]),
    ("unknown-knob-algorithm", "version: 1\nknobs:\n  topk: {}\n", 3, "knobs", ["unknown algorithm 'topk'", f"allowed: {LISTED}"]),
    ("wrong-type-numel", "version: 1\nrules:\n  - use: dense\n    when:\n      numel: big\n", 5, "rules[0].when.numel", ["expected a [min, max] range or a single integer", "string 'big'"]),
    ("wrong-type-range-item", "version: 1\nrules:\n  - use: dense\n    when:\n      numel: [1, \"2\"]\n", 5, "rules[0].when.numel", ["expected an integer >= 0", "string '2'"]),
    ("bool-is-not-int", "version: 1\nrules:\n  - use: dense\n    when: {world_size: [true, null]}\n", 4, "rules[0].when.world_size", ["boolean 'true'"]),
    ("bool-knob", "version: 1\nknobs:\n  oktopk:\n    peers_in_flight: yes\n", 4, "knobs.oktopk.peers_in_flight", ["boolean 'yes'", "allowed: an integer >= 1"]),
    ("float-for-int", "version: 1\nrules:\n  - use: dense\n    when: {numel: [1.5, null]}\n", 4, "rules[0].when.numel", ["float '1.5'"]),
    ("inverted", "version: 1\nrules:\n  - use: dense\n    when:\n      numel: [10, 5]\n", 5, "rules[0].when.numel", ["inverted range [10, 5]", "min <= max"]),
    ("inverted-density", "version: 1\nrules:\n  - use: dense\n    when:\n      density: [0.5, 0.1]\n", 5, "rules[0].when.density", ["inverted range"]),
    ("range-length", "version: 1\nrules:\n  - use: dense\n    when:\n      numel: [1, 2, 3]\n", 5, "rules[0].when.numel", ["exactly 2 items, got 3"]),
    ("range-length-1", "version: 1\nrules:\n  - use: dense\n    when:\n      overlap: [0.5]\n", 5, "rules[0].when.overlap", ["exactly 2 items, got 1"]),
    ("density-scalar", "version: 1\nrules:\n  - use: dense\n    when:\n      density: 0.5\n", 5, "rules[0].when.density", ["expected a [min, max] range, got float"]),
    ("version-missing", "default: auto\n", 1, None, ["missing required key 'version'"]),
    ("version-unsupported", "version: 2\n", 1, "version", ["unsupported version 2", "allowed: 1"]),
    ("version-type", "version: one\n", 1, "version", ["expected an integer", "allowed: 1"]),
    ("negative-numel", "version: 1\nrules:\n  - use: dense\n    when:\n      numel: [-1, null]\n", 5, "rules[0].when.numel", ["value -1 is out of range", "integer >= 0"]),
    ("world-size-zero", "version: 1\nrules:\n  - use: dense\n    when:\n      world_size: 0\n", 5, "rules[0].when.world_size", ["out of range", "integer >= 1"]),
    ("density-above-1", "version: 1\nrules:\n  - use: dense\n    when:\n      density: [0.0, 1.5]\n", 5, "rules[0].when.density", ["value 1.5 is out of range", "number in [0, 1]"]),
    ("overlap-below-0", "version: 1\nrules:\n  - use: dense\n    when:\n      overlap: [-0.1, null]\n", 5, "rules[0].when.overlap", ["out of range"]),
    ("density-inf", "version: 1\nrules:\n  - use: dense\n    when:\n      density: [0, .inf]\n", 5, "rules[0].when.density", [".inf"]),
    ("unknown-dtype", "version: 1\nrules:\n  - use: dense\n    when:\n      dtype: [float16, int8]\n", 5, "rules[0].when.dtype", ["unknown dtype 'int8'", "allowed: float32, float64, float16, bfloat16"]),
    ("empty-dtype", "version: 1\nrules:\n  - use: dense\n    when:\n      dtype: []\n", 5, "rules[0].when.dtype", ["empty list"]),
    ("tensor-type", "version: 1\nrules:\n  - use: dense\n    when:\n      tensor: 5\n", 5, "rules[0].when.tensor", ["expected a string, got integer '5'"]),
    ("unknown-knob", "version: 1\nknobs:\n  oktopk:\n    boundary_refresh: 64\n    peers: 4\n", 5, "knobs.oktopk", ["unknown knob 'peers' for 'oktopk'", "allowed knobs: boundary_refresh, peers_in_flight"]),
    ("dense-unknown-knob", "version: 1\nknobs:\n  dense: {bucket: 1}\n", 3, "knobs.dense", ["unknown knob 'bucket'", "allowed knobs: wire"]),
    ("dense-wire-choice", "version: 1\nknobs:\n  dense: {wire: bf16}\n", 3, "knobs.dense.wire", ["unknown value 'bf16'", "allowed: one of accum, value"]),
    ("knob-below-min", "version: 1\nknobs:\n  oktopk: {boundary_refresh: 0}\n", 3, "knobs.oktopk.boundary_refresh", ["out of range", "allowed: an integer >= 1"]),
    ("knob-ratio-zero", "version: 1\nknobs:\n  oktopk: {dense_fallback_ratio: 0}\n", 3, "knobs.oktopk.dense_fallback_ratio", ["out of range", "a number > 0"]),
    ("knob-choice", "version: 1\nknobs:\n  allgather: {mode: ring}\n", 3, "knobs.allgather.mode", ["unknown value 'ring'", "allowed: one of auto, p2p, pad, alltoall"]),
    ("knob-choice-type", "version: 1\nknobs:\n  allgather: {mode: 3}\n", 3, "knobs.allgather.mode", ["expected a string"]),
    ("bool-knob-int", "version: 1\nknobs:\n  oktopk: {balance: 3}\n", 3, "knobs.oktopk.balance", ["expected true or false, got integer '3'", "allowed: true or false"]),
    ("bool-knob-one", "version: 1\nknobs:\n  oktopk: {balance: 1}\n", 3, "knobs.oktopk.balance", ["got integer '1'", "allowed: true or false"]),
    ("bool-knob-string", "version: 1\nknobs:\n  oktopk: {balance: \"yes\"}\n", 3, "knobs.oktopk.balance", ["got string 'yes'", "allowed: true or false"]),
    ("bool-knob-quoted-true", "version: 1\nknobs:\n  oktopk: {balance: 'true'}\n", 3, "knobs.oktopk.balance", ["got string 'true'", "allowed: true or false"]),
    ("bool-knob-yaml11-yes", "version: 1\nknobs:\n  oktopk:\n    balance: yes\n", 4, "knobs.oktopk.balance", ["got 'yes' (a YAML 1.1 spelling)", "allowed: true or false"]),
    ("bool-knob-yaml11-off", "version: 1\nknobs:\n  oktopk: {balance: off}\n", 3, "knobs.oktopk.balance", ["got 'off'", "allowed: true or false"]),
    ("bool-knob-null", "version: 1\nknobs:\n  oktopk: {balance: null}\n", 3, "knobs.oktopk.balance", ["got null", "allowed: true or false"]),
    ("bool-knob-in-rule", "version: 1\nrules:\n  - use: oktopk\n    knobs: {oktopk: {balance: 0}}\n", 4, "rules[0].knobs.oktopk.balance", ["got integer '0'", "allowed: true or false"]),
    ("true-for-int-knob", "version: 1\nknobs:\n  oktopk: {boundary_refresh: true}\n", 3, "knobs.oktopk.boundary_refresh", ["boolean 'true'", "allowed: an integer >= 1"]),
    ("false-for-float-knob", "version: 1\nknobs:\n  oktopk: {dense_fallback_ratio: false}\n", 3, "knobs.oktopk.dense_fallback_ratio", ["boolean 'false'", "allowed: a number > 0"]),
    ("bool-for-choice-knob", "version: 1\nknobs:\n  allgather: {mode: true}\n", 3, "knobs.allgather.mode", ["expected a string, got boolean 'true'"]),
    ("knobs-not-mapping", "version: 1\nknobs: [oktopk]\n", 2, "knobs", ["expected a mapping of algorithm names to knobs"]),
    (
        "knobs-for-other-algorithm",
        "version: 1\nrules:\n  - use: dense\n    knobs:\n      oktopk: {peers_in_flight: 2}\n",
        5,
        "rules[0].knobs",
        ["never apply because the rule uses 'dense'", "'use: auto'"],
    ),
    ("rules-not-list", "version: 1\nrules: {use: dense}\n", 2, "rules", ["expected a list of rules, got a mapping"]),
    ("rule-not-mapping", "version: 1\nrules:\n  - dense\n", 3, "rules[0]", ["expected a rule (a mapping), got string 'dense'"]),
    ("empty-rule", "version: 1\nrules:\n  - name: nothing\n", 3, "rules[0]", ["neither 'use' nor 'knobs'"]),
    ("duplicate-key", "version: 1\ndefault: auto\ndefault: dense\n", 3, None, ["duplicate key 'default' (first at line 2)"]),
    ("duplicate-rule-name", "version: 1\nrules:\n  - {name: a, use: dense}\n  - {name: a, use: oktopk}\n", 4, "rules[1].name", ["duplicate rule name 'a' (first at line 3)"]),
    ("python-tag", "version: 1\ndefault: !!python/object/apply:os.system [echo hi]\n", 2, "default", ["unsupported YAML tag '!!python/object/apply:os.system'", "plain data"]),
    ("custom-tag", "version: 1\nprofile: !env HOME\n", 2, "profile", ["unsupported YAML tag '!env'"]),
    ("nested-tag", "version: 1\nrules:\n  - use: dense\n    when: {tensor: [a, !!binary aGk=]}\n", 4, "rules[0].when.tensor[1]", ["'!!binary'"]),
    ("not-a-mapping", "- version: 1\n", 1, None, ["expected a mapping of policy keys, got a list"]),
    ("empty", "# nothing here\n", 1, None, ["the policy is empty"]),
    ("two-documents", "version: 1\n---\nversion: 1\n", 2, None, ["YAML syntax error", "another document"]),
    ("non-string-key", "version: 1\n1: 2\n", 2, None, ["keys must be strings"]),
]


@pytest.mark.parametrize(("text", "line", "key", "fragments"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_policy_names_file_line_key_and_allowed(text: str, line: int, key: str | None, fragments: list[str]) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "bad.yaml")
    e = info.value
    msg = str(e)
    assert e.source == "bad.yaml" and e.line == line and e.key == key, msg
    assert msg.startswith(f"bad.yaml:{line}: " + (f"{key}: " if key else "")), msg
    for frag in fragments:
        assert frag in msg, (frag, msg)
    assert isinstance(e, ColltuneValueError) and isinstance(e, ColltuneError) and isinstance(e, ValueError)


def test_message_format_matches_the_documented_example() -> None:
    text = "version: 1\n\nrules:\n  - name: x\n    use: dense\n    when:\n      numell: [1, 2]\n"
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "example.yaml")
    assert str(info.value) == (
        "example.yaml:7: rules[0].when: unknown key 'numell'; "
        "allowed keys: tensor, numel, density, world_size, overlap, dtype, backend"
    )


def test_python_tags_are_never_constructed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = f"version: 1\nrules:\n  - use: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(PolicyError):
        parse_policy(text)
    assert not marker.exists()


def test_policy_error_pickles() -> None:
    e = error("version: 1\ndefault: nope\n")
    f = pickle.loads(pickle.dumps(e))
    assert str(f) == str(e) and f.line == e.line == 2 and f.key == "default" and f.source == "t.yaml"


def test_load_policy_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="missing.yaml: cannot read the policy file"):
        load_policy(tmp_path / "missing.yaml")
    f = tmp_path / "bad.yaml"
    f.write_text("version: 1\nrules:\n  - use: ring\n")
    with pytest.raises(PolicyError) as info:
        load_policy(f)
    assert str(info.value).startswith(f"{f}:3: rules[0].use: unknown algorithm 'ring'")
    f.write_bytes(b"version: 1\n# \xff\xfe\n")
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(f)


def test_parse_policy_rejects_bytes() -> None:
    with pytest.raises(PolicyError, match="must be a str"):
        parse_policy(b"version: 1\n")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- digest


def test_digest_is_stable_under_reordering_whitespace_comments_and_spelling() -> None:
    a = parse(FULL)
    b = parse(
        """\
        # same policy, other order and style
        rules:
        - use: oktopk
          knobs:
            oktopk:
              peers_in_flight: 8
          when: {dtype: [bf16, half], overlap: [0.5, 1], world_size: [8, ~], density: [0, 0.01],
                 numel: [1.0e6, null], tensor: embed*}
          name: big-embeddings
        - {use: allgather, when: {numel: [~, 4096]}}
        - {use: auto, name: catch-all}
        knobs:
          allgather: {mode: auto}
          oktopk: {dense_fallback_ratio: 1, peers_in_flight: 4, boundary_refresh: 64}
        default:    dense
        profile: cpu-gloo.yaml
        version: 1
        """,
        source="other/place.yaml",
    )
    assert a.digest == b.digest
    assert a == b  # source is not compared
    assert a.as_dict() == b.as_dict()


def test_digest_is_a_signed_int64_independent_of_source() -> None:
    a = parse_policy(FULL, "a.yaml")
    b = parse_policy(FULL, "/somewhere/else/b.yaml", base_dir="/somewhere/else")
    assert a.digest == b.digest
    assert isinstance(a.digest, int) and -(2**63) <= a.digest < 2**63
    assert parse(FULL).digest == a.digest  # deterministic across parses


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("default: dense", "default: auto"),
        ("profile: cpu-gloo.yaml", "profile: gpu-nccl.yaml"),
        ("peers_in_flight: 8", "peers_in_flight: 9"),
        ("numel: [1000000, null]", "numel: [1000000, 2000000]"),
        ("dtype: [float16, bfloat16]", "dtype: [float16]"),
        ("name: catch-all", "name: rest"),
        ("tensor: \"embed*\"", "tensor: \"emb*\""),
        ("overlap: [0.5, 1.0]", "overlap: [0.5, 0.9]"),
    ],
)
def test_digest_changes_with_content(old: str, new: str) -> None:
    assert old in FULL
    assert parse(FULL).digest != parse(FULL.replace(old, new)).digest


def test_digest_depends_on_rule_order() -> None:
    one = "version: 1\nrules:\n  - {use: dense, when: {numel: 1}}\n  - {use: oktopk, when: {numel: 2}}\n"
    two = "version: 1\nrules:\n  - {use: oktopk, when: {numel: 2}}\n  - {use: dense, when: {numel: 1}}\n"
    assert parse(one).digest != parse(two).digest


def test_omitted_use_means_the_default() -> None:
    a = parse("version: 1\ndefault: dense\nrules:\n  - {when: {numel: 1}, knobs: {dense: {}}}\n")
    b = parse("version: 1\ndefault: dense\nrules:\n  - {when: {numel: 1}, use: dense, knobs: {dense: {}}}\n")
    assert a.rules[0].use == "dense" and a.digest == b.digest


# --------------------------------------------------------------------------- environment


def test_env_empty_gives_no_policy_and_no_overrides() -> None:
    policy, ov = policy_from_env({})
    assert policy is None
    assert ov == Overrides() and not ov.log_decisions and ov.algorithm is None
    d = DEFAULT_POLICY.match("x", 1, 0.1, 2, None, "float32")
    assert ov.apply(d) is d


def test_env_forces_an_algorithm() -> None:
    p = parse(FULL)
    _, ov = policy_from_env({"COLLTUNE_ALGO": " Dense "})
    assert ov.algorithm == "dense"
    d = p.match("embed", 2_000_000, 0.001, 8, 0.7, "float16")
    forced = ov.apply(d)
    assert forced.algorithm == "dense" and forced.forced
    assert forced.rule_index == 0 and forced.knobs == d.knobs
    assert "COLLTUNE_ALGO=dense" in forced.reason
    _, auto = policy_from_env({"COLLTUNE_ALGO": "auto"})
    assert auto.apply(d).algorithm == "auto"


def test_env_bad_algorithm_lists_allowed_values() -> None:
    with pytest.raises(PolicyError) as info:
        policy_from_env({"COLLTUNE_ALGO": "ring"})
    assert str(info.value) == (
        f"environment: COLLTUNE_ALGO: unknown algorithm 'ring'; allowed: auto, {LISTED}, or unset it"
    )


def test_env_chooses_a_policy(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(FULL)
    policy, ov = policy_from_env({"COLLTUNE_POLICY": str(f)})
    assert policy is not None and policy.digest == parse(FULL).digest and policy.source == str(f)
    assert ov.policy_path == str(f)
    with pytest.raises(PolicyError, match="COLLTUNE_POLICY: policy file .* not found"):
        policy_from_env({"COLLTUNE_POLICY": str(tmp_path / "nope.yaml")})
    f.write_text("version: 1\ndefault: ring\n")
    with pytest.raises(PolicyError, match=r"p\.yaml:2: default: unknown algorithm"):
        policy_from_env({"COLLTUNE_POLICY": str(f)})


@pytest.mark.parametrize(
    ("value", "level"),
    [("", None), ("0", None), ("OFF", None), ("warn", logging.WARNING), ("1", logging.INFO), ("INFO", logging.INFO),
     ("2", logging.DEBUG), ("debug", logging.DEBUG), ("trace", logging.DEBUG)],
)
def test_env_debug_levels(value: str, level: int | None) -> None:
    _, ov = policy_from_env({"COLLTUNE_DEBUG": value})
    assert ov.log_level == level and ov.log_decisions is (level is not None)


def test_env_bad_debug_level_warns_and_logs_in_full() -> None:
    with pytest.warns(UserWarning, match="COLLTUNE_DEBUG='loud' is not a level .*allowed: off, warn, info, debug"):
        _, ov = policy_from_env({"COLLTUNE_DEBUG": "loud"})
    assert ov.log_level == logging.DEBUG and ov.log_decisions


def test_env_log_file_expands_host_pid_rank() -> None:
    import os
    import socket

    _, ov = policy_from_env({"COLLTUNE_LOG_FILE": "dec-%h-%p-%r-%%.jsonl"})
    assert ov.log_decisions and ov.log_level is None
    assert ov.log_file_for(3) == f"dec-{socket.gethostname()}-{os.getpid()}-3-%.jsonl"
    assert Overrides().log_file_for(0) is None


def test_config_digest_covers_policy_and_forced_algorithm() -> None:
    p = parse(FULL)
    base = config_digest(p, Overrides())
    assert base == config_digest(p, None) == config_digest(parse(FULL), Overrides(log_level=logging.DEBUG))
    assert base != config_digest(p, Overrides(algorithm="dense"))
    assert base != config_digest(DEFAULT_POLICY, Overrides())
    assert config_digest(None) == config_digest(DEFAULT_POLICY)
    assert -(2**63) <= base < 2**63


# --------------------------------------------------------------------------- registry and shipped files


def test_known_algorithms_follow_the_registry() -> None:
    class Ring(algorithms.Dense):
        name = "ring"
        knob_specs = ()

    algorithms.register(Ring)
    try:
        assert known_algorithms() == (*BUILTIN_NAMES, "ring")
        p = parse("version: 1\ndefault: ring\n")
        assert p.default == "ring"
        with pytest.raises(PolicyError, match="none \\(ring has no knobs\\)"):
            parse("version: 1\nknobs: {ring: {x: 1}}\n")
    finally:
        algorithms.unregister("ring")
    assert known_algorithms() == BUILTIN_NAMES


def test_knob_table_covers_the_builtin_algorithms() -> None:
    knobs = knob_table()
    assert tuple(knobs) == algorithms.names() and set(BUILTIN_NAMES) <= set(knobs)
    # Every knob a policy may set is an algorithm knob or a top-k state knob,
    # and every algorithm knob is settable, with the kind of its default.
    kinds = {bool: "bool", int: "int", float: "float", str: "choice"}
    for name in algorithms.names():
        accepted = algorithms.get(name).knobs
        state = {k.name for k in algorithms.get(name).knob_specs if k.state}
        assert set(knobs[name]) - state == set(accepted), name
        for knob, default in accepted.items():
            assert knobs[name][knob].kind == kinds[type(default)], (name, knob)
    assert {k.name for k in algorithms.get("oktopk").knob_specs if k.state} == {"local_refresh", "global_refresh"}
    for specs in knobs.values():
        for spec in specs.values():
            assert spec.describe() and spec.help


@pytest.mark.parametrize("path", sorted(POLICY_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_policies_load(path: Path) -> None:
    p = load_policy(path)
    assert p.version == 1 and p.rules
    for r in p.rules:
        assert r.name, f"{path.name}: give every shipped rule a name"
    if p.profile is not None:
        assert p.profile_path is not None and p.profile_path.is_file(), p.profile_path


def test_shipped_examples_exist_and_decide_sensibly() -> None:
    names = {p.name for p in POLICY_DIR.glob("*.yaml")}
    assert {"example.yaml", "embeddings.yaml"} <= names
    ex = load_policy(POLICY_DIR / "example.yaml")
    assert ex.match("w", 100, 0.5, 4, None, "float32").rule_name == "tiny"
    big = ex.match("embed.user", 5_000_000, 0.001, 16, 0.1, "float32")
    assert big.algorithm == "oktopk" and big.knobs_for("oktopk")["peers_in_flight"] == 8
    # before overlap is measured, the overlap-constrained rule is skipped
    assert ex.match("embed.user", 5_000_000, 0.001, 16, None, "float32").rule_name != "big-embeddings"
    emb = load_policy(POLICY_DIR / "embeddings.yaml")
    assert emb.match("emb_l.0.weight", 10_000_000, 0.001, 8, 0.1, "float32").algorithm == "oktopk"
    assert emb.match("fc.weight", 10_000_000, 0.001, 8, 0.1, "float32").algorithm == "auto"


def test_module_stays_pure() -> None:
    tree = ast.parse(Path(P.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert not any(m == "torch" or m.startswith("torch.") for m in imported), imported
    assert not any(m.startswith("tuner.") for m in imported), imported


def test_env_chooses_a_profile(tmp_path: Path) -> None:
    from colltune.model.profile import load_profile
    from colltune.select.selector import Selector, shipped_profile

    nccl = shipped_profile("nccl")
    assert nccl is not None
    _, ov = policy_from_env({"COLLTUNE_PROFILE": str(nccl)})
    assert ov.profile_path == str(nccl)
    # it replaces the profile passed in code, on every backend
    sel = Selector(profile=shipped_profile("gloo"), environ={"COLLTUNE_PROFILE": str(nccl)})
    assert sel.profile("gloo").digest == load_profile(nccl).digest
    assert Selector(environ={}).profile("gloo").digest == load_profile(shipped_profile("gloo")).digest
    with pytest.raises(PolicyError, match="COLLTUNE_PROFILE: profile file .* not found"):
        policy_from_env({"COLLTUNE_PROFILE": str(tmp_path / "nope.yaml")})


def test_a_rule_scoped_to_a_backend() -> None:
    policy = parse_policy(textwrap.dedent("""
        version: 1
        rules:
          - when: {backend: [NCCL, gloo], world_size: [8, null]}
            use: dense
          - when: {backend: gloo}
            knobs: {oktopk: {peers_in_flight: 2}}
    """))
    assert policy.rules[0].backend == ("nccl", "gloo")
    assert policy.match(None, 100, 0.1, 8, None, "float32", "nccl").algorithm == "dense"
    assert policy.match(None, 100, 0.1, 4, None, "float32", "gloo").rule_index == 1
    assert policy.match(None, 100, 0.1, 4, None, "float32", "nccl").rule_index is None
    assert policy.match(None, 100, 0.1, 8, None, "float32").rule_index is None  # unknown backend: no match
    with pytest.raises(PolicyError, match="backend"):
        parse_policy("version: 1\nrules:\n  - when: {backend: ''}\n    use: dense\n")
