"""The audit's own counts (``tests/dispatch_audit.py``): what it counts as a dispatched op."""

from __future__ import annotations

import torch
from dispatch_audit import audit
from torch.profiler import profile


def _profiled_ops(fn) -> list[str]:
    """The aten ops ``torch.profiler`` records for ``fn`` outside any dispatch mode."""
    with profile() as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("aten::")]


def test_a_dtype_view_counts_one_op_as_outside_the_audit():
    t = torch.randn(8)
    assert _profiled_ops(lambda: t.view(torch.uint8)) == ["aten::view"]  # no detach outside a dispatch mode
    with audit() as a:
        t.view(torch.uint8)
    assert dict(a.ops) == {"view": 1}


def test_detaches_the_code_makes_are_counted():
    t = torch.randn(8)
    assert "aten::detach" in _profiled_ops(lambda: t.numpy())  # Tensor.numpy detaches outside the audit too
    with audit() as a:
        u = t.view(torch.int32)
        u.detach()
        t.detach()
        t.numpy()
    assert dict(a.ops) == {"view": 1, "detach": 3} and dict(a.syncs) == {"Tensor.numpy": 1}
