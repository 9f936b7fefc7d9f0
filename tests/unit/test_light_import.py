"""A decision from the shipped profile costs no heavy import: the stored learned model runs on NumPy.

``import colltune``, loading the shipped gloo profile, rebuilding its learned
model and deciding an ``auto`` call must not import scikit-learn, SciPy,
matplotlib or Optuna: those serve fitting, tuning and reports only. The check
runs in a fresh interpreter, since this one may hold them already, and the
predictions made there must equal those made here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from colltune.model.features import Features
from colltune.select.selector import Selector

HEAVY = ("sklearn", "scipy", "matplotlib", "optuna")

#: Calls to predict: narrow and wide rows, two and four ranks, disjoint to overlapping indices.
CALLS = [
    {"numel": 1 << 16, "row_numel": 1, "dtype": "float32", "k_per_rank": [100, 100], "union": 150.0},
    {"numel": 1 << 20, "row_numel": 1, "dtype": "float32", "k_per_rank": [5000] * 4, "union": 20000.0},
    {"numel": 1 << 14, "row_numel": 64, "dtype": "float32", "k_per_rank": [300, 200], "union": 300.0},
]

_CHILD = """
import json, sys
import colltune
from colltune.model.features import Features
from colltune.select.selector import get_selector

calls = json.loads(sys.argv[1])
sel = get_selector()
model = sel.model("gloo")
feats = [Features.build(**c) for c in calls]
out = {
    "kind": model.kind,
    "predicted": [model.predict(f) for f in feats],
    "chosen": [sel.explain(f).choice.algorithm for f in feats],
    "heavy": sorted(m for m in %r if m in sys.modules),
}
print(json.dumps(out))
""" % (HEAVY,)


def _run_child() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLTUNE_")}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(CALLS)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_decision_from_the_shipped_profile_imports_no_heavy_dependency() -> None:
    got = _run_child()
    assert got["heavy"] == [], f"deciding from the shipped profile imported {got['heavy']}"
    assert got["kind"] == "learned"  # the stored model, evaluated on NumPy, not the analytic fallback

    sel = Selector(environ={})
    model = sel.model("gloo")
    assert model is not None
    feats = [Features.build(**c) for c in CALLS]
    assert got["predicted"] == [model.predict(f) for f in feats]
    assert got["chosen"] == [sel.explain(f).choice.algorithm for f in feats]
