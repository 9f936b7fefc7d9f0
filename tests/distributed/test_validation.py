"""Bad input and disagreeing ranks: clear errors, on every rank, quickly, never a hang.

* A rank's own bad input raises ``ColltuneValueError`` / ``ColltuneTypeError``
  whose message names the argument; the other ranks raise ``RemoteInputError``.
* Ranks that disagree on size, dtype, op, algorithm or row shape all raise
  ``RankMismatchError``.
* After such an error the group is still usable.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from colltune.algorithms.registry import BUILTIN_NAMES, names

from harness import expect_error, pool, run_cases

SIZE = 50
#: Bad input must be reported on every rank within this many seconds.
FAST_S = 5.0
#: Disagreeing ranks must all raise within this many seconds.
MISMATCH_S = 20.0


def _good():
    return {
        "indices": torch.tensor([3, 1, 3, 49], dtype=torch.int64),
        "values": torch.tensor([1.0, 2.0, 3.0, 4.0]),
        "size": SIZE,
        "op": "sum",
        "algorithm": "allgather",
    }


def _with(**kw):
    def build():
        d = _good()
        d.update({k: (v() if callable(v) else v) for k, v in kw.items()})
        return d

    return build


# name -> (builder of sparse_allreduce kwargs, expected exception class, word the message must contain)
BAD_INPUTS = {
    "index_out_of_range": (_with(indices=lambda: torch.tensor([3, 1, 3, SIZE])), "ColltuneValueError", "indices"),
    "index_far_out_of_range": (_with(indices=lambda: torch.tensor([3, 1, 2**40, 0])), "ColltuneValueError", "indices"),
    "negative_index": (_with(indices=lambda: torch.tensor([3, -1, 3, 4])), "ColltuneValueError", "indices"),
    "float_indices": (_with(indices=lambda: torch.tensor([3.0, 1.0, 3.0, 4.0])), "ColltuneTypeError", "indices"),
    "indices_2d": (
        _with(indices=lambda: torch.tensor([[3, 1], [3, 4]]), values=lambda: torch.ones(2)),
        "ColltuneValueError",
        "indices",
    ),
    "indices_not_a_tensor": (_with(indices=[3, 1, 3, 4]), "ColltuneTypeError", "indices"),
    "length_mismatch": (_with(values=lambda: torch.ones(3)), "ColltuneValueError", "values"),
    "values_0d": (_with(indices=lambda: torch.tensor([2]), values=lambda: torch.tensor(1.0)), "ColltuneValueError", "values"),
    "int_values": (_with(values=lambda: torch.tensor([1, 2, 3, 4])), "ColltuneTypeError", "values"),
    "bool_values": (_with(values=lambda: torch.ones(4, dtype=torch.bool)), "ColltuneTypeError", "values"),
    "op_max": (_with(op="max"), "ColltuneValueError", "op"),
    "unknown_algorithm": (_with(algorithm="ring"), "ColltuneValueError", "algorithm"),
    "negative_size": (_with(size=-3), "ColltuneValueError", "size"),
    "float_size": (_with(size=50.0), "ColltuneTypeError", "size"),
}

# name -> per-rank override of the good kwargs (even ranks keep the good ones)
MISMATCHES = {
    "size": {"size": SIZE + 10},
    "dtype": {"values": lambda: torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)},
    "op": {"op": "avg"},
    "algorithm": {"algorithm": "oktopk"},
    "algorithm_auto_vs_fixed": {"algorithm": "auto"},
    "row_shape_same_numel": {"values": lambda: torch.ones(4, 2, 3)},
    "row_shape_vs_scalar": {"values": lambda: torch.ones(4, 1)},
}
# name -> (the field every rank's message names, the two values it should show in readable form)
MISMATCH_WORDS = {
    "size": ("size", ("50", "60")),
    "dtype": ("dtype", ("float32", "float64")),
    "op": ("op", ("sum", "avg")),
    "algorithm": ("algorithm", ("allgather", "oktopk")),
    "algorithm_auto_vs_fixed": ("algorithm", ("allgather", "auto")),
    "row_shape_same_numel": ("row", ("(3, 2)", "(2, 3)")),
    "row_shape_vs_scalar": ("row", ("()", "(1,)")),
}
MISMATCH_BASE = {"row_shape_same_numel": {"values": lambda: torch.ones(4, 3, 2)}}


def _call(kw):
    import colltune

    return colltune.sparse_allreduce(kw["indices"], kw["values"], kw["size"], op=kw["op"], algorithm=kw["algorithm"])


def _recovery_call(rank, world_size):
    """A valid call after the error: returns the dense result so the parent can check it."""
    import colltune

    res = colltune.sparse_allreduce(torch.tensor([rank, 7]), torch.tensor([1.0, float(rank)]), 10, algorithm="dense")
    return res.to_dense()


def _expected_recovery(world_size):
    d = torch.zeros(10)
    for r in range(world_size):
        d[r] += 1.0
        d[7] += float(r)
    return d


# ------------------------------------------------------------------ rank functions


def _rank_bad_input(rank, world_size, name, bad_ranks):
    kw = BAD_INPUTS[name][0]() if rank in bad_ranks else _good()
    raised = expect_error(_call, kw)
    return {"raised": raised, "after": _recovery_call(rank, world_size)}


def _rank_mismatch(rank, world_size, name):
    kw = _good()
    base = MISMATCH_BASE.get(name, {})
    override = MISMATCHES[name] if rank % 2 == 1 else base
    kw.update({k: (v() if callable(v) else v) for k, v in override.items()})
    raised = expect_error(_call, kw)
    return {"raised": raised, "after": _recovery_call(rank, world_size)}


def _rank_topk_mismatch(rank, world_size, what):
    import colltune

    shape, dtype, k = (32, 8), torch.float32, 10
    if rank == 1:
        if what == "shape":
            shape = (16, 16)
        elif what == "numel":
            shape = (32, 9)
        elif what == "dtype":
            dtype = torch.float64
        elif what == "k":
            k = 11
    state = colltune.TopkState(k=k)
    t = torch.randn(shape, generator=torch.Generator().manual_seed(rank)).to(dtype)
    raised = expect_error(colltune.topk_allreduce, t, state, op="avg", algorithm="oktopk")
    return {"raised": raised, "after": _recovery_call(rank, world_size)}


def _rank_topk_bad(rank, world_size, what):
    import colltune

    state = colltune.TopkState(k=10)
    t = torch.randn(64)
    if rank == 1:
        if what == "int_tensor":
            t = torch.arange(64)
        elif what == "unknown_algorithm":
            return {"raised": expect_error(colltune.topk_allreduce, t, state, algorithm="ring"), "after": _recovery_call(rank, world_size)}
        elif what == "op_max":
            return {"raised": expect_error(colltune.topk_allreduce, t, state, op="max"), "after": _recovery_call(rank, world_size)}
    raised = expect_error(colltune.topk_allreduce, t, state, algorithm="allgather")
    return {"raised": raised, "after": _recovery_call(rank, world_size)}


# ------------------------------------------------------------------ checks


def _assert_specific(raised, cls: str, word: str, where: str):
    assert raised.raised, f"{where}: nothing was raised (returned {raised.returned})"
    assert raised.isa(cls), f"{where}: raised {raised.type} ({raised.classes}): {raised.message}"
    base = "ValueError" if "Value" in cls else "TypeError"
    assert raised.isa(base) and raised.isa("ColltuneError"), f"{where}: {raised.classes}"
    assert re.search(rf"\b{word}\b", raised.message), f"{where}: message does not name {word!r}: {raised.message}"


# ------------------------------------------------------------------ tests: one rank, no process group


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_single_rank_without_process_group(name):
    build, cls, word = BAD_INPUTS[name]
    raised = expect_error(_call, build())
    _assert_specific(raised, cls, word, f"{name} (no process group)")
    if name == "unknown_algorithm":
        for known in names():
            assert known in raised.message, f"the message should list the known algorithms: {raised.message}"
    # The good input works in the same setting.
    res = _call(_good())
    assert res.indices.tolist() == [1, 3, 49] and res.values.tolist() == [2.0, 4.0, 4.0]


@pytest.mark.parametrize("name", ["index_out_of_range", "float_indices", "op_max", "unknown_algorithm", "int_values"])
def test_bad_input_single_rank_in_a_group(name):
    build, cls, word = BAD_INPUTS[name]
    (out,) = pool(1).run(_rank_bad_input, name, (0,))
    _assert_specific(out["raised"], cls, word, f"{name} at P=1")
    assert torch.equal(out["after"], _expected_recovery(1))


# ------------------------------------------------------------------ tests: one bad rank among two


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_on_one_rank(name):
    _, cls, word = BAD_INPUTS[name]
    out = pool(2).run(_rank_bad_input, name, (1,), timeout=60)
    good, bad = out[0]["raised"], out[1]["raised"]
    _assert_specific(bad, cls, word, f"{name}: rank 1 (the bad one)")
    assert good.raised and good.isa("RemoteInputError") and good.isa("ValueError"), (
        f"{name}: rank 0 (good input) should raise RemoteInputError, got {good.type}: {good.message}"
    )
    assert re.search(r"\b1\b", good.message), f"{name}: RemoteInputError should name rank 1: {good.message}"
    for r, raised in enumerate((good, bad)):
        assert raised.elapsed < FAST_S, f"{name}: rank {r} took {raised.elapsed:.1f} s to raise"


@pytest.mark.parametrize("name", ["index_out_of_range", "op_max"])
def test_bad_input_on_one_rank_of_four(name):
    _, cls, word = BAD_INPUTS[name]
    out = pool(4).run(_rank_bad_input, name, (2,), timeout=60)
    for r, o in enumerate(out):
        if r == 2:
            _assert_specific(o["raised"], cls, word, f"{name}: rank 2")
        else:
            assert o["raised"].isa("RemoteInputError"), f"rank {r}: {o['raised'].type}: {o['raised'].message}"
        assert o["raised"].elapsed < FAST_S


def test_group_is_usable_after_a_remote_input_error():
    out = pool(3).run(_rank_bad_input, "negative_index", (1, 2), timeout=60)
    for r, o in enumerate(out):
        assert o["raised"].raised
        assert torch.equal(o["after"], _expected_recovery(3)), f"rank {r}: the next call after the error is wrong"


# ------------------------------------------------------------------ tests: ranks that disagree


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(MISMATCHES))
def test_disagreeing_ranks_all_raise_rank_mismatch(name, world_size):
    out = pool(world_size).run(_rank_mismatch, name, timeout=90)
    for r, o in enumerate(out):
        raised = o["raised"]
        assert raised.raised, f"{name}: rank {r} did not raise (returned {raised.returned})"
        assert raised.isa("RankMismatchError") and raised.isa("RuntimeError"), (
            f"{name}: rank {r} raised {raised.type}: {raised.message}"
        )
        assert raised.elapsed < MISMATCH_S, f"{name}: rank {r} took {raised.elapsed:.1f} s"
        assert torch.equal(o["after"], _expected_recovery(world_size)), f"rank {r}: group unusable after the error"
    field, _ = MISMATCH_WORDS[name]
    for r, o in enumerate(out):
        assert field in o["raised"].message, f"{name}: rank {r}'s message does not name {field!r}: {o['raised'].message}"


def _rank_mismatch_case(rank, world_size, name):
    return _rank_mismatch(rank, world_size, name)


def test_rank_mismatch_message_is_readable_on_every_rank():
    """Every rank's message shows the disagreeing values as the user wrote them (not internal codes).

    Fresh ranks (one launch for all cases, not the shared pool): what a rank can
    name must not depend on calls it made in earlier tests.
    """
    names = list(MISMATCHES)
    results = run_cases(_rank_mismatch_case, 2, names, timeout=120)
    problems = []
    for name, out in zip(names, results):
        _, shown = MISMATCH_WORDS[name]
        for r, o in enumerate(out):
            msg = o["raised"].message
            missing = [v for v in shown if v not in msg]
            if missing:
                problems.append(f"{name}: rank {r}'s message does not show {missing}: {msg}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("what", ["shape", "numel", "dtype", "k"])
def test_topk_disagreeing_ranks_all_raise_rank_mismatch(what):
    out = pool(2).run(_rank_topk_mismatch, what, timeout=90)
    for r, o in enumerate(out):
        raised = o["raised"]
        assert raised.isa("RankMismatchError"), f"{what}: rank {r} raised {raised.type}: {raised.message}"
        assert raised.elapsed < MISMATCH_S
        assert torch.equal(o["after"], _expected_recovery(2))


@pytest.mark.parametrize(
    "what, cls, word",
    [
        ("int_tensor", "ColltuneTypeError", "tensor"),
        ("unknown_algorithm", "ColltuneValueError", "algorithm"),
        ("op_max", "ColltuneValueError", "op"),
    ],
)
def test_topk_bad_input_on_one_rank(what, cls, word):
    out = pool(2).run(_rank_topk_bad, what, timeout=60)
    _assert_specific(out[1]["raised"], cls, word, f"topk {what}: rank 1")
    assert out[0]["raised"].isa("RemoteInputError"), f"rank 0: {out[0]['raised'].type}: {out[0]['raised'].message}"
    for o in out:
        assert o["raised"].elapsed < FAST_S
        assert torch.equal(o["after"], _expected_recovery(2))


# ------------------------------------------------------------------ tests: registry and state arguments


def test_registry():
    import colltune

    assert colltune.algorithms.names() == BUILTIN_NAMES
    for name in colltune.algorithms.names():
        assert colltune.algorithms.get(name).name == name
    raised = expect_error(colltune.algorithms.get, "ring")
    assert raised.isa("ColltuneValueError")
    for known in colltune.algorithms.names():
        assert known in raised.message
    assert issubclass(colltune.RankMismatchError, RuntimeError)
    assert issubclass(colltune.RemoteInputError, ValueError)
    assert issubclass(colltune.ColltuneValueError, ValueError) and issubclass(colltune.ColltuneTypeError, TypeError)
    for cls in (colltune.RankMismatchError, colltune.RemoteInputError, colltune.ColltuneValueError, colltune.ColltuneTypeError):
        assert issubclass(cls, colltune.ColltuneError)


@pytest.mark.parametrize(
    "kwargs, cls",
    [
        ({}, "ColltuneValueError"),
        ({"k": 10, "density": 0.1}, "ColltuneValueError"),
        ({"density": 0.0}, "ColltuneValueError"),
        ({"density": 1.5}, "ColltuneValueError"),
        ({"k": 0}, "ColltuneValueError"),
        ({"k": 2.5}, "ColltuneTypeError"),
    ],
)
def test_topk_state_arguments(kwargs, cls):
    import colltune

    raised = expect_error(colltune.TopkState, **kwargs)
    assert raised.isa(cls), f"TopkState(**{kwargs}) raised {raised.type}: {raised.message}"
    assert ("k" in raised.message) or ("density" in raised.message)


def test_topk_single_rank_without_process_group_bad_tensor():
    import colltune

    assert not (dist.is_available() and dist.is_initialized())
    raised = expect_error(colltune.topk_allreduce, torch.arange(10), colltune.TopkState(k=2))
    assert raised.isa("ColltuneTypeError") and "tensor" in raised.message
    raised = expect_error(colltune.topk_allreduce, torch.randn(10), "not a state")
    assert raised.isa("ColltuneTypeError") and "state" in raised.message


def _rank_async_mismatch(rank, world_size):
    import colltune

    kw = _good()
    if rank == 1:
        kw["op"] = "avg"
    h = colltune.sparse_allreduce(kw["indices"], kw["values"], kw["size"], op=kw["op"], algorithm="allgather", async_op=True)
    raised = expect_error(h.wait)
    fut = expect_error(h.get_future().wait)
    return {"raised": raised, "future": fut, "after": _recovery_call(rank, world_size)}


def test_async_call_reports_rank_mismatch_from_wait():
    out = pool(2).run(_rank_async_mismatch, timeout=90)
    for r, o in enumerate(out):
        assert o["raised"].isa("RankMismatchError"), f"rank {r}: wait() raised {o['raised'].type}: {o['raised'].message}"
        assert o["future"].isa("RankMismatchError"), f"rank {r}: future raised {o['future'].type}: {o['future'].message}"
        assert o["raised"].elapsed < MISMATCH_S
        assert torch.equal(o["after"], _expected_recovery(2))
