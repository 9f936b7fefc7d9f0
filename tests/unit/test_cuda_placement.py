"""Which GPU and which stream colltune's work goes to, checked without a GPU.

A call queued on colltune's worker thread keeps stream order with its caller.

torch.cuda's events, streams and device guard are replaced by fakes that log
what the call asks of them, per thread: the caller's stream is marked when
the call is queued, the worker's stream waits for that mark before the call
runs with the call's device current, and ``wait()`` makes the caller's stream
wait for the worker's mark after the call. A NCCL group's own gathers go to
the GPU it is bound to.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

from colltune import api
from colltune.algorithms import comm

DEVICE = torch.device("cuda", 2)


class _Stream:
    def __init__(self, log: list, device: torch.device) -> None:
        self.name = "worker" if threading.current_thread().name.startswith("colltune") else "caller"
        self.log, self.device = log, device

    def wait_event(self, event: "_Event") -> None:
        self.log.append(f"{self.name} stream of {self.device} waits for {event.mark}")


class _Event:
    def __init__(self, log: list) -> None:
        self.log, self.mark = log, None

    def record(self, stream: _Stream) -> None:
        self.mark = f"a mark on the {stream.name} stream of {stream.device}"
        self.log.append("recorded " + self.mark)


class _Cuda:
    """What the fakes saw, in order, and the current device per thread."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.current = threading.local()

    def current_device(self) -> str:
        return getattr(self.current, "device", "cuda:0")

    @contextlib.contextmanager
    def device(self, d: torch.device):
        before, self.current.device = self.current_device(), str(d)
        try:
            yield
        finally:
            self.current.device = before

    def call(self, name: str):
        def fn(wire):
            self.log.append(f"{name} runs with {self.current_device()} current")
            return name
        return fn


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> _Cuda:
    fake = _Cuda()
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Event(fake.log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: _Stream(fake.log, d))
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    return fake


def test_an_async_call_on_a_gpu_keeps_stream_order_with_its_caller(cuda: _Cuda) -> None:
    gate, run = threading.Event(), cuda.call("the call")
    handle = api.submit_call(lambda wire: (gate.wait(10), run(wire))[1], True, None, DEVICE)
    gate.set()  # the call finishes after its handle exists: its Future completes on the worker thread
    assert handle.wait() == "the call"
    assert handle._handoff.inputs is None  # marked as used on the worker's stream after the call, then let go
    assert cuda.log == [
        "recorded a mark on the caller stream of cuda:2",
        "worker stream of cuda:2 waits for a mark on the caller stream of cuda:2",
        "the call runs with cuda:2 current",
        "recorded a mark on the worker stream of cuda:2",
        # The handle's torch Future completes on the worker thread, whose callbacks follow the call there.
        "worker stream of cuda:2 waits for a mark on the worker stream of cuda:2",
        "caller stream of cuda:2 waits for a mark on the worker stream of cuda:2",
    ]


def test_a_sync_call_queued_behind_an_async_one_keeps_stream_order_too(cuda: _Cuda) -> None:
    gate = threading.Event()
    first = api.submit_call(lambda wire: gate.wait(10), True, None, DEVICE)  # holds the worker
    try:
        second = threading.Thread(target=lambda: cuda.log.append(api.submit_call(cuda.call("queued"), False, None,
                                                                                   DEVICE)))
        second.start()
    finally:
        gate.set()
    second.join(10)
    first.wait()
    log = cuda.log
    ran, returned = log.index("queued runs with cuda:2 current"), log.index("queued")
    assert log[ran - 1] == "worker stream of cuda:2 waits for a mark on the caller stream of cuda:2"
    assert "caller stream of cuda:2 waits for a mark on the worker stream of cuda:2" in log[ran:returned]


def test_the_tensors_of_inputs_and_results_are_found_for_the_allocator() -> None:
    """The handoff marks every tensor a call reads as used on the worker's stream, and every tensor its result
    holds as used on the caller's: in lists, tuples, results, delivered indices, sparse COO tensors."""
    from colltune.algorithms.base import Delivered, SparseResult

    a, b, c, d = (torch.zeros(1) for _ in range(4))
    fused = [SparseResult(a, b, 3, "allgather"), SparseResult(c, d, 3, "dense")]
    assert [id(t) for t in api._tensors_in(fused)] == [id(a), id(b), id(c), id(d)]
    topk = api.TopkResult(None, a, (3,), "allgather", 1, 1, Delivered(b, c))
    assert [id(t) for t in api._tensors_in(topk)] == [id(a), id(b), id(c)]
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, 3), (4, 3), check_invariants=True)
    found = api._tensors_in([(a, b, 3), coo, 7])
    assert [id(t) for t in found[:2]] == [id(a), id(b)] and [t.shape for t in found[2:]] == [(1, 2), (2, 3)]


def test_a_call_on_the_cpu_or_inline_asks_nothing_of_cuda(cuda: _Cuda) -> None:
    assert api.submit_call(cuda.call("inline"), False, None, DEVICE) == "inline"  # the caller's thread and stream
    assert api.submit_call(cuda.call("on cpu"), True, None, torch.device("cpu")).wait() == "on cpu"
    assert cuda.log == ["inline runs with cuda:0 current", "on cpu runs with cuda:0 current"]


def test_a_nccl_group_gathers_on_its_bound_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``init_process_group(device_id=cuda:3)`` without ``set_device``: the group's own collectives (the
    host layout, the training wrappers' plan check) use cuda:3, not the current device (GPU 0)."""
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(comm.torch.cuda, "current_device", lambda: 0)
    assert comm.group_device(SimpleNamespace(bound_device_id=torch.device("cuda", 3))) == torch.device("cuda", 3)
    assert comm.group_device(SimpleNamespace(bound_device_id=None)) == torch.device("cuda", 0)  # none bound
