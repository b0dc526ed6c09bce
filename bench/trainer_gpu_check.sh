#!/usr/bin/env bash
# The trainer's GPU check, one prepared script for a session with a lent NVIDIA GPU (under 5 minutes):
# a few GRPO demo steps with trainer.device=cuda (rollout.engine=vllm when vLLM is importable, else hf),
# first with the Megatron engine (TP 1), then with the HF engine; prints each step's metrics line and the
# weight-sync check (training/rollout_probs_diff_max / _mean) from metrics.jsonl.
# Usage (repository root): bash bench/trainer_gpu_check.sh [OUT_DIR]   (default: build/trainer_gpu)
# Not run yet: no GPU machine was lent to the task that wrote it.
set -uo pipefail
out=${1:-build/trainer_gpu}
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt" || true
if ! $PY -c "import msrl_core._core" 2>/dev/null; then  # build the extension into src/ when not carried
  cmake -S . -B build/py -G Ninja -DCMAKE_BUILD_TYPE=Release -DMSRL_BUILD_PYTHON=ON -DMSRL_BUILD_TESTS=OFF \
    -DPython_EXECUTABLE="$(command -v $PY)" -Dpybind11_DIR="$($PY -m pybind11 --cmakedir)" >/dev/null
  cmake --build build/py -j 8 --target _core && cp build/py/_core*.so src/msrl_core/
fi
$PY - <<'PY' | tee "$out/env.txt"
import importlib.util, torch
from msrl_core.trainer.engines import available_devices, select_device
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print("available", available_devices(), "auto ->", select_device("auto"), "vllm", importlib.util.find_spec("vllm") is not None)
PY
device=${MSRL_CHECK_DEVICE:-cuda}  # MSRL_CHECK_DEVICE=cpu: a dry run of this script on a CPU machine
rollout=hf
$PY -c "import vllm" 2>/dev/null && rollout=vllm
steps=${MSRL_CHECK_STEPS:-3}          # bench/device_check.sh runs 2 per engine
engine_timeout=${MSRL_CHECK_ENGINE_TIMEOUT:-130}
common=(trainer.device=$device rollout.engine=$rollout trainer.steps=$steps trainer.val_every=0 trainer.save_every=0
        demo.warmup_steps=5 data.global_batch_size=8 rollout.n=4 actor.ppo_mini_batch_size=8 actor.micro_batch_size=16 --no-progress)
status=0
for engine in megatron hf; do
  run="$out/run_$engine"
  echo "== actor.engine=$engine actor.tp=1 rollout.engine=$rollout trainer.device=$device"
  timeout $engine_timeout $PY -m msrl_core.cli demo actor.engine=$engine actor.tp=1 trainer.output_dir="$run" "${common[@]}" \
    > "$out/$engine.log" 2>&1
  rc=$?
  grep -E "^step|error|Error" "$out/$engine.log" | tail -20
  echo "exit code $rc"
  [ $rc -ne 0 ] && { status=1; tail -30 "$out/$engine.log"; }
  [ -f "$run/metrics.jsonl" ] && $PY - "$run/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if "grpo/score/mean" in m:
        print(f"step {m['step']}: score {m['grpo/score/mean']:.3f} probs_diff_max {m['training/rollout_probs_diff_max']:.2e} "
              f"mean {m['training/rollout_probs_diff_mean']:.2e} pg_loss {m['actor/pg_loss']:+.4f} "
              f"e2e_tps {m['e2e_tps']:.0f} resharding_to_infer {m['timing/resharding_to_infer']:.4f}s")
PY
done
exit $status
