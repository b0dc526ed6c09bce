#!/usr/bin/env bash
# The GPU check of the native core, as one script for a lent NVIDIA machine (about 3 minutes):
# build, then the bandwidth benchmark on the cuda backend and the engine-vs-torch copies.
# Usage (repository root): bash bench/gpu_check.sh [OUT_DIR]   — JSON lines go to OUT_DIR (default: build/gpu).
# Not run yet: no GPU machine was lent to the tasks so far.
set -euo pipefail
out=${1:-build/gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pip install -q --no-build-isolation . 2>&1 | tail -2
cmake -S . -B build/bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DMSRL_BUILD_PYTHON=OFF -DMSRL_BUILD_BENCH=ON >/dev/null
cmake --build build/bench --target msrl_bandwidth
python3 -c "import msrl_core, json; print(json.dumps(msrl_core.runtime_info()))" | tee "$out/runtime.json"
build/bench/bench/msrl_bandwidth --device cuda --reps 9 --json | tee "$out/bandwidth_cuda.jsonl"
MSRL_DEVICE=cuda python3 bench/copy_bench.py --reps 9 | tee "$out/copy_bench_cuda.jsonl"
