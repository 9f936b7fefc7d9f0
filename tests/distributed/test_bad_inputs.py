"""A battery of wrong inputs: every rank raises within seconds, and the group still works after.

Each case runs on 2 ranks in a fresh gloo group (made for the case inside
the persistent pool ranks, with a short timeout, and destroyed after), once
for each algorithm and ``auto``. Rank 1 gets the wrong input, rank 0 a good
one, unless the case says otherwise. The outcomes a case may expect:

``bad``
    rank 1 raises a :class:`ColltuneError` whose message names the argument;
    rank 0 raises :class:`RemoteInputError` naming rank 1 and the argument.
``mismatch``
    the ranks disagree on the call: every rank raises :class:`RankMismatchError`.
``ok``
    awkward but valid input: every rank returns the exact sum (checked against
    an fp64 reference of both ranks' inputs), bit for bit the same on both.

After every case both ranks make a valid call on the case's group and on the
default group, and check its result: nothing is left half-posted.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from colltune.algorithms import get, names
from colltune.algorithms.sparse import device_path

from harness import expect_error, pool

SIZE = 64
#: Every rank must have raised within this many seconds.
FAST_S = 5.0
#: The timeout of each case's group: a hang surfaces as a failure after it, not at the pool's deadline.
GROUP_TIMEOUT_S = 15.0
ALGORITHMS = (*names(), "auto")
#: The algorithms that never densify: a dense-like one (priced on the whole tensor) would allocate every row.
NEVER_DENSE = (*(n for n in names() if get(n).topk_priced_on != "tensor"), "auto")


def _indices(rank: int) -> torch.Tensor:
    return torch.tensor([3, 1, 3, 63, 10 + rank], dtype=torch.int64)


def _values(rank: int) -> torch.Tensor:
    return torch.tensor([1.0, 2.0, 3.0, 4.0, 0.5 + rank])


def _policy(text: str) -> Any:
    from colltune.model.policy import parse_policy

    return parse_policy("version: 1\n" + text)


@dataclass
class Case:
    """One wrong (or awkward) input.

    ``build(rank, algorithm)`` returns the keyword arguments of this rank's
    ``sparse_allreduce`` call (``indices``, ``values``, ``size`` and options);
    ``expect`` is ``bad``, ``mismatch`` or ``ok``; ``word`` is the argument
    the bad rank's message must name.
    """

    build: Callable[[int, str], dict]
    expect: str
    word: str = ""
    only: tuple[str, ...] = ALGORITHMS
    topk: bool = False


def _call(rank: int, algorithm: str, bad: dict | None = None, *, everyone: bool = False) -> dict:
    kw: dict[str, Any] = {"indices": _indices(rank), "values": _values(rank), "size": SIZE, "algorithm": algorithm}
    if bad is not None and (everyone or rank == 1):
        kw.update({k: (v() if callable(v) else v) for k, v in bad.items()})
    return kw


def bad(word: str, **override: Any) -> Case:
    return Case(lambda rank, algorithm: _call(rank, algorithm, override), "bad", word)


def mismatch(**override: Any) -> Case:
    return Case(lambda rank, algorithm: _call(rank, algorithm, override), "mismatch")


def ok(everyone: bool = True, **override: Any) -> Case:
    return Case(lambda rank, algorithm: _call(rank, algorithm, override, everyone=everyone), "ok")


def _strided_one() -> torch.Tensor:
    return torch.tensor([[0.0, 0.5]])[:, 1]


def _coo() -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.tensor([1.0, 2.0]), (SIZE,))


def _row_view(rows: int, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    return lambda: torch.ones((rows,) + shape)


CASES: dict[str, Case] = {
    # -- what the issue found
    "knobs_as_list": bad("knobs", knobs=[("mode", "pad")]),
    "size_2_63": bad("size", size=2**63),
    "size_2_64": bad("size", size=2**64 + 5),
    "values_on_meta": bad("values", values=lambda: torch.ones(5, device="meta")),
    "values_sparse_coo": bad("values", indices=lambda: torch.tensor([1, 3]), values=_coo),
    "indices_sparse_coo_and_values": bad("values", indices=lambda: torch.sparse_coo_tensor(
        torch.tensor([[0, 1]]), torch.tensor([1, 3]), (5,))),
    "values_sparse_csr": bad("values", indices=lambda: torch.tensor([1, 3]),
                             values=lambda: torch.eye(2).to_sparse_csr()),
    "dense_size_2_40": Case(lambda rank, algorithm: _call(rank, "dense", {"size": 2**40}), "bad", "size",
                            only=("dense",)),
    "zero_width_rows": ok(indices=lambda: torch.tensor([2, 5, 2]), values=lambda: torch.ones(3, 3, 0),
                          size=(SIZE, 3, 0)),
    "one_element_strided_view": ok(indices=lambda: torch.tensor([7]), values=_strided_one),
    "auto_knob_of_another_algorithm": Case(
        lambda rank, algorithm: _call(rank, "auto", {"knobs": {"allgather": {"mode": "pad"}},
                                                     "policy": _policy("default: dense\n")}, everyone=True),
        "ok", only=("auto",)),
    "auto_flat_knob_of_another_algorithm": Case(
        lambda rank, algorithm: _call(rank, "auto", {"knobs": {"mode": "pad"}, "policy": _policy("default: dense\n")},
                                      everyone=True),
        "ok", only=("auto",)),
    # -- knobs and policies that differ per rank
    "auto_knobs_differ_dense_pinned": Case(
        lambda rank, algorithm: _call(rank, "auto", {"policy": _policy("default: dense\n"),
                                                     "knobs": {"mode": "pad"} if rank else None}, everyone=True),
        "mismatch", only=("auto",)),
    "auto_knobs_differ_allgather_pinned": Case(
        lambda rank, algorithm: _call(rank, "auto", {"policy": _policy("default: allgather\n"),
                                                     "knobs": {"mode": "pad" if rank else "alltoall"}}, everyone=True),
        "mismatch", only=("auto",)),
    "auto_knobs_differ_oktopk_pinned": Case(
        lambda rank, algorithm: _call(rank, "auto", {"policy": _policy("default: oktopk\n"),
                                                     "knobs": {"dense_fallback_ratio": 0.5 if rank else 1.0}},
                                      everyone=True),
        "mismatch", only=("auto",)),
    "policy_differs": Case(
        lambda rank, algorithm: _call(rank, "auto", {"policy": _policy(f"default: {'dense' if rank else 'allgather'}\n")},
                                      everyone=True),
        "mismatch", only=("auto",)),
    "explicit_knobs_differ": Case(
        lambda rank, algorithm: _call(rank, "allgather", {"knobs": {"mode": "pad" if rank else "alltoall"}},
                                      everyone=True),
        "mismatch", only=("allgather",)),
    "name_differs": Case(lambda rank, algorithm: _call(rank, "auto", {"name": f"table{rank}"}, everyone=True),
                         "mismatch", only=("auto",)),
    "skipped_call": Case(  # rank 1 skipped the call of size 64: its next call (size 80) pairs with rank 0's
        lambda rank, algorithm: _call(rank, algorithm, {"size": 80}), "mismatch"),
    # -- types
    "indices_list": bad("indices", indices=[3, 1, 3, 63, 11]),
    "indices_numpy": bad("indices", indices=lambda: _indices(1).numpy()),
    "indices_none": bad("indices", indices=None),
    "values_list": bad("values", values=[1.0, 2.0, 3.0, 4.0, 1.5]),
    "values_none": bad("values", values=None),
    "indices_int16": bad("indices", indices=lambda: _indices(1).short()),
    "indices_uint8": bad("indices", indices=lambda: _indices(1).to(torch.uint8)),
    "indices_bool": bad("indices", indices=lambda: torch.ones(5, dtype=torch.bool)),
    "indices_float": bad("indices", indices=lambda: _indices(1).double()),
    "values_complex": bad("values", values=lambda: _values(1).to(torch.complex64)),
    "values_int64": bad("values", values=lambda: _values(1).long()),
    "values_float8": bad("values", values=lambda: _values(1).to(torch.float8_e4m3fn)),
    "size_float": bad("size", size=64.0),
    "size_string": bad("size", size="64"),
    "size_none": bad("size", size=None),
    "size_bool": bad("size", size=True),
    "size_tuple_of_floats": bad("size", size=(64.0,)),
    "size_empty_tuple": bad("size", size=()),
    "op_max": bad("op", op="max"),
    "op_none": bad("op", op=None),
    "op_list": bad("op", op=["sum"]),
    "algorithm_unknown": bad("algorithm", algorithm="ring"),
    "algorithm_none": bad("algorithm", algorithm=None),
    "algorithm_list": bad("algorithm", algorithm=["dense"]),
    "knobs_string": bad("knobs", knobs="mode=pad"),
    "knobs_unknown_name": bad("knobs", knobs={"no_such_knob": 1}),
    "knobs_wrong_type": bad("knobs", knobs={"mode": 3, "boundary_refresh": "often"}),
    "knobs_bad_choice": bad("knobs", knobs={"mode": "fastest", "gather_mode": "fastest"}),
    "knobs_non_string_keys": bad("knobs", knobs={1: 2}),
    "name_int": bad("name", name=7),
    "policy_int": bad("policy", policy=7, algorithm="auto"),
    "policy_missing_file": bad("policy", policy="/nonexistent/policy.yaml", algorithm="auto"),
    "group_string": Case(  # rank 0 means the default group too: rank 1's error travels over it
        lambda rank, algorithm: _call(rank, algorithm, {"group": "world" if rank else dist.group.WORLD},
                                      everyone=True), "bad", "group"),
    # -- shapes and sizes
    "values_0d": bad("values", indices=lambda: torch.tensor([2]), values=lambda: torch.tensor(1.0)),
    "indices_0d": bad("indices", indices=lambda: torch.tensor(2), values=lambda: torch.ones(1)),
    "indices_2d": bad("indices", indices=lambda: torch.tensor([[3, 1]]), values=lambda: torch.ones(1)),
    "length_mismatch": bad("values", values=lambda: torch.ones(4)),
    "size_zero": bad("size", size=0),
    "size_negative": bad("size", size=-1),
    "size_too_small": bad("indices", size=63),
    "size_rows_disagree_with_values": bad("size", size=(SIZE, 4)),
    "index_negative": bad("indices", indices=lambda: torch.tensor([3, -1, 3, 63, 11])),
    "index_int64_max": bad("indices", indices=lambda: torch.tensor([3, 1, 3, 63, 2**63 - 1])),
    "index_int64_min": bad("indices", indices=lambda: torch.tensor([3, 1, 3, 63, -(2**63)])),
    "indices_on_meta": bad("indices", indices=lambda: torch.ones(5, dtype=torch.int64, device="meta")),
    "values_nested": bad("values", values=lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])),
    # -- disagreements
    "size_differs": mismatch(size=SIZE + 1),
    "dtype_differs": mismatch(values=lambda: _values(1).double()),
    "row_shape_differs": mismatch(values=lambda: torch.ones(5, 2)),
    "row_shape_same_numel": Case(
        lambda rank, algorithm: _call(rank, algorithm, {"values": _row_view(5, (2, 3) if rank else (3, 2))},
                                      everyone=True),
        "mismatch"),
    "op_differs": mismatch(op="avg"),
    # -- awkward but valid
    "values_nan_inf": ok(everyone=False, values=lambda: torch.tensor([float("nan"), 2.0, float("inf"), -float("inf"), -0.0])),
    "values_require_grad": ok(values=lambda: _values(1).requires_grad_()),
    "values_require_grad_unique_negative_zero": ok(indices=lambda: torch.tensor([3, 1, 10, 11, 63]),
                                            values=lambda: torch.tensor([-0.0, 1.0, 2.0, 3.0, 4.0]).requires_grad_()),
    "values_transposed_rows": ok(values=lambda: torch.arange(10.0).view(2, 5).t()),
    "values_expanded_rows": ok(values=lambda: torch.ones(1, 3).expand(5, 3)),
    "indices_strided": ok(indices=lambda: torch.tensor([3, 0, 1, 0, 3, 0, 63, 0, 11, 0])[::2]),
    "indices_int32": ok(indices=lambda: _indices(1).int()),
    "empty_on_one_rank": ok(everyone=False, indices=lambda: torch.empty(0, dtype=torch.int64), values=lambda: torch.empty(0)),
    "all_duplicates": ok(indices=lambda: torch.full((5,), 9)),
    "size_numpy_int": ok(size=lambda: __import__("numpy").int64(SIZE)),
    "size_huge_sparse": Case(lambda rank, algorithm: _call(rank, algorithm, {"size": 2**62}, everyone=True), "ok",
                             only=NEVER_DENSE),
    "float16_values": Case(
        lambda rank, algorithm: _call(rank, algorithm, {"values": lambda: _values(rank).half()}, everyone=True), "ok"),
    "bfloat16_rows": Case(
        lambda rank, algorithm: _call(rank, algorithm, {"values": lambda: torch.full((5, 3), 0.25 + rank,
                                                                                     dtype=torch.bfloat16)},
                                      everyone=True), "ok"),
}


# ------------------------------------------------------------------ rank functions


def _result(res: Any) -> dict:
    return {"indices": res.indices.clone(), "values": res.values.detach().clone(), "algorithm": res.algorithm}


def _reference(case: Case, algorithm: str, world_size: int) -> torch.Tensor:
    """The exact sum of every rank's input, densified, in fp64 (NaN and inf as IEEE sums give them)."""
    total = None
    for r in range(world_size):
        kw = case.build(r, algorithm)
        size = kw["size"]
        n = int(size[0] if isinstance(size, tuple) else size)
        values = kw["values"].detach().to(torch.float64)
        dense = torch.zeros((n,) + tuple(values.shape[1:]), dtype=torch.float64)
        dense.index_add_(0, kw["indices"].long(), values)
        total = dense if total is None else total + dense
    return total


def _recovery(rank: int, world_size: int, group: Any) -> bool:
    import colltune

    res = colltune.sparse_allreduce(torch.tensor([rank, 7]), torch.tensor([1.0, float(rank)]), 10, group=group,
                                 algorithm="allgather")
    want = torch.zeros(10)
    for r in range(world_size):
        want[r] += 1.0
        want[7] += float(r)
    return bool(torch.equal(res.to_dense(), want))


def _run_call(kw: dict) -> Any:
    import colltune

    kw = dict(kw)
    return colltune.sparse_allreduce(kw.pop("indices"), kw.pop("values"), kw.pop("size"), **kw)


def _wait(kw: dict) -> Any:
    return _run_call(dict(kw, async_op=True)).wait()


def _rank_case(rank: int, world_size: int, name: str, algorithm: str, async_op: bool = False) -> dict:
    case = CASES[name]
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        kw = case.build(rank, algorithm)
        kw.setdefault("group", group)
        if kw["group"] is None:
            kw["group"] = group
        out: dict[str, Any] = {}
        call = _wait if async_op else _run_call
        if case.expect == "ok":
            out["result"] = _result(call(kw))
            # The same call down the path CUDA tensors take (torch instead of NumPy): the same bits.
            with device_path():
                out["device_result"] = _result(call(case.build(rank, algorithm) | {"group": kw["group"]}))
            if rank == 0 and name != "size_huge_sparse":
                out["reference"] = _reference(case, algorithm, world_size)
        else:
            out["raised"] = expect_error(call, kw)
        out["after"] = _recovery(rank, world_size, group)
    finally:
        dist.destroy_process_group(group)
    out["after_world"] = _recovery(rank, world_size, None)
    return out


# ------------------------------------------------------------------ checks


def _params() -> list:
    """Every case on every algorithm it applies to; the wrong ones once more asynchronously (``wait()`` raises)."""
    sync = [pytest.param(name, a, False, id=f"{name}-{a}") for name, case in CASES.items() for a in case.only]
    async_ = [pytest.param(name, case.only[-1], True, id=f"{name}-{case.only[-1]}-async")
              for name, case in CASES.items() if case.expect != "ok"]
    return sync + async_


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    width = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(width), b.contiguous().view(width)))


def _check_ok(name: str, out: list) -> None:
    r0, r1 = out[0]["result"], out[1]["result"]
    assert torch.equal(r0["indices"], r1["indices"]), f"{name}: ranks got different indices"
    assert _same_bits(r0["values"], r1["values"]), f"{name}: ranks got different value bits"
    for r, o in enumerate(out):
        dev = o["device_result"]
        if dev["algorithm"] == o["result"]["algorithm"]:
            assert torch.equal(dev["indices"], r0["indices"]) and _same_bits(dev["values"], r0["values"]), (
                f"{name}: rank {r}: the device path gave other bits than the host path"
            )
    ref = out[0].get("reference")
    if ref is None:
        return
    got = torch.zeros_like(ref)
    if r0["indices"].numel():
        got[r0["indices"]] = r0["values"].to(torch.float64)
    union = ref.reshape(ref.shape[0], -1).ne(0).any(1) | ref.reshape(ref.shape[0], -1).isnan().any(1)
    assert set(r0["indices"].tolist()) >= set(union.nonzero().view(-1).tolist()), f"{name}: rows missing"
    tol = 1e-2 if r0["values"].dtype in (torch.float16, torch.bfloat16) else 1e-6
    assert torch.allclose(got, ref, rtol=tol, atol=tol, equal_nan=True), f"{name}: {got} != {ref}"


def _check_raised(name: str, case: Case, out: list) -> None:
    for r, o in enumerate(out):
        raised = o["raised"]
        assert raised.raised, f"{name}: rank {r} did not raise (returned {raised.returned})"
        assert raised.isa("ColltuneError"), f"{name}: rank {r} raised {raised.type}: {raised.message}"
        assert raised.elapsed < FAST_S, f"{name}: rank {r} took {raised.elapsed:.1f} s to raise"
    if case.expect == "mismatch":
        for r, o in enumerate(out):
            assert o["raised"].isa("RankMismatchError"), f"{name}: rank {r}: {o['raised'].type}: {o['raised'].message}"
        return
    own, remote = out[1]["raised"], out[0]["raised"]
    assert not own.isa("RemoteInputError"), f"{name}: the bad rank should raise its own error: {own.message}"
    assert case.word in own.message, f"{name}: rank 1's message does not name {case.word!r}: {own.message}"
    assert remote.isa("RemoteInputError"), f"{name}: rank 0 raised {remote.type}: {remote.message}"
    assert "rank 1" in remote.message and f"'{case.word}'" in remote.message, (
        f"{name}: rank 0's message should name rank 1 and {case.word!r}: {remote.message}"
    )


@pytest.mark.parametrize("name, algorithm, async_op", _params())
def test_bad_input_battery(name: str, algorithm: str, async_op: bool) -> None:
    case = CASES[name]
    out = pool(2).run(_rank_case, name, algorithm, async_op, timeout=4 * GROUP_TIMEOUT_S)
    if case.expect == "ok":
        _check_ok(name, out)
    else:
        _check_raised(name, CASES[name], out)
    for r, o in enumerate(out):
        assert o["after"], f"{name}: rank {r}: a valid call on the case's group went wrong after the case"
        assert o["after_world"], f"{name}: rank {r}: a valid call on the default group went wrong after the case"



# ------------------------------------------------------------------ top-k


def _topk_call(rank: int, algorithm: str, override: dict | None = None, everyone: bool = False) -> dict:
    import colltune

    kw: dict[str, Any] = {
        "tensor": torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)),
        "state": colltune.TopkState(k=12),
        "algorithm": algorithm,
    }
    if override is not None and (everyone or rank == 1):
        kw.update({k: (v() if callable(v) else v) for k, v in override.items()})
    return kw


def _state_of(numel: int) -> Any:
    import colltune

    st = colltune.TopkState(k=12)
    st.residual = torch.zeros(numel)
    return st


TOPK_CASES: dict[str, tuple[Callable[[int, str], dict], str, str]] = {
    "int_tensor": (lambda r, a: _topk_call(r, a, {"tensor": lambda: torch.arange(128)}), "bad", "tensor"),
    "empty_tensor": (lambda r, a: _topk_call(r, a, {"tensor": lambda: torch.empty(0)}), "bad", "tensor"),
    "sparse_tensor": (lambda r, a: _topk_call(r, a, {"tensor": lambda: torch.eye(8).to_sparse()}), "bad", "tensor"),
    "meta_tensor": (lambda r, a: _topk_call(r, a, {"tensor": lambda: torch.ones(8, 16, device="meta")}), "bad",
                    "tensor"),
    "list_tensor": (lambda r, a: _topk_call(r, a, {"tensor": [1.0, 2.0]}), "bad", "tensor"),
    "state_not_a_state": (lambda r, a: _topk_call(r, a, {"state": "state"}), "bad", "state"),
    "state_of_another_tensor": (lambda r, a: _topk_call(r, a, {"state": lambda: _state_of(64)}), "bad", "state"),
    "op_max": (lambda r, a: _topk_call(r, a, {"op": "max"}), "bad", "op"),
    "knobs_list": (lambda r, a: _topk_call(r, a, {"knobs": [("mode", "pad")]}), "bad", "knobs"),
    "shape_differs": (lambda r, a: _topk_call(r, a, {"tensor": lambda: torch.randn(16, 8)}), "mismatch", ""),
    "k_differs": (lambda r, a: _topk_call(r, a, {"state": lambda: __import__("colltune").TopkState(k=13)}), "mismatch",
                  ""),
    "nan_and_inf": (lambda r, a: _topk_call(r, a, {"tensor": lambda: torch.tensor(
        [float("nan"), float("inf"), -float("inf")] + [0.01] * 125).view(8, 16)}, everyone=True), "ok", ""),
}


def _rank_topk_case(rank: int, world_size: int, name: str, algorithm: str) -> dict:
    import colltune

    build, expect, _ = TOPK_CASES[name]
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        kw = build(rank, algorithm)
        call = lambda: colltune.topk_allreduce(group=group, **kw)  # noqa: E731
        out: dict[str, Any] = {}
        if expect == "ok":
            res = call()
            out["result"] = res.to_dense().clone()
            out["residual"] = kw["state"].residual.clone()
        else:
            out["raised"] = expect_error(call)
        out["after"] = _recovery(rank, world_size, group)
    finally:
        dist.destroy_process_group(group)
    out["after_world"] = _recovery(rank, world_size, None)
    return out


@pytest.mark.parametrize("name, algorithm", [pytest.param(n, a, id=f"{n}-{a}") for n in TOPK_CASES for a in ALGORITHMS])
def test_topk_bad_input_battery(name: str, algorithm: str) -> None:
    build, expect, word = TOPK_CASES[name]
    out = pool(2).run(_rank_topk_case, name, algorithm, timeout=4 * GROUP_TIMEOUT_S)
    if expect == "ok":
        assert _same_bits(out[0]["result"], out[1]["result"]), f"{name}: ranks got different bits"
        # NaN and the infinities are the largest magnitudes: every algorithm delivers them (none stays behind).
        got = out[0]["result"].view(-1)[:3]
        assert got[0].isnan() and got[1] == float("inf") and got[2] == -float("inf"), f"{name}: {got}"
        for r, o in enumerate(out):
            assert o["residual"][:3].eq(0).all(), f"{name}: rank {r} kept {o['residual'][:3]} in its residual"
    else:
        _check_raised(name, Case(lambda r, a: {}, expect, word), out)
    for r, o in enumerate(out):
        assert o["after"] and o["after_world"], f"{name}: rank {r}: a valid call went wrong after the case"


# ------------------------------------------------------------------ subgroups that differ per rank


def _rank_other_groups(rank: int, world_size: int, timeout_s: float) -> dict:
    import time

    import colltune

    groups = [dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout_s)) for _ in range(2)]
    t0 = time.monotonic()
    raised = expect_error(colltune.sparse_allreduce, _indices(rank), _values(rank), SIZE, group=groups[rank % 2],
                          algorithm="allgather")
    raised.elapsed = time.monotonic() - t0
    for g in groups:
        dist.destroy_process_group(g)
    return {"raised": raised, "after_world": _recovery(rank, world_size, None)}


def test_ranks_that_pass_different_groups_raise_at_the_group_timeout() -> None:
    """Two groups never exchange: no record can tell them apart, so the group's timeout ends the call.

    Both ranks raise within the timeout of the group they passed plus a few
    seconds, and the default group still works.
    """
    timeout_s = 3.0
    out = pool(2).run(_rank_other_groups, timeout_s, timeout=60)
    for r, o in enumerate(out):
        assert o["raised"].raised, f"rank {r} returned {o['raised'].returned}"
        assert o["raised"].elapsed < timeout_s + FAST_S, f"rank {r} took {o['raised'].elapsed:.1f} s"
        assert o["after_world"], f"rank {r}: the default group went wrong after the case"


def _rank_destroyed_group(rank: int, world_size: int) -> dict:
    import colltune

    g = dist.new_group(list(range(world_size)))
    before = _recovery(rank, world_size, g)  # the group's rank, size and backend are now known to colltune
    dist.destroy_process_group(g)
    raised = expect_error(colltune.sparse_allreduce, _indices(rank), _values(rank), SIZE, group=g, algorithm="allgather")
    return {"before": before, "raised": raised, "after_world": _recovery(rank, world_size, None)}


def test_a_call_on_a_destroyed_group_raises_torchs_error_on_every_rank() -> None:
    """What colltune knows of a group it used does not outlive the group: torch says it is gone, at once."""
    for r, o in enumerate(pool(2).run(_rank_destroyed_group, timeout=60)):
        assert o["before"] and o["after_world"], (r, o)
        assert o["raised"].raised and "not registered" in o["raised"].message, (r, o["raised"])
        assert o["raised"].elapsed < FAST_S, (r, o["raised"])
