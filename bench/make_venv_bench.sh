#!/usr/bin/env bash
# Makes the benchmark venv that holds TransferQueue (never a dependency of msrl_core) beside the
# project venv, reusing the project venv's packages (torch, ray, numpy, tensordict) instead of
# installing them again: the new venv sees the base interpreter's site-packages (as the project venv
# does) plus the project venv's through a .pth file, and pip installs only what is missing, with
# torch/ray/numpy/tensordict constrained to the versions already installed (an unpinned torch would
# pull a CUDA build of several GB).
#
#   bench/make_venv_bench.sh [PROJECT_VENV (default .venv)] [NEW_VENV (default .venv-bench)]
#
# msrl_core itself comes from PYTHONPATH=src with an in-place build (or from the project venv).
set -euo pipefail
BASE=$(realpath "${1:-.venv}")
NEW=$(realpath -m "${2:-.venv-bench}")
"$BASE/bin/python" -m venv --system-site-packages "$NEW"
"$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
  >"$("$NEW/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_project_venv.pth"
"$BASE/bin/python" - >"$NEW/constraints.txt" <<'EOF'
from importlib.metadata import PackageNotFoundError, version
for name in ("torch", "ray", "numpy", "tensordict"):
    try:
        print(f"{name}=={version(name).split('+')[0]}")
    except PackageNotFoundError:
        pass
EOF
grep -q '^torch==' "$NEW/constraints.txt" || { echo "no torch in $BASE: install the project venv first" >&2; exit 1; }
"$NEW/bin/python" -m pip install -q -c "$NEW/constraints.txt" transferqueue==0.1.11
"$NEW/bin/python" -c 'import torch, ray, transfer_queue; print("venv-bench ok: torch", torch.__version__, "ray", ray.__version__)'
