"""Bounded YAML loading (colltune.model.yamlsafe) for profiles and policies: no process group needed."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import yaml

from colltune.model import yamlsafe
from colltune.model.policy import PolicyError, load_policy, parse_policy
from colltune.model.profile import ProfileError, load_profile

REPO = pathlib.Path(__file__).resolve().parents[2]
#: Refusing takes milliseconds; this only catches a return of the old behaviour
#: (tens of seconds and gigabytes) on a noisy shared machine.
GENEROUS_S = 10.0

_PRIMITIVES = "".join(
    f"  {p}: {{alpha_us: 1.0, beta_us_per_byte: 1.0e-06}}\n" for p in ("all_reduce", "all_gather", "all_to_all", "p2p")
)


def _laughs(levels: int, indent: str) -> str:
    """``a: &a [x * 9]``, ``b: &b [*a * 9]``, ...: ``9**levels`` values from a few hundred bytes."""
    names = "abcdefghijklmnop"
    lines = [f"{indent}a: &a [x, x, x, x, x, x, x, x, x]"]
    for parent, child in zip(names, names[1:levels]):
        lines.append(f"{indent}{child}: &{child} [" + ", ".join([f"*{parent}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _profile_text(meta_extra: str = "") -> str:
    return (
        "format: colltune-profile\nversion: 1\nkind: analytic\nmeta:\n  backend: gloo\n"
        + meta_extra
        + "primitives:\n"
        + _PRIMITIVES
        + "measurements: []\n"
    )


def _write(tmp_path: pathlib.Path, text: str, name: str) -> pathlib.Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- aliases


def test_billion_laughs_profile_is_refused_quickly(tmp_path: pathlib.Path) -> None:
    # 9 levels: 9**9 (387 million) values in about 720 bytes. Without the limits
    # 8 levels (674 bytes) took about 56 s and 1.3 GiB; each level is 9 times that.
    path = _write(tmp_path, _profile_text(_laughs(9, "  ")), "laughs.yaml")
    assert 650 < path.stat().st_size < 800
    start = time.perf_counter()
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert time.perf_counter() - start < GENEROUS_S
    message = str(info.value)
    for fragment in ("laughs.yaml: line ", "aliases repeat more than 100,000 nodes, the limit", "write repeated values out"):
        assert fragment in message, message


def test_billion_laughs_policy_is_refused_quickly(tmp_path: pathlib.Path) -> None:
    # Refused while composing, before the schema walk reads a single rule.
    rules = "".join(
        f"  - name: r{i}\n    use: dense\n    when:\n      tensor: &{c} [" + ", ".join([f"*{p}"] * 9) + "]\n"
        for i, (p, c) in enumerate(zip("abcdefgh", "bcdefghi"))
    )
    text = "version: 1\nrules:\n  - name: base\n    use: dense\n    when:\n      tensor: &a [x, x, x, x, x, x, x, x, x]\n" + rules
    path = _write(tmp_path, text, "laughs.yaml")
    start = time.perf_counter()
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert time.perf_counter() - start < GENEROUS_S
    err = info.value
    assert err.source == str(path) and err.line is not None
    assert "aliases repeat more than 100,000 nodes" in err.problem, str(err)
    assert err.allowed is not None and "write repeated values out" in err.allowed


def test_billion_laughs_through_merge_keys_is_refused(tmp_path: pathlib.Path) -> None:
    # Each rule's `when` merges the previous one nine times, and `knobs` (read
    # before `rules`) merges the last: flatten_mapping would copy 9**9 pairs.
    # Without the limits this 766-byte policy ran 68 s into a MemoryError at 4 GiB.
    lines = ["version: 1", "rules:", "  - {use: dense, when: &m0 {numel: 1}}"]
    lines += [f"  - {{use: dense, when: &m{i} {{<<: [" + ", ".join([f"*m{i - 1}"] * 9) + "]}}" for i in range(1, 9)]
    lines += ["knobs:", "  oktopk: {<<: [" + ", ".join(["*m8"] * 9) + "]}"]
    path = _write(tmp_path, "\n".join(lines) + "\n", "merge.yaml")
    start = time.perf_counter()
    with pytest.raises(PolicyError, match=r"merge\.yaml:\d+: aliases repeat more than 100,000 nodes"):
        load_policy(path)
    assert time.perf_counter() - start < GENEROUS_S


@pytest.mark.parametrize("text", ["a: &a [1, *a]\n", "a: &a {b: *a}\n", "a: &a [1, &b [*a]]\n"])
def test_recursive_alias_is_refused(tmp_path: pathlib.Path, text: str) -> None:
    with pytest.raises(yamlsafe.YamlLimitError, match="recursive structure"):
        yamlsafe.load(text)
    meta = "  " + text.replace("\n", "\n  ").rstrip() + "\n"
    with pytest.raises(ProfileError, match=r"rec\.yaml: line 6: collections nested more than 100 deep through aliases"):
        load_profile(_write(tmp_path, _profile_text(meta), "rec.yaml"))
    with pytest.raises(PolicyError, match="recursive structure"):
        parse_policy("version: 1\nrules:\n  - use: dense\n    when:\n      " + text, "rec.yaml")


def test_alias_limit_is_on_repeated_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    # b repeats a (a sequence of 3): 4 nodes per use.
    text = "a: &a [1, 2, 3]\nb: [*a, *a, *a]\n"
    monkeypatch.setattr(yamlsafe, "MAX_ALIAS_NODES", 12)
    assert yamlsafe.load(text) == {"a": [1, 2, 3], "b": [[1, 2, 3]] * 3}
    monkeypatch.setattr(yamlsafe, "MAX_ALIAS_NODES", 11)
    with pytest.raises(yamlsafe.YamlLimitError, match="line 1: aliases repeat more than 11 nodes"):
        yamlsafe.load(text)


def test_modest_aliases_still_load(tmp_path: pathlib.Path) -> None:
    # 4 levels: about 8,000 nodes through aliases, under the 100,000 limit.
    prof = load_profile(_write(tmp_path, _profile_text(_laughs(4, "  ")), "fine.yaml"))
    assert len(prof.meta["d"]) == 9 and prof.meta["d"][8][8][8] == ["x"] * 9


def test_merge_keys_with_defaults_still_work() -> None:
    # The common use: one anchored mapping merged into many rules.
    base = "  - name: base\n    use: dense\n    when: &big {numel: [1000, null], world_size: [4, null]}\n"
    rules = "".join(f"  - name: r{i}\n    use: oktopk\n    when:\n      <<: *big\n      dtype: float16\n" for i in range(50))
    policy = parse_policy("version: 1\nrules:\n" + base + rules, "merge.yaml")
    assert len(policy.rules) == 51
    assert all(r.numel == (1000, None) and r.world_size == (4, None) for r in policy.rules)
    assert policy.rules[1].dtype == ("float16",)


# --------------------------------------------------------------------------- nesting


def test_nesting_limit(tmp_path: pathlib.Path) -> None:
    assert yamlsafe.load("[" * 100 + "]" * 100) is not None
    with pytest.raises(ProfileError, match=r"deep\.yaml: line 6: collections nested more than 100 deep"):
        load_profile(_write(tmp_path, _profile_text("  notes: " + "[" * 101 + "]" * 101 + "\n"), "deep.yaml"))
    with pytest.raises(PolicyError, match=r"p\.yaml:4: collections nested more than 100 deep"):
        parse_policy("version: 1\nrules:\n  - use: dense\n    when: {tensor: " + "[" * 101 + "]" * 101 + "}\n", "p.yaml")


@pytest.mark.parametrize("deep", ["[" * 100_000 + "]" * 100_000, "- " * 100_000 + "x"], ids=["flow", "block"])
def test_very_deep_nesting_is_an_error_not_a_crash(tmp_path: pathlib.Path, deep: str) -> None:
    # 100,000 levels overflow the C stack in yaml.CSafeLoader (the process
    # dies) and raise RecursionError from yaml.SafeLoader.
    assert not yamlsafe._c_composer_safe(deep)
    meta = f"  notes: {deep}\n" if deep.startswith("[") else f"  notes:\n  {deep}\n"
    with pytest.raises(ProfileError, match=r"deep\.yaml: collections nested more than 100 deep"):
        load_profile(_write(tmp_path, _profile_text(meta), "deep.yaml"))
    with pytest.raises(PolicyError, match="nested more than 100 deep"):
        parse_policy("version: 1\nrules:\n  - use: dense\n    when:\n      tensor:\n        " + deep + "\n")


# --------------------------------------------------------------------------- size


def test_oversized_profile_is_refused_before_reading(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as fh:  # sparse: no disk space, nothing to read
        fh.truncate(yamlsafe.MAX_BYTES + 1)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    for fragment in ("huge.yaml", "too large", f"got {yamlsafe.MAX_BYTES + 1:,} bytes", f"limit is {yamlsafe.MAX_BYTES:,} bytes (16 MiB)", "right file"):
        assert fragment in message, message
    with pytest.raises(PolicyError, match="huge.yaml: the policy file is too large"):
        load_policy(path)


def test_oversized_text_and_streams_are_refused(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yamlsafe, "MAX_BYTES", 1000)
    text = "version: 1\n" + "# padding\n" * 200
    with pytest.raises(PolicyError, match=r"<string>: the policy text is too large: the limit is 1,000 bytes .*got 2,011 bytes"):
        parse_policy(text)
    with pytest.raises(ProfileError, match="pad.yaml: the file is too large"):
        load_profile(_write(tmp_path, _profile_text() + "#" * 1000 + "\n", "pad.yaml"))
    with pytest.raises(yamlsafe.YamlLimitError, match="got 2,400 bytes"):
        yamlsafe.load("é" * 1200)  # counted in UTF-8 bytes, not characters
    if os.path.exists("/dev/zero"):  # reports size 0: read one byte past the limit
        with pytest.raises(yamlsafe.YamlLimitError, match="got more than that"):
            yamlsafe.read_bytes("/dev/zero")


# --------------------------------------------------------------------------- normal files


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "profiles").glob("*.yaml") if p.name != "nccl-tuning.yaml"))
def test_shipped_profiles_load(name: str) -> None:
    prof = load_profile(REPO / "profiles" / name)
    assert set(prof.primitives) >= {"all_reduce", "all_gather", "all_to_all", "p2p"}


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "profiles" / "policies").glob("*.yaml")))
def test_shipped_policies_load(name: str) -> None:
    assert load_policy(REPO / "profiles" / "policies" / name).version == 1


def test_profiles_keep_the_c_composer_and_read_the_same() -> None:
    # yaml.CSafeLoader composes shipped profiles (its speed is on the path of
    # the first auto call); the data is what it always read.
    if not getattr(yaml, "__with_libyaml__", False):
        pytest.skip("PyYAML is built without libyaml")
    from colltune.model.profile import _load_fast

    for path in sorted((REPO / "profiles").glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        # The measurements are read without YAML (one line each, the layout colltune writes): YAML composes
        # only what comes before them.
        head, fast, _ = text.partition("\nmeasurements:\n")
        assert not fast or _load_fast(text) is not None, path
        assert yamlsafe._c_composer_safe(head), path
        if path.stat().st_size < 100_000:
            assert yamlsafe.load(text) == yaml.load(text, Loader=yaml.CSafeLoader)  # noqa: S506 - a safe loader


def test_loading_stays_code_free(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(yaml.constructor.ConstructorError):
        yamlsafe.load(f"!!python/object/apply:os.system ['touch {marker}']\n")
    assert not marker.exists()


# --------------------------------------------------------------------------- nodes


def test_a_profile_of_too_many_nodes_is_refused_with_the_way_out(tmp_path: pathlib.Path) -> None:
    # One node every 2 bytes: 16 MiB of this took about 60 s and 3 GiB before the node limit.
    n = yamlsafe.MAX_NODES
    path = _write(tmp_path, _profile_text("  pad: [" + "0," * n + "0]\n"), "zeros.yaml")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    for fragment in ("zeros.yaml: line 6: ", f"more than {n:,} values (YAML nodes", "the limit", "right file",
                     "`- {...}` line after `measurements:`", "save_profile(Profile.from_dict(yaml.safe_load(open(path))), path)"):
        assert fragment in message, message


def test_the_node_limit_counts_keys_values_and_collections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yamlsafe, "MAX_NODES", 7)
    # root, a, [ ], 1, 2, b, { }: 7 nodes.
    assert yamlsafe.load("a: [1, 2]\nb: {}\n") == {"a": [1, 2], "b": {}}
    with pytest.raises(yamlsafe.YamlLimitError, match=r"line 2: more than 7 values") as info:
        yamlsafe.load("a: [1, 2]\nb: {c: 1}\n")
    assert info.value.limit == "nodes"
    # An alias is one node here; the value it names counts against MAX_ALIAS_NODES.
    assert yamlsafe.load("a: &x [1, 2]\nb: *x\n") == {"a": [1, 2], "b": [1, 2]}


def test_the_node_limit_holds_for_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yamlsafe, "MAX_NODES", 50)
    text = "version: 1\nrules:\n" + "".join(f"  - {{name: r{i}, use: dense}}\n" for i in range(20))
    with pytest.raises(PolicyError, match=r"many\.yaml:\d+: more than 50 values"):
        parse_policy(text, "many.yaml")


def test_libyaml_composes_only_what_cannot_pass_the_node_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # yaml.CSafeLoader cannot be stopped mid-document: it gets text whose node_bound is within the limit.
    monkeypatch.setattr(yamlsafe, "MAX_NODES", 10)
    assert isinstance(yamlsafe._loader_for("a: 1\nb: 2\n"), yaml.CSafeLoader) or yamlsafe.CParser is None
    assert not isinstance(yamlsafe._loader_for("[" + "0," * 10 + "0]"), yaml.CSafeLoader)


def _nodes(root: yaml.Node) -> int:
    seen: dict[int, yaml.Node] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen[id(node)] = node
            if isinstance(node, yaml.MappingNode):
                stack.extend(n for pair in node.value for n in pair)
            elif isinstance(node, yaml.SequenceNode):
                stack.extend(node.value)
    return len(seen)


def test_node_bound_bounds_every_short_document() -> None:
    # Every text of up to 4 characters from YAML's indicators and a scalar: the nodes libyaml
    # composes never exceed node_bound (a lone `?` is 3 nodes: a mapping, its empty key and value).
    import itertools

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    checked = 0
    for size in range(1, 5):
        for chars in itertools.product("a-:,?[]{}\n &*", repeat=size):
            text = "".join(chars)
            try:
                root = loader(text).get_single_node()
            except yaml.YAMLError:
                continue
            if root is not None:
                checked += 1
                assert _nodes(root) <= yamlsafe.node_bound(text), repr(text)
    assert checked > 1000
