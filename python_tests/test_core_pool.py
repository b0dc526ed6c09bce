import gc

import numpy as np
import pytest

import msrl_core
from msrl_core import errors


def test_pinned_buffer_views_are_zero_copy():
    pool = msrl_core.PinnedPool()
    buf = pool.allocate(4096 * 3)
    a = np.frombuffer(buf, dtype=np.float32)
    b = np.frombuffer(buf, dtype=np.float32)
    a[:] = np.arange(a.size)
    assert a.__array_interface__["data"][0] == buf.ptr
    assert b[17] == 17.0  # same memory
    torch = pytest.importorskip("torch")
    t = torch.frombuffer(buf, dtype=torch.float32)
    assert t.data_ptr() == buf.ptr
    t[5] = -1.0
    assert a[5] == -1.0


def test_blocks_are_reused_and_accounted():
    pool = msrl_core.PinnedPool()
    buf = pool.allocate(3 << 20)
    ptr = buf.ptr
    s = pool.stats()
    assert s["requested"] == 3 << 20
    assert pool.stats()["in_use"] == msrl_core._core.PinnedPool.size_class(3 << 20)
    del buf
    gc.collect()
    assert pool.stats()["in_use"] == 0
    assert pool.stats()["cached"] == msrl_core._core.PinnedPool.size_class(3 << 20)
    again = pool.allocate((3 << 20) - 10)
    assert again.ptr == ptr
    assert pool.stats()["cache_hits"] == 1


def test_block_outlives_pool_object_while_a_view_exists():
    pool = msrl_core.PinnedPool()
    view = np.frombuffer(pool.allocate(8192), dtype=np.uint8)
    view[:] = 3
    del pool
    gc.collect()
    assert int(view.sum()) == 3 * 8192


def test_capacity_error_names_the_bytes_and_leaves_state():
    pool = msrl_core.PinnedPool(capacity=4 << 20)
    keep = pool.allocate(3 << 20)
    before = pool.stats()
    with pytest.raises(errors.OutOfMemory, match="capacity 4194304 bytes exceeded"):
        pool.allocate(2 << 20)
    assert pool.stats() == before
    assert keep.nbytes == 3 << 20


def test_bad_sizes_and_use_after_close():
    pool = msrl_core.PinnedPool()
    with pytest.raises(errors.InvalidArgument, match="nbytes must be >= 0, got -5"):
        pool.allocate(-5)
    with pytest.raises(errors.InvalidArgument, match="must be > 0"):
        pool.allocate(0)
    live = np.frombuffer(pool.allocate(4096), dtype=np.uint8)
    pool.close()
    assert pool.closed
    with pytest.raises(errors.Closed, match="pool is closed"):
        pool.allocate(10)
    with pytest.raises(errors.Closed):
        pool.register(np.zeros(10))
    live[:] = 1  # blocks handed out before close() stay valid
    assert int(live.sum()) == 4096


def test_register_pins_caller_memory_in_place():
    pool = msrl_core.PinnedPool()
    arr = np.zeros(1 << 16, dtype=np.uint8)
    ptr = arr.__array_interface__["data"][0]
    assert not msrl_core._core.PinnedPool.is_pinned(ptr, arr.nbytes)
    reg = pool.register(arr)
    assert reg.ptr == ptr and reg.nbytes == arr.nbytes
    assert msrl_core._core.PinnedPool.is_pinned(ptr, arr.nbytes)
    assert pool.stats()["registered"] == arr.nbytes
    with pytest.raises(errors.InvalidArgument, match="overlaps"):
        pool.register(arr[100:200])
    reg.release()
    assert not msrl_core._core.PinnedPool.is_pinned(ptr, arr.nbytes)
    with pytest.raises(errors.Closed, match="already released"):
        reg.release()
    with pytest.raises(errors.InvalidArgument, match="not C-contiguous"):
        pool.register(np.zeros((10, 10))[:, 0])
    with pytest.raises(errors.InvalidArgument, match="null pointer"):
        msrl_core._core.PinnedPool.is_pinned(0, 10)
