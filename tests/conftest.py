"""Shared pytest setup: stop the shared rank pools at the end.

The tests are organised by layer: ``unit/`` needs no process group (the pure
layer, the package's shape and tooling), ``distributed/`` runs ranks on gloo
(the algorithms, the front door, the selector, training, the launcher), and
``cli/`` runs the ``colltune`` command. ``harness`` and ``sparse_cases``, here,
serve them all (pytest puts this directory on ``sys.path``).
"""

from __future__ import annotations


def pytest_sessionfinish(session, exitstatus):
    import harness

    harness.shutdown_pools()
