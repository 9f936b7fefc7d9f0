#!/usr/bin/env bash
# Every GPU check and figure of the README's "On GPUs" section in one run, each step bounded in time.
#
#   bash tools/gpu_check.sh DIR            # on a machine with a GPU: about 9 minutes at most
#
# Writes into DIR: versions.txt (torch, CUDA, NCCL, the card, the commit), one log per step, calls.json
# (per-call times, syncs and kernels, with the machine's floor and the fused call), traces/ (where a
# call's host time goes) and host-fit.log (the NCCL profile's host terms fitted to calls.json). A step
# that fails or runs out of time is said (its exit status and the tail of its log) and the next one runs:
# the most important first, so that a short lease still brings back the tests and the per-call figures.
set -u
out=${1:?usage: bash tools/gpu_check.sh DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."

step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "   exit status $rc after $((SECONDS - start)) s$([ "$rc" = 124 ] && echo ', out of time')"
    tail -n 30 "$out/$name.log"
}

python3 - >"$out/versions.txt" 2>&1 <<'EOF'
import torch

print("torch", torch.__version__, "CUDA", torch.version.cuda)
if torch.cuda.is_available():
    print("NCCL", ".".join(map(str, torch.cuda.nccl.version())), "card", torch.cuda.get_device_name(0))
else:
    print("no CUDA device: tests/gpu skips, and the tools run on the CPU, whose figures say nothing of a GPU")
EOF
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" >>"$out/versions.txt"
cat "$out/versions.txt"

step gpu-tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu
step per-call 200 python3 tools/gpu_call_bench.py --rounds 15 --topk --fused --floor --json "$out/calls.json"
step host-fit 20 python3 tools/fit_host_cost.py "$out/calls.json"
step trace 80 python3 tools/gpu_call_bench.py --log-n 20 --density 1e-3 --rows 0 --rounds 5 --fused --trace "$out/traces"
step dlrm 100 python3 tools/dlrm.py --ranks 1 --device cuda --mode none none+fused-call colltune-fused
