"""Shared pytest setup: make the repository importable and stop the shared rank pools at the end."""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def pytest_sessionfinish(session, exitstatus):
    import harness

    harness.shutdown_pools()
