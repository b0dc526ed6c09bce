import numpy as np
import pytest

import msrl_core
from msrl_core import errors


@pytest.fixture(scope="module")
def engine():
    return msrl_core.CopyEngine()


def test_copy_numpy_through_pinned_and_back(engine):
    pool = msrl_core.PinnedPool()
    src = np.random.default_rng(0).standard_normal(1_000_003).astype(np.float32)
    pinned = pool.allocate(src.nbytes)
    engine.copy(pinned, src, kind="h2d").wait(timeout=30)
    out = np.empty_like(src)
    t = engine.copy(out, pinned, kind="d2h")
    t.wait(timeout=30)
    assert t.done() and t.nbytes == src.nbytes
    np.testing.assert_array_equal(out, src)


def test_copy_torch_tensors_including_bf16(engine):
    torch = pytest.importorskip("torch")
    src = torch.randn(513, 7).to(torch.bfloat16)
    dst = torch.empty_like(src)
    engine.copy(dst, src).wait(timeout=10)
    assert torch.equal(dst, src)


def test_bounced_path_is_exact(engine):
    bounced = msrl_core.CopyEngine(chunk_bytes=4096, force_bounce=True)
    src = np.arange(100_001, dtype=np.int64)
    mid, back = np.zeros_like(src), np.zeros_like(src)
    bounced.copy(mid, src, kind="h2d").wait(timeout=10)
    bounced.copy(back, mid, kind="d2h").wait(timeout=10)
    np.testing.assert_array_equal(back, src)
    assert bounced.stats()["bounced_bytes"] == 2 * src.nbytes


def test_plan_extracts_strided_slices(engine):
    src = np.arange(64 * 32, dtype=np.uint8).reshape(64, 32)
    # Columns 8..23 of every row, i.e. a 2-D slice, as 64 one-row descriptors.
    d = msrl_core.descriptors(src_offset=np.arange(64) * 32 + 8, dst_offset=np.arange(64) * 16, row_bytes=16)
    plan = msrl_core.CopyPlan(d)
    assert plan.input_count == 64 and len(plan) == 1  # coalesced into one 2-D copy
    assert plan.descriptors.tolist() == [[8, 0, 64, 16, 32, 16]]
    dst = np.zeros((64, 16), dtype=np.uint8)
    engine.execute(plan, dst, src).wait(timeout=10)
    np.testing.assert_array_equal(dst, src[:, 8:24])


def test_qkv_deinterleave_plan_matches_numpy():
    engine = msrl_core.CopyEngine()
    groups, q_per, head_dim, hidden = 4, 3, 8, 16
    rows_per_group = (q_per + 2) * head_dim
    fused = np.random.default_rng(1).standard_normal((groups * rows_per_group, hidden)).astype(np.float32)
    row = hidden * 4
    descs = []
    q_rows, kv_rows = groups * q_per * head_dim, groups * head_dim
    for g in range(groups):
        base = g * rows_per_group * row
        descs.append([base, g * q_per * head_dim * row, 1, q_per * head_dim * row, 0, 0])
        descs.append([base + q_per * head_dim * row, (q_rows + g * head_dim) * row, 1, head_dim * row, 0, 0])
        descs.append(
            [
                base + (q_per + 1) * head_dim * row,
                (q_rows + kv_rows + g * head_dim) * row,
                1,
                head_dim * row,
                0,
                0,
            ]
        )
    d = np.array(descs, dtype=np.int64)
    d[:, 4] = d[:, 3]
    d[:, 5] = d[:, 3]
    plan = msrl_core.CopyPlan(d)
    assert len(plan) == 3  # q, k and v each become one 2-D copy across groups
    out = np.empty_like(fused)
    engine.execute(plan, out, fused).wait(timeout=10)
    g = fused.reshape(groups, q_per + 2, head_dim, hidden)
    want = np.concatenate(
        [
            g[:, :q_per].reshape(-1, hidden),
            g[:, q_per].reshape(-1, hidden),
            g[:, q_per + 1].reshape(-1, hidden),
        ]
    )
    np.testing.assert_array_equal(out, want)


def test_bad_plans_and_copies_raise_clear_errors(engine):
    with pytest.raises(errors.InvalidArgument, match="descriptors 0 and 1 write overlapping"):
        msrl_core.CopyPlan(np.array([[0, 0, 1, 64, 64, 64], [100, 32, 1, 64, 64, 64]]))
    with pytest.raises(errors.InvalidArgument, match="row_bytes must be >= 0, got -4"):
        msrl_core.CopyPlan(np.array([[0, 0, 1, -4, 0, 0]]))
    with pytest.raises(errors.InvalidArgument, match="shape \\(N, 6\\)"):
        msrl_core.CopyPlan(np.zeros((3, 5), dtype=np.int64))
    plan = msrl_core.CopyPlan(msrl_core.descriptors(0, 0, 1024))
    with pytest.raises(errors.InvalidArgument, match="source has only 100 bytes"):
        engine.execute(plan, np.zeros(2048, np.uint8), np.zeros(100, np.uint8))
    src = np.zeros(10, np.uint8)
    with pytest.raises(errors.InvalidArgument, match="src has 10 bytes but dst has 20"):
        engine.copy(np.zeros(20, np.uint8), src)
    with pytest.raises(errors.InvalidArgument, match="read-only"):
        engine.copy(np.frombuffer(b"0123456789", np.uint8), src)
    with pytest.raises(errors.InvalidArgument, match="null pointer"):
        engine._engine.copy(0, src.ctypes.data, 10, "h2h")
    with pytest.raises(errors.InvalidArgument, match="nbytes must be >= 0, got -1"):
        engine._engine.copy(src.ctypes.data + 100, src.ctypes.data, -1, "h2h")
    with pytest.raises(errors.InvalidArgument, match="unknown copy kind 'up'"):
        engine.copy(np.zeros(10, np.uint8), src, kind="up")
    with pytest.raises(errors.InvalidArgument, match="overlap"):
        engine._engine.copy(src.ctypes.data + 2, src.ctypes.data, 5, "h2h")
    with pytest.raises(errors.InvalidArgument, match="not a live stream"):
        engine.copy(np.zeros(10, np.uint8), src, after=12345)


def test_waiting_on_a_foreign_ticket_is_rejected(engine):
    other = msrl_core.CopyEngine()
    src, dst = np.ones(100), np.zeros(100)
    t = other.copy(dst, src)
    with pytest.raises(errors.InvalidArgument, match="belongs to engine"):
        engine.wait(t)
    with pytest.raises(errors.InvalidArgument, match="expected a Ticket"):
        engine.wait("ticket")
    with pytest.raises(errors.InvalidArgument, match="timeout must be a finite number"):
        t.wait(timeout=-1)
    t.wait(timeout=10)
    assert dst.sum() == 100


def test_stream_ordering_with_a_caller_stream(engine):
    rt = msrl_core.get_runtime()
    caller = rt.create_stream()
    src = np.full(8 << 20, 7, np.uint8)
    mid, out = np.zeros_like(src), np.zeros_like(src)
    t1 = engine.copy(mid, src, kind="h2d")
    engine.order_stream(t1, caller)
    t2 = engine.copy(out, mid, kind="d2h", after=caller)  # runs after the caller stream passed t1
    t2.wait(timeout=30)
    assert out[-1] == 7 and out[0] == 7
    caller.synchronize()


def test_gil_is_released_while_waiting():
    import threading
    import time

    engine = msrl_core.CopyEngine()
    src = np.ones(256 << 20, np.uint8)
    dst = np.zeros_like(src)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=ticker)
    th.start()
    try:
        t = engine.copy(dst, src)
        start = len(ticks)
        t.wait(timeout=60)
        during = len(ticks) - start
    finally:
        stop.set()
        th.join()
    assert dst[-1] == 1
    assert during >= 2  # the Python thread kept running while the copy was waited on


def test_copy_many_moves_every_pair_with_one_ticket():
    torch = pytest.importorskip("torch")
    engine = msrl_core.CopyEngine()
    pool = msrl_core.PinnedPool()
    params = [torch.randn(n) for n in (1, 1000, 65_537, 3 << 20)]
    mirrors = [torch.frombuffer(pool.allocate(p.nbytes), dtype=torch.float32) for p in params]
    t = engine.copy_many(mirrors, params, kind="d2h")
    t.wait(timeout=30)
    assert t.nbytes == sum(p.nbytes for p in params)
    assert all(torch.equal(m, p) for m, p in zip(mirrors, params))
    assert engine.stats()["submitted"] == 1
    with pytest.raises(
        errors.InvalidArgument, match="pair 1: srcs\\[1\\] has 4000 bytes but dsts\\[1\\] has 4"
    ):
        engine.copy_many([mirrors[0], mirrors[0]], params[:2])
    with pytest.raises(errors.InvalidArgument, match="dsts has 1 buffers but srcs has 2"):
        engine.copy_many(mirrors[:1], params[:2])
    with pytest.raises(errors.InvalidArgument, match="overlapping destination"):
        engine.copy_many([mirrors[3][:10], mirrors[3][5:15]], [params[1][:10], params[1][:10]])
