"""Shared pytest setup: the process-wide selector decides from the profile alone; stop the rank pools at the end.

The tests are organised by layer: ``unit/`` needs no process group (the pure
layer, the package's shape and tooling), ``distributed/`` runs ranks on gloo
(the algorithms, the front door, the selector, training, the launcher), and
``cli/`` runs the ``colltune`` command. ``harness`` and ``sparse_cases``, here,
serve them all (pytest puts this directory on ``sys.path``).

With online correction on, an ``auto`` call's algorithm follows the times
measured on this (shared, noisy) machine, and so may differ from one call
to the next: tests that compare ``auto``'s bits or decisions across calls
need the profile's decision. ``COLLTUNE_ONLINE=0`` here (inherited by every
rank and command the tests start) turns it off for the process-wide
selector; the online-correction tests build selectors with it on
(``environ={}``, or ``online=True``).
"""

from __future__ import annotations

import os

os.environ.setdefault("COLLTUNE_ONLINE", "0")


def pytest_sessionfinish(session, exitstatus):
    import harness

    harness.shutdown_pools()
