"""Device smoke test of the native core on a lent machine (bench/device_check.sh runs it): the tests that need
a real device and cannot run against the fake vendor libraries of cpp_tests.

One JSON line per case, ``{"case", "status": "PASS"|"FAIL"|"NOT RUN", "detail", ...}``; exits 1 when a case
failed. Cases that need CUDA report ``NOT RUN`` on a machine without a GPU; the others run on the host
backend too (a dry run of the plumbing):

- ``runtime_selected``: ``runtime_info()`` selects cuda (a GPU machine) or host;
- ``gpu_gtest_port``: cpp_tests' VendorRuntimeRealCuda in Python: a 2-D H2D plan (64 rows, pitch 1024, width
  1000) from a pinned block, D2D, D2H, data equal;
- ``default_stream_ordering_*``: ``after=`` torch's default stream (handle 0) behind a long-running kernel
  (``torch.cuda._sleep``): a D2H copy must see the kernel's output, an H2D copy must land after the kernel
  writing the same memory, ``order_stream`` must make the default stream wait for a copy; the same on a side
  stream;
- ``torch_pinned_direct``: ``tensor.pin_memory()`` memory is copied without the bounce buffers;
- ``register_direct_copy``: ``PinnedPool.register`` + a direct H2D copy;
- ``dock_put_fetch_device``: a put of a freshly computed non-contiguous device tensor and a fetch with
  ``device=`` equal to it;
- ``failed_call_then_torch``: a failing native call (registering memory twice:
  cudaErrorHostMemoryAlreadyRegistered) leaves no CUDA error behind: the thread's last error is clear and
  torch's next kernel runs.

    python bench/device_smoke.py
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch

import msrl_core
from msrl_core import errors

RESULTS: list[dict] = []
HAS_CUDA = torch.cuda.is_available()


def case(name: str, needs_cuda: bool = False) -> Callable[[Callable[[], str]], Callable[[], None]]:
    """A case returns its detail string, raises on failure."""

    def wrap(fn: Callable[[], str]) -> Callable[[], None]:
        def run() -> None:
            row: dict = {"case": name}
            if needs_cuda and not HAS_CUDA:
                row.update(status="NOT RUN", detail="needs an NVIDIA GPU; none here")
            else:
                t0 = time.perf_counter()
                try:
                    row.update(status="PASS", detail=fn())
                except Exception as e:  # a case's failure is reported, the next case still runs
                    row.update(status="FAIL", detail=f"{type(e).__name__}: {e}")
                    row["trace"] = traceback.format_exc(limit=4)
                row["seconds"] = round(time.perf_counter() - t0, 3)
            RESULTS.append(row)
            print(json.dumps(row), flush=True)

        return run

    return wrap


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if HAS_CUDA else torch.device("cpu")


def check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


@case("runtime_selected")
def runtime_selected() -> str:
    info = msrl_core.runtime_info()
    want = "cuda" if HAS_CUDA else "host"
    check(info["selected"] == want, f"selected {info['selected']!r}, want {want!r}: {info['backends']}")
    return f"selected {info['selected']}; cuda: {info['backends']['cuda']['detail']}"


@case("gpu_gtest_port")
def gpu_gtest_port() -> str:
    rt = msrl_core.get_runtime()
    engine, pool = msrl_core.CopyEngine(), msrl_core.PinnedPool()
    rows, width, pitch = 64, 1000, 1024
    src = pool.allocate(rows * pitch)
    s = np.frombuffer(src, np.uint8)
    s[:] = (np.arange(rows * pitch) * 131 + 9) % 251
    d1, d2 = rt.device_alloc(rows * width), rt.device_alloc(rows * width)
    plan = msrl_core.CopyPlan(msrl_core.descriptors(0, 0, width, rows=rows, src_pitch=pitch, dst_pitch=width))
    t0 = time.perf_counter()
    engine.execute(plan, d1, src, kind="h2d").wait(30)
    engine.copy(d2, d1, kind="d2d").wait(30)
    out = pool.allocate(rows * width)
    engine.copy(out, d2, kind="d2h").wait(30)
    dt = time.perf_counter() - t0
    want = s.reshape(rows, pitch)[:, :width].reshape(-1)
    check(np.array_equal(np.frombuffer(out, np.uint8), want), "2-D H2D -> D2D -> D2H data differ")
    return f"{rt.name}: 2-D plan {rows}x{width} (pitch {pitch}), d2d, d2h equal in {dt * 1e3:.2f} ms"


def _sleep_kernel(ms: float = 200.0) -> None:
    """A kernel that keeps the current stream busy for about ``ms`` (GPU cycles, ~1.5-2 GHz)."""
    torch.cuda._sleep(int(ms * 1.8e6))


@case("default_stream_ordering_d2h", needs_cuda=True)
def ordering_d2h() -> str:
    engine, pool = msrl_core.CopyEngine(), msrl_core.PinnedPool()
    n = 64 << 20
    x = torch.zeros(n, dtype=torch.uint8, device=dev())
    torch.cuda.synchronize()
    host = torch.frombuffer(pool.allocate(n), dtype=torch.uint8)
    check(torch.cuda.current_stream().cuda_stream == 0, "torch's current stream is not the default stream")
    _sleep_kernel()
    x.fill_(7)  # queued behind the sleep
    engine.copy(host, x, after=torch.cuda.current_stream()).wait(30)
    check(bool((host == 7).all()), "the copy read the tensor before the kernel that writes it ran")
    return "d2h after the default stream saw the kernel's output"


@case("default_stream_ordering_h2d", needs_cuda=True)
def ordering_h2d() -> str:
    engine, pool = msrl_core.CopyEngine(), msrl_core.PinnedPool()
    n = 64 << 20
    y = torch.zeros(n, dtype=torch.uint8, device=dev())
    src = torch.frombuffer(pool.allocate(n), dtype=torch.uint8)
    src.fill_(5)
    torch.cuda.synchronize()
    _sleep_kernel()
    y.fill_(3)  # earlier work on the same memory, still queued
    engine.copy(y, src, after=torch.cuda.current_stream()).wait(30)
    torch.cuda.synchronize()
    check(bool((y == 5).all()), "the copy landed before earlier default-stream work on the same memory")
    # and the reverse: the default stream waits for a ticket
    src.fill_(9)
    t = engine.copy(y, src)
    engine.order_stream(t, torch.cuda.current_stream())
    z = y.to(torch.int32) * 2
    torch.cuda.synchronize()
    check(bool((z == 18).all()), "order_stream did not make the default stream wait for the copy")
    return "h2d landed after the kernel; order_stream ordered the default stream after the copy"


@case("side_stream_ordering", needs_cuda=True)
def side_stream() -> str:
    engine, pool = msrl_core.CopyEngine(), msrl_core.PinnedPool()
    n = 32 << 20
    s = torch.cuda.Stream()
    host = torch.frombuffer(pool.allocate(n), dtype=torch.uint8)
    with torch.cuda.stream(s):
        x = torch.zeros(n, dtype=torch.uint8, device=dev())
        _sleep_kernel()
        x.fill_(4)
        engine.copy(host, x, after=s).wait(30)
    check(bool((host == 4).all()), "the copy did not wait for the side stream")
    return "d2h after a side stream saw its kernel's output"


@case("torch_pinned_direct", needs_cuda=True)
def torch_pinned() -> str:
    engine = msrl_core.CopyEngine()
    n = 64 << 20
    p = torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory()
    d = torch.empty(n, dtype=torch.uint8, device=dev())
    before = engine.stats()["bounced_bytes"]
    engine.copy(d, p).wait(30)
    back = torch.empty(n, dtype=torch.uint8).pin_memory()
    engine.copy(back, d).wait(30)
    bounced = engine.stats()["bounced_bytes"] - before
    check(torch.equal(back, p), "data differ")
    check(bounced == 0, f"{bounced} bytes of torch-pinned memory went through the bounce buffers")
    return "torch pin_memory() copied directly both ways (0 bytes bounced)"


@case("register_direct_copy")
def register_direct() -> str:
    engine, pool = msrl_core.CopyEngine(), msrl_core.PinnedPool()
    n = 16 << 20
    arr = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
    reg = pool.register(arr)
    d = torch.empty(n, dtype=torch.uint8, device=dev())
    before = engine.stats()["bounced_bytes"]
    engine.copy(d, arr).wait(30)
    bounced = engine.stats()["bounced_bytes"] - before
    check(np.array_equal(d.cpu().numpy(), arr), "data differ")
    check(bounced == 0, f"registered memory bounced ({bounced} bytes)")
    reg.release()
    return f"registered {n >> 20} MiB, copied directly to {d.device}"


@case("dock_put_fetch_device")
def dock_device() -> str:
    from msrl_core import Column, Dock

    dock = Dock(
        columns={"h": Column("float32", shape=(4,)), "tok": Column("int64", ragged=True, max_len=8)},
        stages={"s": ["h", "tok"]},
        capacity=8,
        group_size=2,
    )
    d = dev()
    base = torch.randn(4, 8, device=d)
    fresh = (base * 3 + 1).t()  # computed just now, non-contiguous [8, 4]
    check(not fresh.is_contiguous(), "the test tensor should be non-contiguous")
    toks = [torch.arange(i + 1, device=d) * 7 for i in range(8)]
    rows = dock.put({"h": fresh, "tok": toks})
    batch = dock.fetch(rows, ["h", "tok"], output="torch", device=d)
    check(batch["h"].device.type == d.type, f"fetched to {batch['h'].device}, asked for {d}")
    check(torch.equal(batch["h"], fresh), "fetched h differs from the put tensor")
    want = torch.cat([t.cpu() for t in toks])
    check(torch.equal(batch["tok"].values.cpu(), want), "fetched tokens differ")
    return f"put of a fresh non-contiguous {tuple(fresh.shape)} {d.type} tensor, fetch(device={d.type}) equal"


@case("failed_call_then_torch")
def failed_then_torch() -> str:
    pool = msrl_core.PinnedPool()
    arr = np.zeros(1 << 20, np.uint8)
    reg = pool.register(arr)
    try:
        pool.register(arr)
        raise AssertionError("registering the same memory twice did not fail")
    except errors.InvalidArgument:
        pass
    detail = "the second registration raised InvalidArgument"
    if HAS_CUDA:
        last = _cuda_peek_last_error()
        if last is not None:
            check(last == 0, f"cudaPeekAtLastError() = {last} after our failed call (torch would report it)")
            detail += "; cudaPeekAtLastError() = 0"
        y = torch.randn(1 << 16, device=dev())
        v = float((y * 2).sum())  # a torch kernel: C10_CUDA_KERNEL_LAUNCH_CHECK sees no stray error
        torch.cuda.synchronize()
        detail += f"; torch kernel ran (sum {v:.3f})"
    reg.release()
    return detail


def _cuda_peek_last_error() -> int | None:
    """cudaPeekAtLastError of the libcudart this process uses (None when it cannot be found)."""
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libcudart.so" in line]
    if not paths:
        return None
    return int(ctypes.CDLL(paths[0]).cudaPeekAtLastError())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args()
    meta = {
        "meta": True,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if HAS_CUDA else None,
        "python": sys.version.split()[0],
    }
    print(json.dumps(meta), flush=True)
    if HAS_CUDA:
        torch.cuda.init()
    for fn in (
        runtime_selected,
        gpu_gtest_port,
        ordering_d2h,
        ordering_h2d,
        side_stream,
        torch_pinned,
        register_direct,
        dock_device,
        failed_then_torch,
    ):
        fn()
    counts = {s: sum(r["status"] == s for r in RESULTS) for s in ("PASS", "FAIL", "NOT RUN")}
    print(json.dumps({"summary": True, **counts}), flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
