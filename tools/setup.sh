#!/usr/bin/env bash
# Install colltune and its dependencies into the current Python (the README runs it inside a virtual environment).
#
# An installed torch (CPU or CUDA) is always kept. Without one, the pinned CPU build torch==2.13.0 is
# installed first, from PyTorch's CPU wheel index, so that resolving the other dependencies never pulls a
# multi-GB CUDA build onto a CPU-only machine. COLLTUNE_TORCH_INDEX_URL names another index (a mirror of
# it); set it empty to skip the index. When the index cannot be reached, the plain `pip install torch==2.13.0`
# runs instead (from the configured package index: on Linux x86-64 that is the CUDA build).
#
# Usage: bash tools/setup.sh [--test]
#   colltune with its command line's extras ([cli]: scikit-learn, SciPy,
#   Optuna, tqdm, matplotlib); --test adds pytest, hypothesis, ruff and mypy,
#   at the versions in tools/constraints.txt (the ones the suite last passed with).
#   A training job alone needs only `pip install .` (torch, NumPy, PyYAML).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH="torch==2.13.0"
INDEX="${COLLTUNE_TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"

# Whether the index answers within 15 s (a simple index lists each project under <index>/<project>/).
index_reachable() {
    "$PY" - "$1" <<'EOF' >/dev/null 2>&1
import os, sys, urllib.parse, urllib.request
url = sys.argv[1].rstrip("/") + "/torch/"
if url.startswith("file:"):
    sys.exit(0 if os.path.isdir(urllib.request.url2pathname(urllib.parse.urlparse(url).path)) else 1)
urllib.request.urlopen(url, timeout=15).close()
EOF
}

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    if [[ -z "$INDEX" ]]; then
        echo "setup: no torch found; installing $TORCH from the default index (COLLTUNE_TORCH_INDEX_URL is empty)"
        "$PY" -m pip install --quiet "$TORCH"
    elif index_reachable "$INDEX"; then
        echo "setup: no torch found; installing the pinned CPU build $TORCH from $INDEX"
        "$PY" -m pip install --quiet --index-url "$INDEX" "$TORCH"
    else
        echo "setup: no torch found and $INDEX cannot be reached; installing $TORCH from the default index instead"
        "$PY" -m pip install --quiet "$TORCH"
    fi
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
