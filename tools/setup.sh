#!/usr/bin/env bash
# Install colltune and its dependencies into the current Python.
#
# An installed torch (CPU or CUDA) is kept. Without one, the pinned CPU build
# torch==2.13.0 is installed first, so that resolving the other dependencies
# never pulls a multi-GB CUDA build onto a CPU-only machine.
#
# Usage: bash tools/setup.sh [--test]
#   colltune with its command line's extras ([cli]: scikit-learn, SciPy,
#   Optuna, tqdm, matplotlib); --test adds pytest, hypothesis, ruff and mypy,
#   at the versions in tools/constraints.txt (the ones the suite last passed with).
#   A training job alone needs only `pip install .` (torch, NumPy, PyYAML).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: no torch found; installing the pinned CPU build torch==2.13.0"
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
extra="[cli]"
constraints=()
if [[ "${1:-}" == "--test" ]]; then
    # The test environment is pinned (tools/constraints.txt): the suite's result does not depend on the day.
    extra="[cli,test]"
    constraints=(-c tools/constraints.txt)
fi
"$PY" -m pip install --quiet -e ".${extra}" "${constraints[@]}"
"$PY" -c "import torch, colltune; print(f'setup: colltune ready (torch {torch.__version__})')"
