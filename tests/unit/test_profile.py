"""Tests of colltune.model.profile: the profile file format, its validation and atomic saving."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest
import yaml

from colltune.algorithms.errors import ColltuneError, ColltuneValueError
from colltune.model import profile as profile_mod
from colltune.model.features import Features
from colltune.model.profile import (
    Measurement,
    Primitive,
    Profile,
    ProfileError,
    load_profile,
    measurement_to_features,
    profile_from_measurements,
    save_profile,
)

REPO = pathlib.Path(__file__).resolve().parents[2]

PRIMS = {
    "all_reduce": Primitive(alpha_us=10.0, beta_us_per_byte=1e-4, launch_us=5.0),
    "all_gather": Primitive(alpha_us=11.0, beta_us_per_byte=1.1e-4),
    "all_to_all": Primitive(alpha_us=12.0, beta_us_per_byte=1.2e-4),
    "p2p": Primitive(alpha_us=13.0, beta_us_per_byte=1.3e-4, launch_us=1.5),
}


def _features(k: int = 100, union: float = 150.0) -> Features:
    return Features.build(numel=10_000, row_numel=4, dtype="float32", k_per_rank=[k, k], union=union)


def _profile() -> Profile:
    f = _features()
    ms = [
        Measurement.from_features(f, "dense", time_us=812.5, spread_us=11.0, repeats=20, bytes_sent=160_000),
        Measurement.from_features(f, "allgather", time_us=95.25, spread_us=2.5, repeats=20, bytes_sent=2_000),
        Measurement.from_features(_features(50, 60.0), "oktopk", time_us=130.0, spread_us=0.1, repeats=5, bytes_sent=0),
    ]
    return profile_from_measurements(
        ms, PRIMS,
        {"backend": "gloo", "world_sizes": [2], "nodes": 1, "ranks_per_node": 2, "torch_version": "2.13.0",
         "host": "test", "date": "2025-01-31", "notes": "synthetic"},
        model={"type": "example", "coef": [1.0, 2.5e-07], "nested": {"ok": True, "none": None}},
    )


def _saved(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "prof.yaml"
    save_profile(_profile(), path)
    return path


def _doc(tmp_path: pathlib.Path) -> dict[str, Any]:
    """A valid document without checksum, for corrupting field by field."""
    doc = yaml.safe_load(_saved(tmp_path).read_text())
    doc.pop("checksum")
    return doc


def _write(tmp_path: pathlib.Path, doc: Any, name: str = "bad.yaml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# -- round trip ------------------------------------------------------------------


def test_round_trip_keeps_every_field(tmp_path: pathlib.Path) -> None:
    prof = _profile()
    path = tmp_path / "p.yaml"
    save_profile(prof, path)
    loaded = load_profile(path)
    assert loaded == prof
    assert loaded.digest == prof.digest
    assert loaded.measurements[1].time_us == 95.25
    assert loaded.primitives["all_reduce"].launch_us == 5.0
    assert loaded.primitives["all_gather"].launch_us == 0.0
    assert "local" not in loaded.primitives
    text = path.read_text()
    assert f"checksum: '{prof.digest:016x}'" in text or f"checksum: {prof.digest:016x}" in text
    # Saving is deterministic and re-saving a loaded profile changes nothing.
    save_profile(loaded, tmp_path / "q.yaml")
    assert (tmp_path / "q.yaml").read_bytes() == path.read_bytes()


def test_digest_is_stable_and_content_sensitive() -> None:
    prof = _profile()
    assert 0 <= prof.digest < 2**63
    assert prof.digest == _profile().digest
    # Pinned: the digest must not depend on the machine, process or dict order.
    assert prof.digest == 5617758343119905585
    prof.measurements[0] = Measurement(**{**prof.measurements[0].to_dict(), "time_us": 812.6})
    assert prof.digest != _profile().digest


def test_measurement_to_features() -> None:
    m = _profile().measurements[0]
    f = measurement_to_features(m)
    assert f == _features()
    assert measurement_to_features(m.to_dict()) == f == m.features()
    assert (f.value_bytes, f.index_bytes, f.entry_bytes) == (4, 4, 20)


def test_shipped_analytic_profile_loads() -> None:
    prof = load_profile(REPO / "profiles" / "analytic-nccl.yaml")
    assert prof.kind == "analytic" and prof.meta["backend"] == "nccl"
    assert set(prof.primitives) == {"all_reduce", "all_gather", "all_to_all", "p2p", "local"}
    assert prof.primitives["all_reduce"].launch_us == 8.4
    assert prof.measurements == [] and "NCCL" in prof.meta["notes"]


def test_yaml_dates_and_missing_optional_sections_are_accepted(tmp_path: pathlib.Path) -> None:
    doc = _doc(tmp_path)
    del doc["model"], doc["measurements"]
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False).replace("date: '2025-01-31'", "date: 2025-01-31"))
    prof = load_profile(path)
    assert prof.meta["date"] == "2025-01-31" and prof.measurements == [] and prof.model is None


# -- atomic write ----------------------------------------------------------------


def _leftovers(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_failure_mid_write_leaves_the_original_untouched(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _saved(tmp_path)
    before = path.read_bytes()

    def half_then_fail(fh: Any, text: str) -> None:
        fh.write(text[: len(text) // 2])
        fh.flush()
        raise KeyboardInterrupt("simulated crash mid-write")

    monkeypatch.setattr(profile_mod, "_write_text", half_then_fail)
    changed = _profile()
    changed.meta["notes"] = "changed"
    with pytest.raises(KeyboardInterrupt):
        save_profile(changed, path)
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []
    assert load_profile(path) == _profile()


def test_failed_replace_is_a_profile_error_and_leaves_no_temp_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _saved(tmp_path)
    before = path.read_bytes()

    def refuse(src: str, dst: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(profile_mod.os, "replace", refuse)
    with pytest.raises(ProfileError, match="prof.yaml"):
        save_profile(_profile(), path)
    assert path.read_bytes() == before and _leftovers(tmp_path) == []


def test_invalid_profile_is_never_written(tmp_path: pathlib.Path) -> None:
    prof = _profile()
    prof.measurements[0] = Measurement(**{**prof.measurements[0].to_dict(), "time_us": float("nan")})
    path = tmp_path / "never.yaml"
    with pytest.raises(ProfileError, match=r"measurements\[0\]\.time_us"):
        save_profile(prof, path)
    assert not path.exists() and _leftovers(tmp_path) == []


def test_save_keeps_the_file_mode(tmp_path: pathlib.Path) -> None:
    path = _saved(tmp_path)
    os.chmod(path, 0o640)
    save_profile(_profile(), path)
    assert os.stat(path).st_mode & 0o777 == 0o640


# -- corrupt files ---------------------------------------------------------------


def _expect_error(path: pathlib.Path, *fragments: str) -> ProfileError:
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert isinstance(info.value, ColltuneValueError) and isinstance(info.value, ColltuneError)
    return info.value


def test_missing_file(tmp_path: pathlib.Path) -> None:
    _expect_error(tmp_path / "nope.yaml", "cannot read")


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"", "empty"),
        (b"format: colltune-profile\nversion: [1,\n", "not valid YAML at line"),
        (b"- 1\n- 2\n", "top level"),
        (b"\xff\xfe\x00garbage", "UTF-8"),
        (b"format: colltune-profile\nversion: 1\nkind: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
    ],
)
def test_unreadable_content(tmp_path: pathlib.Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    _expect_error(path, fragment)


def _set(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


_DELETE = object()


@pytest.mark.parametrize(
    "dotted, value, fragments",
    [
        ("format", "something-else", ("`format`",)),
        ("format", _DELETE, ("`format`", "missing")),
        ("version", 2, ("`version`", "version 2 is not supported", "version 1")),
        ("version", _DELETE, ("`version`", "missing")),
        ("version", "1", ("`version`", "integer")),
        ("kind", "guessed", ("`kind`", "measured, analytic")),
        ("kind", _DELETE, ("`kind`", "missing")),
        ("extra", 1, ("`extra`", "unknown key")),
        ("meta", _DELETE, ("`meta`", "missing")),
        ("meta.backend", _DELETE, ("`meta.backend`", "missing")),
        ("meta.backend", None, ("`meta.backend`", "backend name")),
        ("meta.world_sizes", "2,4", ("`meta.world_sizes`", "list")),
        ("meta.nodes", True, ("`meta.nodes`",)),
        ("primitives", [1, 2], ("`primitives`", "mapping")),
        ("primitives.all_gather", _DELETE, ("`primitives.all_gather`", "missing")),
        ("primitives.broadcast", {"alpha_us": 1.0, "beta_us_per_byte": 0.0}, ("`primitives.broadcast`", "allowed")),
        ("primitives.all_reduce.alpha_us", -1.0, ("`primitives.all_reduce.alpha_us`", ">= 0")),
        ("primitives.all_reduce.beta_us_per_byte", "fast", ("`primitives.all_reduce.beta_us_per_byte`", "number")),
        ("primitives.p2p.gamma", 1.0, ("`primitives.p2p.gamma`", "unknown key")),
        ("model", [1, 2], ("`model`", "mapping")),
        ("measurements", {"a": 1}, ("`measurements`", "list")),
        ("measurements.1", "dense", ("`measurements[1]`", "mapping")),
        ("measurements.1.time_us", _DELETE, ("`measurements[1].time_us`", "missing")),
        ("measurements.1.time_us", 0.0, ("`measurements[1].time_us`", "> 0")),
        ("measurements.1.numel", "abc", ("`measurements[1].numel`", "integer")),
        ("measurements.1.repeats", 0, ("`measurements[1].repeats`", ">= 1")),
        ("measurements.1.dtype", "int8", ("`measurements[1].dtype`", "float32")),
        ("measurements.1.algorithm", "", ("`measurements[1].algorithm`",)),
        ("measurements.1.speed", 3, ("`measurements[1].speed`", "unknown key")),
        ("measurements.1.overlap", 0.9, ("`measurements[1].overlap`", "(k_sum - union)")),
        ("measurements.1.density", 0.5, ("`measurements[1].density`", "k_sum / (world_size * numel)")),
        ("measurements.1.union", 500.0, ("`measurements[1].union`", "[k_max, min(k_sum, numel)]")),
        ("measurements.1.k_sum", 1000, ("measurements[1]", "k_sum")),
    ],
)
def test_corrupt_fields_name_the_file_and_the_field(
    tmp_path: pathlib.Path, dotted: str, value: Any, fragments: tuple[str, ...]
) -> None:
    doc = _doc(tmp_path)
    _set(doc, dotted, value)
    _expect_error(_write(tmp_path, doc), *fragments)


def test_edited_file_fails_the_checksum(tmp_path: pathlib.Path) -> None:
    path = _saved(tmp_path)
    path.write_text(path.read_text().replace("time_us: 95.25", "time_us: 95.5"))
    _expect_error(path, "`checksum`", "truncated or changed")
    # Deleting the checksum line is the documented way to accept a hand edit.
    lines = [line for line in path.read_text().splitlines(keepends=True) if not line.startswith("checksum:")]
    path.write_text("".join(lines))
    assert load_profile(path).measurements[1].time_us == 95.5


def test_every_truncation_is_detected(tmp_path: pathlib.Path) -> None:
    full = _saved(tmp_path).read_bytes()
    cut_path = tmp_path / "cut.yaml"
    cuts = sorted(set(range(1, len(full), 7)) | {i for i, b in enumerate(full) if b == ord("\n")})
    for cut in cuts:
        if not full[cut:].strip():
            continue  # only trailing whitespace removed: nothing was lost
        cut_path.write_bytes(full[:cut])
        with pytest.raises(ProfileError) as info:
            load_profile(cut_path)
        assert str(cut_path) in str(info.value)


@pytest.mark.parametrize("name", ["cpu-gloo.yaml", "cpu-gloo-grid.yaml", "analytic-nccl.yaml"])
def test_the_fast_reading_of_measurements_equals_yaml(name: str) -> None:
    from colltune.model import profile as P
    from colltune.model import yamlsafe
    from colltune.select.selector import profiles_dir

    text = (profiles_dir() / name).read_text()
    fast = P._load_fast(text)
    slow = yamlsafe.load(text)
    if "\nmeasurements:\n" in text:
        assert fast is not None
    if fast is not None:
        assert repr(fast) == repr(slow)  # the same values and the same types


@pytest.mark.parametrize("line, value", [
    ("- {algorithm: dense, numel: 4096, time_us: 1.0e-05}", {"algorithm": "dense", "numel": 4096, "time_us": 1e-05}),
    ("- {algorithm: dense, numel: 0x10}", "yaml"),       # another notation: YAML reads the line
    ("- {algorithm: 'dense', numel: 1}", "yaml"),        # quoted
    ("- {algorithm: yes, numel: 1}", "yaml"),            # a YAML boolean
    ("- {algorithm: dense, numel: 1}  # note", "yaml"),  # a trailing comment
    ("- {algorithm: dense}\n# a comment\n\n- {algorithm: oktopk}", "yaml"),  # skipped, as YAML skips them
    ("# a comment", None),                               # no entry: YAML reads null
    ("- {algorithm: dense, algorithm: dense}", "yaml"),  # a duplicate key: YAML keeps the last
    ("- {algorithm: *a}", None),                         # an alias: only the whole text can resolve it
    ("  - {algorithm: dense}", None),                    # not at column 0
    ("- {algorithm: dense,\n   numel: 1}", None),      # an entry over two lines
    ("- |\n  # text, not a comment", None),             # a block scalar
    ("- {algorithm: dense}\u2028- {algorithm: oktopk}", None),  # a line break to YAML only
    ("extra: 1", None),                                  # not an entry
])
def test_the_fast_reading_leaves_anything_unusual_to_yaml(line: str, value: dict | str | None) -> None:
    from colltune.model import profile as P
    from colltune.model import yamlsafe

    text = "format: colltune-profile\nmeasurements:\n" + line + "\n"
    got = P._load_fast(text)
    if value is None:
        assert got is None
    elif value == "yaml":
        assert repr(got) == repr(yamlsafe.load(text))  # the same values and the same types
    else:
        assert got == {"format": "colltune-profile", "measurements": [value]}


# -- large profiles --------------------------------------------------------------


def _many(n: int) -> Profile:
    ms = []
    for i in range(n):
        f = Features.build(numel=4096 * (1 + i % 7), row_numel=1 + i % 3, dtype=("float32", "float16")[i % 2],
                           k_per_rank=[10 + i % 5, 20], union=25.0)
        ms.append(Measurement.from_features(f, ("dense", "allgather", "oktopk")[i % 3], time_us=100.0 + i / 7,
                                            spread_us=i / 3, repeats=1 + i % 4, bytes_sent=i))
    return profile_from_measurements(ms, PRIMS, {"backend": "gloo", "world_sizes": [2]})


def test_saved_measurements_do_not_count_against_the_yaml_node_limit(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from colltune.model import yamlsafe

    prof = _many(300)  # some 8,700 nodes as YAML
    path = tmp_path / "many.yaml"
    save_profile(prof, path)
    monkeypatch.setattr(yamlsafe, "MAX_NODES", 1000)
    assert load_profile(path) == prof
    # A hand edit: the checksum deleted, a comment, a blank line, a quoted value, a trailing comment, CRLF line ends.
    lines = [line for line in path.read_text().splitlines() if not line.startswith("checksum:")]
    first = lines.index("measurements:") + 1
    lines[first + 5] = lines[first + 5].replace("algorithm: dense", "algorithm: 'dense'")
    lines[first + 7] += "  # re-measured"
    lines[first + 9:first + 9] = ["# by hand", ""]
    edited = tmp_path / "edited.yaml"
    edited.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    assert load_profile(edited) == prof
    # The same measurements in block style are YAML, within the limit: refused, with the reason and the way out.
    block = tmp_path / "block.yaml"
    block.write_text(yaml.safe_dump(prof.to_dict(), sort_keys=False))
    with pytest.raises(ProfileError) as info:
        load_profile(block)
    message = str(info.value)
    for fragment in ("block.yaml: line ", "more than 1,000 values", "`- {...}` line after `measurements:`"):
        assert fragment in message, message
    save_profile(Profile.from_dict(yaml.safe_load(open(block))), block)  # the way out it names
    assert load_profile(block) == prof


_EDGE_VALUES = [True, None, -1, 0, 1, 2, 2**53 - 1, 2**53, 2**63, 1.5, -0.0, 0.0, 1.0, 2.0, float("nan"), float("inf"),
                1e-300, 1e300, "", "dense", "float16", "float64", "int8", [1], {"a": 1}]


def test_checking_every_measurement_at_once_accepts_only_what_the_row_checks_accept() -> None:
    # The column checks (NumPy) must never let through what _parse_measurement refuses, and must build the same
    # records; where they are unsure the rows are checked one at a time, which names the bad one.
    rows = [m.to_dict() for m in _many(6).measurements]
    assert profile_mod._measurements_all_valid(rows) == [profile_mod._parse_measurement(r, "s", i) for i, r in enumerate(rows)]
    cases = 0
    for name in profile_mod.MEASUREMENT_FIELDS:
        own = rows[2][name]
        near = [own * s for s in (0.5, 2, 1 + 1e-7, 1 - 1e-7, 1 + 1e-5, -1)] if isinstance(own, float) else []
        near += [own - 1, own + 1, own * 2] if isinstance(own, int) else []
        for value in _EDGE_VALUES + near:
            bad = dict(rows[2], **{name: value})
            got = profile_mod._measurements_all_valid([rows[0], bad])
            try:
                want = [profile_mod._parse_measurement(r, "s", i) for i, r in enumerate([rows[0], bad])]
            except ProfileError:
                want = None
            if got is not None:
                cases += 1
                assert want is not None and repr(got) == repr(want), (name, value)
    assert cases > 20
    extra = dict(rows[0], extra=1)
    assert profile_mod._measurements_all_valid([extra]) is None


def test_an_unhashable_dtype_is_a_profile_error(tmp_path: pathlib.Path) -> None:
    doc = _doc(tmp_path)
    doc["measurements"][0]["dtype"] = [1]
    _expect_error(_write(tmp_path, doc), "measurements[0].dtype", "expected one of")
