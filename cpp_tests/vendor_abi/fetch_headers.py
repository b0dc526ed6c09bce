"""Fetch NVIDIA's and Huawei's own runtime headers for the vendor ABI conformance test.

Usage: python cpp_tests/vendor_abi/fetch_headers.py DEST

The headers come from the vendors' wheels on PyPI, downloaded with `pip download --no-deps` (never
installed) and unpacked, headers only, into DEST/<set>/include. A set whose VERSION file names the pinned
wheels is complete and is not downloaded again. The wheels are deleted after unpacking.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# set name -> [(pinned requirement, folder inside the wheel, folder under <set>/include)]. The CUDA runtime
# wheels lack crt/host_defines.h, which cuda_runtime_api.h includes: it comes from the compiler's wheel.
PINS: dict[str, list[tuple[str, str, str]]] = {
    "cuda12": [
        ("nvidia-cuda-runtime-cu12==12.9.79", "nvidia/cuda_runtime/include/", ""),
        ("nvidia-cuda-nvcc-cu12==12.9.86", "nvidia/cuda_nvcc/include/crt/", "crt/"),
    ],
    "cuda13": [
        ("nvidia-cuda-runtime==13.5.37", "nvidia/cu13/include/", ""),
        ("nvidia-cuda-crt==13.5.37", "nvidia/cu13/include/crt/", "crt/"),
    ],
    # torch-npu bundles the AscendCL headers of the CANN release it targets.
    "ascendcl": [("torch-npu==2.14.0", "torch_npu/include/acl/", "acl/")],
}
# The wheels are the same headers on every platform; x86-64 CPython 3.11 names one wheel of each.
PIP_TARGET = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64"]
PIP_TARGET += ["--python-version", "3.11", "--implementation", "cp", "--only-binary=:all:"]


def stamp(name: str) -> str:
    return "\n".join(req for req, _, _ in PINS[name]) + "\n"


def unpack(wheel: Path, prefix: str, dest: Path) -> int:
    """Copies the headers under `prefix` in `wheel` to `dest`; returns how many."""
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            if not member.startswith(prefix) or not member.endswith((".h", ".hpp")):
                continue
            rel = member[len(prefix) :]
            if rel.startswith("/") or ".." in Path(rel).parts:
                raise RuntimeError(f"{wheel.name}: unsafe member name {member!r}")
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(member))
            count += 1
    return count


def fetch(name: str, root: Path) -> None:
    final = root / name
    if (final / "VERSION").is_file() and (final / "VERSION").read_text() == stamp(name):
        print(f"vendor headers: {final} is up to date")
        return
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as tmp:
        wheels, staged = Path(tmp) / "wheels", Path(tmp) / name
        for req, prefix, sub in PINS[name]:
            before = set(wheels.glob("*.whl")) if wheels.exists() else set()
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET, "-d", str(wheels)]
            cmd.append(req)
            if subprocess.run(cmd).returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed (is PyPI reachable?)")
            (wheel,) = set(wheels.glob("*.whl")) - before
            if unpack(wheel, prefix, staged / "include" / sub) == 0:
                raise RuntimeError(f"{wheel.name} has no headers under {prefix}")
        (staged / "VERSION").write_text(stamp(name))
        shutil.rmtree(final, ignore_errors=True)
        staged.rename(final)  # complete sets only: a killed run leaves no half-filled folder behind
    print(f"vendor headers: fetched {final}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[1]).expanduser().resolve()
    try:
        for name in PINS:
            fetch(name, root)
    except (RuntimeError, OSError, ValueError) as e:
        print(f"vendor headers: could not fetch the vendor headers into {root}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
