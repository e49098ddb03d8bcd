#!/usr/bin/env bash
# The GPU checks in one call of the device tool, from the repository root, with the wheels that
# `python -m bench.device_kit` put in .whl carried:
#
#     command: bash bench/device_run.sh      carry: [".whl"]      timeout_s: 600
#
# It installs the wheels beside the image's own packages (its python3 has torch, transformers and
# nvidia-ml-py), then runs bench.gpu (the `gpu` tests, the probe, the stack), bench.wake and
# bench.failover on the GPU, one after the other, each under a limit of its own so that one that
# hangs leaves the rest their time, and all within the tool's 10 minutes. What comes back under
# $OUT: each check's log and BENCHMARKS.md as the checks recorded it there (bench.gpu records only a
# complete run), whose sections go into the repository's BENCHMARKS.md. Exit: 0 every check passed,
# 1 one failed or ran out of time, 3 the wheels did not install.
set -uo pipefail
OUT=${OUT:-/tmp/gpuportal-device}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_run: the carried wheels did not install (python -m bench.device_kit --check here)"; exit 3; }
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"

status=0
check() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$OUT/$name.log"
    echo "== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}
check gpu 330 python3 -m bench.gpu
check wake 110 python3 -m bench.wake --device cuda --sizes 512,1024,4096 --repeats 2
check failover 110 python3 -m bench.failover --device cuda --trials 5 --baseline-trials 2
cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
exit "$status"
