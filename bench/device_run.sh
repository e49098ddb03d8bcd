#!/usr/bin/env bash
# The GPU checks on a machine lent by the device tool, from the repository root, with the wheels
# that `python -m bench.device_kit` put in .whl carried. Two calls fit the tool's 10 minutes a call:
#
#     command: bash bench/device_run.sh gpu             carry: [".whl"]   timeout_s: 540
#     command: bash bench/device_run.sh wake failover   carry: [".whl"]   timeout_s: 320
#
# (the two together, with the machine's start, about the 15 minutes a session has; no argument:
# all three, for a machine without those limits). Or one call, the budget its limit less a margin
# (on the H100 of 2026-11-26 wake took about a minute, gpu under four):
#
#     command: DEVICE_RUN_BUDGET_S=500 bash bench/device_run.sh wake failover gpu   timeout_s: 530 It installs the wheels beside the
# image's own packages (its python3 has torch, transformers and nvidia-ml-py), then runs each check
# named, one after the other, under a limit of its own so that one that hangs leaves the next its
# time: gpu = bench.gpu (the `gpu` tests, the probe, the stack), wake = bench.wake --device cuda,
# failover = bench.failover --device cuda, serve = bench.serve --device cuda (serving throughput:
# the engine, the stack and transformers' generate, 1 and 8 GiB bf16 Llamas), deep = bench.deep_sleep
# --device cuda (a deep sleeper's wake from its host copy beside a load and a wake), start =
# bench.replica_start --device cuda --deep (a deep sleeper's wake through the supervisor: a fresh
# interpreter, a fork of the template and the GPU's warm spare, its context made before the
# start), prefix = bench.prefix_cache --device cuda (time to first token of prompts that begin
# alike, with the prefix cache and without, on a 512 MiB Llama), and, named only (not in the default three), placement =
# bench.placement on the lent machine's CPUs (16 cores against this project's 2: the placement
# throughput measured where PostgreSQL and the web process do not share two cores; its own
# section, placement-device, in BENCHMARKS.md). What comes back under $OUT: each check's log and
# BENCHMARKS.md as the checks recorded it there (bench.gpu records only a complete run), whose
# sections go into the repository's BENCHMARKS.md. With DEVICE_RUN_BUDGET_S set (the call's
# timeout_s less a margin), each check's limit is also cut to what the budget has left, so that one
# call can run all three and still bring back every log (a check with under 20 s left is skipped,
# saying so). DEVICE_GPU_PARTS picks bench.gpu's parts (default tests,probe,stack) and
# DEVICE_GPU_LIMIT_S its limit (default 480 s), so that one call can also leave serve its minutes:
#
#     command: DEVICE_RUN_BUDGET_S=560 DEVICE_GPU_PARTS=tests,stack DEVICE_GPU_LIMIT_S=300
#              bash bench/device_run.sh gpu serve                  carry: [".whl"]   timeout_s: 590
#
# Exit: 0 every check passed, 1 one failed, ran out of time or was skipped, 2 an unknown check, 3
# the wheels did not install or a module the checks import is missing.
set -uo pipefail
checks=(${@:-gpu wake failover})
for one in "${checks[@]}"; do
    case $one in
        gpu | wake | failover | serve | placement | deep | start | prefix) ;;
        *) echo "device_run: unknown check $one (expected gpu, wake, failover, serve, placement, deep, start or prefix)"; exit 2 ;;
    esac
done
OUT=${OUT:-/tmp/gpuportal-device}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_run: the carried wheels did not install (python -m bench.device_kit --check here)"; exit 3; }
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The kit carries only what the image lacks, by a list of the image's packages read on 2026-11-17:
# a package the image has dropped since shows here, by name, before any check spends its minutes.
python3 -c 'import importlib.util as u, sys; gone = [m for m in sys.argv[1:] if u.find_spec(m) is None]
sys.exit("device_run: not on this machine: " + " ".join(gone) + " (see bench/device_kit.py)" if gone else 0)' \
    django celery rest_framework psycopg redis pytest torch transformers accelerate pynvml pytest_django || exit 3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"

status=0
budget=${DEVICE_RUN_BUDGET_S:-}
check() {
    local name=$1 limit=$2
    shift 2
    if [ -n "$budget" ]; then
        # SECONDS: since the script started, the wheels' installation included.
        local left=$((budget - SECONDS - 10))
        [ "$left" -lt "$limit" ] && limit=$left
        if [ "$limit" -lt 20 ]; then
            echo "== $name: skipped, ${left} s left of the ${budget} s budget" | tee "$OUT/$name.log"
            status=1
            return
        fi
    fi
    echo "== $name (at most ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$OUT/$name.log"
    echo "== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}
for one in "${checks[@]}"; do
    case $one in
        gpu) check gpu "${DEVICE_GPU_LIMIT_S:-480}" python3 -m bench.gpu --parts "${DEVICE_GPU_PARTS:-tests,probe,stack}" ;;
        serve) check serve 300 python3 -m bench.serve --device cuda ;;
        wake) check wake 110 python3 -m bench.wake --device cuda --sizes 512,1024,4096 --repeats 2 ;;
        failover) check failover 170 python3 -m bench.failover --device cuda --trials 5 --baseline-trials 1 ;;
        deep) check deep 120 python3 -m bench.deep_sleep --device cuda --sizes 512,2048 --repeats 2 ;;
        start) check start 150 python3 -m bench.replica_start --device cuda --deep --size-mb 1024 --starts 3 ;;
        prefix) check prefix 120 python3 -m bench.prefix_cache --device cuda --size-mb 512 --system 4096 ;;
        placement) check placement 200 python3 -m bench.placement --seconds 3 --cpu --section placement-device ;;
    esac
done
cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
exit "$status"
