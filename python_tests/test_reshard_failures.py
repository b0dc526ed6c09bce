"""allgather-swap tried as a new user would, 2 processes over gloo (no Megatron: fast start-up; every case
runs in one spawn, in order): one rank's failure or bad input raises on every rank with the weights intact
everywhere, no rank blocked in a collective, settings that must agree do, the inference buffer carries its
rank, a swapped-out parameter read is a Python error, one timeout bounds the switch, and an OOM injected
on one rank at bucket k of N (p2p and collective, in the copy and in the pack, pipelined or not) raises an
msrl_core error on every rank within the timeout."""

from __future__ import annotations

import pytest

import reshard_util as ru

CASES = [
    "split_swap_out",
    "not_swapped_back_on_one_rank",
    "group_check_on_one_rank",
    "different_bucket_bytes",
    "different_gather",
    "different_verify",
    "buffer_carries_its_rank",
    "read_swapped_out",
    "oom_copy_p2p",
    "oom_copy_all_gather",
    "oom_pack_p2p",
    "oom_pack_all_gather_pipelined",
    "oom_copy_p2p_pipelined",
    "stream_oom",
    "bucket_bytes_auto_takes_the_smallest_choice",
    "timeout_for_the_whole_switch",  # last: it leaves the group unusable
]
# far below gloo's own timeout in the workers (ru.GLOO_TIMEOUT_S): an answer this fast did not wait for it
PROMPT_S = 20.0


@pytest.fixture(scope="module")
def results():
    return ru.spawn_cases(CASES, world=2, timeout=400)


def _ok(results, name):
    per_rank = [r[name] for r in results]
    for r in per_rank:
        assert "error" not in r, r.get("traceback", r.get("error"))
    return per_rank


def test_swap_out_failing_on_one_rank_raises_and_restores_everywhere(results):
    r0, r1 = _ok(results, "split_swap_out")
    assert r0["raised"] == "ReshardError" and "swap-out failed at parameter" in r0["msg"], r0
    assert r1["raised"] == "SwitchAborted" and "another rank" in r1["msg"], r1  # not a swapped-out Swap
    for r in (r0, r1):
        assert r["intact"] and r["active_none"] and r["msrl"]


def test_previous_switch_not_swapped_back_on_one_rank_raises_on_both_promptly(results):
    r0, r1 = _ok(results, "not_swapped_back_on_one_rank")
    assert r0["raised"] == "SwapStateError" and "not swapped back" in r0["msg"], r0
    assert r1["raised"] == "ReshardError" and "another rank" in r1["msg"], r1
    for r in (r0, r1):
        assert r["elapsed_s"] < PROMPT_S and r["intact"]


def test_group_check_failing_on_one_rank_raises_on_both_promptly(results):
    r0, r1 = _ok(results, "group_check_on_one_rank")
    assert r1["raised"] == "ReshardError" and "groups['tp'] has size 2" in r1["msg"], r1
    assert r0["raised"] == "ReshardError", r0
    for r in (r0, r1):
        assert r["elapsed_s"] < PROMPT_S and r["intact"]


@pytest.mark.parametrize("what", ["bucket_bytes", "gather", "verify"])
def test_different_settings_across_ranks_are_a_clear_error(results, what):
    for r in _ok(results, f"different_{what}"):
        assert r["raised"] == "ReshardError" and "different settings" in r["msg"], r
        assert r["elapsed_s"] < PROMPT_S and r["intact"]


def test_inference_buffer_carries_its_rank(results):
    for rank, r in enumerate(_ok(results, "buffer_carries_its_rank")):
        assert r["infer_rank"] == 0 and r["equal_rank0"], r
        m = r["mismatch"]
        if rank == 1:
            assert m["raised"] == "ReshardError" and "allocated for infer_rank 0" in m["msg"], m
        else:
            assert m["raised"] == "ReshardError" and "another rank" in m["msg"], m
        assert r["intact"]


def test_reading_a_swapped_out_parameter_is_a_python_error(results):
    for r in _ok(results, "read_swapped_out"):
        for op in ("sum", "clone", "add", "sum_while_swapping_in"):
            assert r[op]["raised"] == "SwapStateError" and "swapped out" in r[op]["msg"], (op, r[op])
        assert "decoder.layers" in r["sum"]["msg"] or "embedding" in r["sum"]["msg"]  # names the parameter
        assert r["shape_ok"] and r["is_parameter"]
        assert r["sum_after_wait"]["raised"] is None and r["type_after_wait"] == "Parameter"
        assert r["intact"]


@pytest.mark.parametrize(
    "case",
    [
        "oom_copy_p2p",
        "oom_copy_all_gather",
        "oom_pack_p2p",
        "oom_pack_all_gather_pipelined",
        "oom_copy_p2p_pipelined",
    ],
)
def test_oom_on_one_rank_mid_switch_raises_everywhere_weights_intact(results, case):
    r0, r1 = _ok(results, case)
    assert r1["buckets"] >= 4 and 0 < r1["k"] < r1["buckets"] - 1
    assert (
        r1["raised"] == "SwitchAborted" and "OutOfMemory" in r1["msg"] and f"bucket {r1['k']} " in r1["msg"]
    )
    assert r0["raised"] == "SwitchAborted" and "another rank" in r0["msg"], r0
    for r in (r0, r1):
        assert r["msrl"] and r["elapsed_s"] < PROMPT_S
        assert r["intact"] and r["active_none"]
        assert r["next_switch_equal"] and r["intact_after_next"]


def test_stream_oom_on_one_rank_raises_everywhere(results):
    r0, r1 = _ok(results, "stream_oom")
    assert r1["raised"] == "SwitchAborted" and "OutOfMemory" in r1["msg"], r1
    assert r0["raised"] == "SwitchAborted" and "another rank" in r0["msg"], r0
    assert all(r["intact"] and r["elapsed_s"] < PROMPT_S for r in (r0, r1))


def test_one_timeout_bounds_the_whole_switch(results):
    r0, r1 = _ok(results, "timeout_for_the_whole_switch")
    assert r0["raised"] == "SwitchTimeout" and r0["msrl"], r0
    assert 1.5 <= r0["elapsed_s"] < 10.0, r0  # timeout=2 s, not gloo's 40 s
    assert r1["raised"] in ("SwitchTimeout", "SwitchAborted") and r1["msrl"] and r1["elapsed_s"] < 10.0, r1
    assert r0["intact"] and r1["intact"]


def test_bucket_bytes_auto_takes_the_smallest_choice_of_the_ranks(results):
    for r in _ok(results, "bucket_bytes_auto_takes_the_smallest_choice"):
        assert r["bucket_bytes"] == 1 << 20 and r["intact"]
