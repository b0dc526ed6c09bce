#!/usr/bin/env bash
# The device check of msrl_core, one script for a lent machine (one NVIDIA GPU; written for the H200 image:
# torch 2.11 + CUDA 13, Python 3.12, no package registry). At most MSRL_CHECK_BUDGET_S seconds (default 470:
# inside 8 minutes) in all: every step runs under its own timeout, cut to what is left of the budget.
#
#   OUT=<dir> bash bench/device_check.sh      (the device tool sets $OUT; default build/device_check/out)
#
# Carry the ignored .whl/ folder (`make device-wheels`: megatron-core, omegaconf, pybind11, scikit-build-core,
# ~3.4 MB); nothing else is needed: the script builds _core and msrl_bandwidth itself (build/device_check/).
# Steps: environment and runtime discovery; wheels; one build; runtime discovery in a process without torch;
# the device smoke test (bench/device_smoke.py); msrl_bandwidth and bench/copy_bench.py with same-run
# baselines (torch's copies in copy_bench); bench/reshard_gpu_check.py (verify=True, the naive switch as the
# torch baseline); two trainer steps per engine (bench/trainer_gpu_check.sh). Each step ends with a
# "=== [step] PASS|FAIL|NOT RUN" line; the last line of the log is "N passed, M failed".
#
# On a machine without a GPU it is a dry run on the host backend: the steps that need a GPU say so (NOT RUN)
# and the others run for real (a smaller bandwidth size, a smaller reshard model). No `set -e`: a failed step
# is reported and the next one runs. Everything is tee'd into $OUT/device_check.log; JSON lines of each step
# go to $OUT/<step>.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/device_check/out}
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
PY=${PYTHON:-python3}
BUDGET=${MSRL_CHECK_BUDGET_S:-470}
START=$(date +%s)
BUILD=${MSRL_CHECK_BUILD_DIR:-build/device_check}
DEPS="$BUILD/pydeps"
export PYTHONPATH="$PWD/src:$PWD/bench:$PWD/$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
passed=0
failed=0
notrun=0
declare -a summary

left() { echo $((BUDGET - ($(date +%s) - START))); }

# record NAME STATUS SECONDS [DETAIL]
record() {
  case $2 in
    PASS) passed=$((passed + 1)) ;;
    FAIL) failed=$((failed + 1)) ;;
    *) notrun=$((notrun + 1)) ;;
  esac
  summary+=("$(printf '%-12s %-8s %4ss %s' "$1" "$2" "$3" "${4:-}")")
  echo "=== [$1] $2 (${3}s) ${4:-}"
}

# step NAME LIMIT_S FUNCTION: runs FUNCTION (exported, in a child bash) under min(LIMIT, time left);
# rc 0 PASS, 77 NOT RUN, else FAIL.
step() {
  local name=$1 limit=$2 fn=$3
  local remaining
  remaining=$(left)
  if [ "$remaining" -lt 15 ]; then
    record "$name" "NOT RUN" 0 "the ${BUDGET}s budget is spent"
    return
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  echo "=== [$name] start (limit ${limit}s, ${remaining}s of the budget left)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" bash -o pipefail -c "$fn"
  local rc=$?
  local dt=$((SECONDS - t0))
  if [ $rc -eq 0 ]; then
    record "$name" PASS $dt
  elif [ $rc -eq 77 ]; then
    record "$name" "NOT RUN" $dt "needs a GPU (none here)"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    record "$name" FAIL $dt "timed out after ${limit}s"
  else
    record "$name" FAIL $dt "exit code $rc"
  fi
}

# ---------------------------------------------------------------------------------------------- steps

env_step() {
  echo "date $(date -u +%FT%TZ), host $(hostname), $(nproc) cores, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  echo "ldconfig: $(ldconfig -p 2>/dev/null | grep -c 'libcudart\.so') libcudart entries"
  ldconfig -p 2>/dev/null | grep 'libcudart\.so' | head -3
  $PY - <<'PY'
import json, platform, sys
info = {"python": sys.version.split()[0], "machine": platform.machine()}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count())
    if torch.cuda.is_available():
        torch.cuda.init()
        info["gpu"] = torch.cuda.get_device_name(0)
        with open("/proc/self/maps") as maps:
            libs = sorted({l.split()[-1] for l in maps if "libcudart.so" in l})
        info["torch_libcudart"] = libs
        if libs:
            open("build/device_check/cudart_path", "w").write(libs[0])
except Exception as e:
    info["torch_error"] = repr(e)
import importlib.util
for mod in ("numpy", "pybind11", "scikit_build_core", "cmake", "ninja", "omegaconf", "megatron", "transformers", "ray", "vllm"):
    info[mod] = importlib.util.find_spec(mod) is not None
print(json.dumps(info))
PY
}

wheels_step() {
  # Install what the image lacks from the carried wheels into $DEPS (on PYTHONPATH), nothing from a registry.
  mkdir -p "$DEPS"
  local want wheel name
  want=$($PY - <<'PY'
import importlib.util
need = {"omegaconf": ["omegaconf"], "megatron": ["megatron_core"], "pybind11": ["pybind11"],
        "scikit_build_core": ["scikit_build_core", "pathspec"]}
print(" ".join(w for mod, ws in need.items() if importlib.util.find_spec(mod) is None for w in ws))
PY
)
  for name in $want; do
    wheel=$(ls .whl/"$name"-*.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ]; then
      echo "missing wheel for $name in .whl/ (make device-wheels, and carry .whl)"
      return 1
    fi
    $PY -m pip install -q --no-index --no-deps --target "$DEPS" "$wheel" || return 1
  done
  echo "installed from .whl: ${want:-(nothing: the image has them)}"
  $PY -W ignore -c "import omegaconf, megatron.core, pybind11; print('omegaconf', omegaconf.__version__, 'megatron-core', megatron.core.__version__, 'pybind11', pybind11.__version__)"
}

build_step() {
  local gen=() jobs
  jobs=$(nproc)
  command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DMSRL_BUILD_PYTHON=ON -DMSRL_BUILD_BENCH=ON \
    -DMSRL_BUILD_TESTS=OFF -DPython_EXECUTABLE="$(command -v "$PY")" \
    -Dpybind11_DIR="$($PY -m pybind11 --cmakedir)" > "$BUILD.configure.log" 2>&1 || { tail -20 "$BUILD.configure.log"; return 1; }
  cmake --build "$BUILD" -j "$jobs" --target _core msrl_bandwidth 2>&1 | tail -3 || return 1
  cp "$BUILD"/_core*.so src/msrl_core/ || return 1
  $PY -c "import msrl_core, msrl_core._core as c; print('built', c.__file__)"
}

discovery_step() {
  # Runtime discovery in a process that has not imported torch (the CUDA 13 wheels' libcudart is not on the
  # loader path): runtime_info() must still select cuda on a GPU machine.
  env -u MSRL_CUDART_PATH $PY - <<'PY'
import json, sys
import msrl_core
from msrl_core import _core
assert "torch" not in sys.modules
info = msrl_core.runtime_info()
print(json.dumps({"no_torch": True, "selected": info["selected"], "cuda": info["backends"]["cuda"],
                  "cuda_library_dirs": _core.library_dirs("cuda")}))
import torch
gpu = torch.cuda.is_available()
if gpu and info["selected"] != "cuda":
    sys.exit("a GPU is here, but a process without torch did not find the CUDA runtime")
print(json.dumps({"torch_sees_gpu": gpu, "selected_after_torch": msrl_core.get_runtime().name}))
PY
}

smoke_step() { $PY bench/device_smoke.py | tee "$OUT/smoke.jsonl"; }

bandwidth_step() {
  local bin="$BUILD/bench/msrl_bandwidth" args=(--reps 5 --json)
  [ -x "$bin" ] || { echo "no $bin (the build step failed)"; return 1; }
  if [ "$GPU" = 1 ]; then
    args+=(--device cuda --bytes 268435456)
  else
    args+=(--device host --bytes 67108864)  # dry run: host backend, 64 MiB
  fi
  [ -f build/device_check/cudart_path ] && export MSRL_CUDART_PATH=$(cat build/device_check/cudart_path)
  "$bin" "${args[@]}" | tee "$OUT/bandwidth.jsonl"
}

copy_bench_step() {
  if [ "$GPU" = 1 ]; then
    MSRL_DEVICE=cuda $PY bench/copy_bench.py --reps 5 | tee "$OUT/copy_bench.jsonl"
  else  # the GPU cases' code on host memory
    MSRL_DEVICE=host $PY bench/copy_bench.py --reps 3 --host-dry-run | tee "$OUT/copy_bench.jsonl"
  fi
}

reshard_step() {
  if [ "$GPU" = 1 ]; then
    $PY bench/reshard_gpu_check.py --device cuda --reps 3 --verify | tee "$OUT/reshard.jsonl"
  else
    $PY bench/reshard_gpu_check.py --device cpu --layers 1 --reps 2 --verify | tee "$OUT/reshard.jsonl"
  fi
}

trainer_step() {
  [ "$GPU" = 1 ] || { echo "two trainer steps per engine with trainer.device=cuda: needs a GPU"; return 77; }
  local cap
  cap=$(left)
  [ "$cap" -gt 235 ] && cap=235  # inside the step's own limit (240 s): two engines, one after the other
  MSRL_CHECK_STEPS=2 MSRL_CHECK_ENGINE_TIMEOUT=$((cap / 2 - 5)) bash bench/trainer_gpu_check.sh "$OUT/trainer"
}

# ----------------------------------------------------------------------------------------------- run

export PY BUDGET START BUILD DEPS OUT
export -f left env_step wheels_step build_step discovery_step smoke_step bandwidth_step copy_bench_step reshard_step \
  trainer_step

main() {
  mkdir -p build/device_check
  rm -f build/device_check/cudart_path
  GPU=0
  $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && GPU=1
  export GPU
  echo "msrl_core device check: GPU=$GPU, budget ${BUDGET}s, out $OUT"
  [ "$GPU" = 1 ] || echo "no GPU here: a dry run on the host backend; the GPU-only steps report NOT RUN"

  step env 40 env_step
  [ -f build/device_check/cudart_path ] && echo "torch's libcudart: $(cat build/device_check/cudart_path)"
  step wheels 60 wheels_step
  step build 240 build_step
  step discovery 40 discovery_step
  step smoke 90 smoke_step
  step bandwidth 90 bandwidth_step
  step copy_bench 90 copy_bench_step
  step reshard 120 reshard_step
  step trainer 240 trainer_step

  echo "=== summary ($(( $(date +%s) - START ))s of ${BUDGET}s)"
  printf '%s\n' "${summary[@]}"
  [ "$notrun" -gt 0 ] && echo "$notrun step(s) not run"
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
