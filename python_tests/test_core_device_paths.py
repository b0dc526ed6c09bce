"""The Python side of the device paths (issue 17), on the host backend: ``after=`` torch's default stream
(handle 0) is an ordering, the engine works on the caller's current device, every caller that copies
tensors kernels produced or use passes ``after=`` their current stream (the dock's device puts and fetches,
the switch's fused copies, swap-out, swap-in and its restore path, the streamed buckets), read-only arrays
are registered read-only, and the CUDA wheels' library folder is searched. The native effects of each
(ordering on the legacy stream, per-device events, read-only flags) are tested against the fake vendor
libraries in cpp_tests/test_device_semantics.cpp."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

import msrl_core
from msrl_core import _core, errors

torch = pytest.importorskip("torch")


class _TorchDefaultStream:
    """What ``torch.cuda.current_stream()`` is on a GPU: a stream object whose handle is 0."""

    cuda_stream = 0


def test_after_the_default_stream_handle_0_orders_the_copy():
    engine = msrl_core.CopyEngine()
    src = np.arange(1000, dtype=np.int32)
    dst = np.zeros_like(src)
    engine.copy(dst, src, after=None).wait(10)
    assert engine.stats()["ordered"] == 0
    engine.copy(dst, src, after=0).wait(10)
    engine.copy(dst, src, after=_TorchDefaultStream()).wait(10)
    engine.copy_many([dst], [src], after=0).wait(10)
    plan = msrl_core.CopyPlan(msrl_core.descriptors(0, 0, 64))
    engine.execute(plan, dst, src, after=_TorchDefaultStream()).wait(10)
    assert engine.stats()["ordered"] == 4  # 0 was read as "no ordering", dropping every after=default stream
    assert (dst == src).all()


def test_the_engine_works_on_the_callers_current_device(monkeypatch):
    import msrl_core.copy as copy_mod

    monkeypatch.setattr(copy_mod, "_current_device_index", lambda backend: 3)  # torch.cuda.current_device()
    assert msrl_core.CopyEngine().device == 3
    assert msrl_core.CopyEngine(device_index=1).device == 1
    with pytest.raises(errors.InvalidArgument, match="device_index must be >= 0, got -1"):
        msrl_core.CopyEngine(device_index=-1)


class _Recording:
    """Delegates to a real engine and records the ``after`` of every copy."""

    def __init__(self, engine=None):
        self.e = engine or msrl_core.CopyEngine()
        self.afters: list[tuple[str, object]] = []

    def _rec(self, what, kw):
        self.afters.append((what, kw.get("after", None)))

    def copy(self, *a, **k):
        self._rec("copy", k)
        return self.e.copy(*a, **k)

    def copy_many(self, *a, **k):
        self._rec("copy_many", k)
        return self.e.copy_many(*a, **k)

    def execute(self, *a, **k):
        self._rec("execute", k)
        return self.e.execute(*a, **k)

    def order_stream(self, *a, **k):
        return self.e.order_stream(*a, **k)


@pytest.fixture
def default_stream_everywhere(monkeypatch):
    """``current_stream(device)`` answers torch's default CUDA stream (handle 0) in every caller."""
    from msrl_core.dock import _device
    from msrl_core.reshard import offload, stream, swap

    for mod in (_device, swap, stream, offload):
        monkeypatch.setattr(mod, "current_stream", lambda device: 0, raising=False)


def test_dock_device_puts_and_fetches_are_ordered_after_the_callers_stream(default_stream_everywhere):
    from msrl_core.dock import _device

    io = _device.DeviceIO()
    rec = _Recording(io.engine)
    io.engine = rec  # type: ignore[assignment]
    c = torch.arange(6, dtype=torch.float32).reshape(2, 3).t().contiguous()  # freshly made by a kernel
    out = io.to_host(c).view(np.float32).reshape(c.shape)
    back = io.to_device(torch.from_numpy(out.copy()), "cpu")
    assert torch.equal(back, c)
    assert rec.afters == [("copy", 0), ("copy", 0)]


def test_the_switch_orders_every_copy_after_the_callers_stream(default_stream_everywhere):
    from msrl_core.reshard import Parallel, allgather_swap, stream_buckets, to_hf
    from reshard_util import CONFIGS, random_shards

    plan = to_hf(CONFIGS["qwen2_gqa_bias"], Parallel(tp=1))
    params = {
        k: torch.nn.Parameter(v, requires_grad=False) for k, v in random_shards(plan, 0)[(0, 0, 0)].items()
    }
    flat, _ = plan.allocate_inference()
    rec = _Recording()
    s = allgather_swap(params, flat, plan, {}, bucket_bytes=16 << 10, infer_rank=0, engine=rec)
    s.swap_back().wait()
    kinds = {what for what, _ in rec.afters}
    assert kinds == {"execute", "copy_many"}  # fused bucket copies, swap-out, swap-in
    assert all(after == 0 for _, after in rec.afters), rec.afters
    streamed = _Recording()
    for _ in stream_buckets(params, plan, {}, bucket_bytes=16 << 10, engine=streamed):
        pass
    assert streamed.afters and all(after == 0 for _, after in streamed.afters), streamed.afters


def test_a_failed_swap_out_restores_after_the_callers_stream(default_stream_everywhere):
    """The restore path re-materialises freed storages (fresh caching-allocator blocks on a GPU) and copies
    into them: ordered like swap-in."""
    from msrl_core.reshard import Parallel, ReshardError, allgather_swap, to_hf
    from reshard_util import CONFIGS, random_shards

    plan = to_hf(CONFIGS["qwen2_gqa_bias"], Parallel(tp=1))
    params = {
        k: torch.nn.Parameter(v, requires_grad=False) for k, v in random_shards(plan, 0)[(0, 0, 0)].items()
    }
    flat, _ = plan.allocate_inference()
    params[list(params)[4]].numpy()  # its storage cannot be resized: freeing it fails after four were freed
    rec = _Recording()
    with pytest.raises(ReshardError, match="restored"):
        allgather_swap(params, flat, plan, {}, bucket_bytes=16 << 10, infer_rank=0, engine=rec)
    restores = [a for w, a in rec.afters if w == "copy_many"][1:]  # after the swap-out's own batch
    assert restores and all(after == 0 for after in restores), rec.afters


def test_read_only_arrays_are_registered_read_only(tmp_path):
    path = tmp_path / "weights.bin"
    np.arange(4096, dtype=np.uint8).tofile(path)
    ro = np.memmap(path, dtype=np.uint8, mode="r")  # pages mapped read-only, as np.load(mmap_mode="r")
    pool = msrl_core.PinnedPool()
    calls = []

    class _Pool:
        def register(self, ptr, nbytes, read_only=False):
            calls.append(read_only)
            return SimpleNamespace()

    real = pool._pool
    pool._pool = _Pool()  # type: ignore[assignment]
    pool.register(ro)
    pool.register(np.zeros(4096, np.uint8))
    assert calls == [True, False]
    pool._pool = real
    reg = pool.register(ro)  # the host backend pins it too
    assert reg.nbytes == 4096 and _core.PinnedPool.is_pinned(reg.ptr, 4096)
    reg.release()


def test_the_cuda_wheels_library_folder_is_searched(tmp_path, monkeypatch):
    from msrl_core import runtime

    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (tmp_path / "nvidia" / "cuda_runtime").mkdir()  # no lib/ inside: not listed
    assert runtime.vendor_library_dirs("cuda", [str(tmp_path), "/nonexistent"]) == [str(lib)]
    ascend = tmp_path / "ascend"
    (ascend / "lib64").mkdir(parents=True)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(ascend))
    assert runtime.vendor_library_dirs("acl", []) == [str(ascend / "lib64")]
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(runtime, "_dirs_set", False)
    msrl_core.runtime_info()  # a process that has not imported torch's CUDA yet asks first
    assert str(lib) in _core.library_dirs("cuda")
    assert str(ascend / "lib64") in _core.library_dirs("acl")
    monkeypatch.undo()
    runtime._dirs_set = False
    msrl_core.get_runtime("host")
    assert str(lib) not in _core.library_dirs("cuda")
    assert os.path.isdir(str(lib))
