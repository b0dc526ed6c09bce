"""Full training-state offload: gradients (.grad and Megatron-style main_grad buffers), optimizer state (Adam
moments) and fp32 master weights to pinned host mirrors; freed bytes per kind equal the sizes; after the
swap back an optimizer step gives bit-identical parameters to a twin run without offload."""

from __future__ import annotations

import copy

import pytest
import torch

from msrl_core.reshard import SwapStateError
from msrl_core.reshard.offload import TrainingStateOffload


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 32, generator=g)
    model.zero_grad(set_to_none=False)
    model(x).square().mean().backward()


def test_grads_and_adam_state_offloaded_then_step_bit_identical():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _backward(model, 1)
    opt.step()  # creates the moments
    _backward(model, 2)
    twin_model = copy.deepcopy(model)
    for a, b in zip(model.parameters(), twin_model.parameters(), strict=True):
        b.grad = a.grad.clone()
    twin_opt = torch.optim.Adam(twin_model.parameters(), lr=1e-2)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))

    off = TrainingStateOffload()
    state = off.offload(model, opt)
    t = state.telemetry
    grads = sum(p.grad.nbytes for p in twin_model.parameters())
    moments = sum(
        v.nbytes for s in twin_opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    )
    assert t.freed_bytes == {"grads": grads, "optimizer_state": moments, "master_weights": 0}
    assert t.tensors["optimizer_state"] == 2 * len(list(model.parameters()))  # exp_avg, exp_avg_sq
    assert t.host_mirror_bytes == t.host_new_bytes == grads + moments
    p0 = next(model.parameters())
    assert p0.grad.untyped_storage().nbytes() == 0
    with pytest.raises(SwapStateError, match="swapped out"):
        p0.grad.sum()
    with pytest.raises(SwapStateError, match="exp_avg"):
        opt.state[p0]["exp_avg"].clone()
    with pytest.raises(SwapStateError, match="not swapped back"):
        off.offload(model, opt)
    state.swap_back()
    state.wait(timeout=30)
    assert t.swap_in_s > 0 and state.state == "back"
    opt.step()
    twin_opt.step()
    for a, b in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(a, b)
    for sa, sb in zip(opt.state.values(), twin_opt.state.values(), strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq"))
    # the mirrors persist: a second offload allocates no pinned memory
    _backward(model, 3)
    s2 = off.offload(model, opt)
    assert s2.telemetry.host_new_bytes == 0
    s2.swap_back().wait()


def test_megatron_style_main_grad_buffer_and_fp32_master_weights():
    """bf16 model parameters with .main_grad views into one contiguous fp32 grad buffer (Megatron DDP), an
    Adam over fp32 master copies: every kind is freed exactly, and the step after the swap back matches."""
    torch.manual_seed(0)
    shapes = [(64, 32), (64,), (8, 64)]
    init = [torch.randn(s).bfloat16() for s in shapes]

    def build():
        params = {f"w{i}": torch.nn.Parameter(t.clone()) for i, t in enumerate(init)}
        buffer = torch.zeros(sum(torch.Size(s).numel() for s in shapes))
        off_ = 0
        for p, s in zip(params.values(), shapes, strict=True):
            n = torch.Size(s).numel()
            p.main_grad = buffer[off_ : off_ + n].view(s)
            off_ += n
        masters = [p.detach().float().clone().requires_grad_() for p in params.values()]
        return params, buffer, masters, torch.optim.Adam(masters, lr=1e-3)

    def step(params, masters, opt, seed):
        g = torch.Generator().manual_seed(seed)
        for p, m in zip(params.values(), masters, strict=True):
            p.main_grad.copy_(torch.randn(p.shape, generator=g))
            m.grad = p.main_grad.clone()
        opt.step()
        for p, m in zip(params.values(), masters, strict=True):
            p.data.copy_(m.detach().bfloat16())

    params, buffer, masters, opt = build()
    twin = build()
    twin_opt = twin[3]
    step(params, masters, opt, 1)
    step(twin[0], twin[2], twin_opt, 1)

    state = TrainingStateOffload().offload(params, opt)
    t = state.telemetry
    assert t.freed_bytes["grads"] == buffer.nbytes + sum(m.grad.nbytes for m in twin[2])
    assert t.freed_bytes["master_weights"] == sum(m.nbytes for m in twin[2])
    assert t.freed_bytes["optimizer_state"] == 2 * sum(m.nbytes for m in twin[2])
    assert buffer.untyped_storage().nbytes() == 0
    state.swap_back().wait()
    step(params, masters, opt, 2)
    step(twin[0], twin[2], twin_opt, 2)
    assert all(torch.equal(a, b) for a, b in zip(params.values(), twin[0].values(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(masters, twin[2], strict=True))


def test_kinds_are_optional():
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    _backward(model, 1)
    opt.step()
    state = TrainingStateOffload(optimizer_state=False, master_weights=False).offload(model, opt)
    assert set(state.telemetry.freed_bytes) == {"grads"}
    assert all(s["exp_avg"].untyped_storage().nbytes() > 0 for s in opt.state.values())
    state.swap_back().wait()
