"""Workers for the HF -> Megatron tests: a tiny transformers model built in code and saved as a Hugging Face
directory; megatron-core ``GPTModel``s built by :func:`msrl_core.models.build_gpt` on CPU over gloo, filled by
:func:`msrl_core.models.load_hf_checkpoint`; their forward compared with transformers' forward of the
checkpoint, then saved back with :func:`msrl_core.models.save_hf_checkpoint` and compared tensor by tensor.

``run(cases, world)`` spawns the world once for every case (start-up and imports dominate the cost).
"""

from __future__ import annotations

import os
import zlib

import megatron_harness as mh

SEQ = 12


def run(cases: list[dict], world: int = 2, timeout: float = 600.0) -> list[dict]:
    return mh.spawn(_main, cases, world, timeout, "models workers")


def _main(rank: int, world: int, port: int, cases: list[dict], out: str) -> None:
    mh.serve(rank, world, port, cases, out, _run_case)


def tiny_hf_model(arch: str, hf: dict, seed: int = 0):
    """A transformers model of ``arch`` from the config keys ``hf``, every parameter drawn from a seeded
    generator (norms around 1, so RMSNorm / QK norm weights matter)."""
    import torch
    import transformers as tf

    cls = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
    }[arch]
    config = cls[0](**hf)
    model = cls[1](config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def _hf_logits(path: str, tokens):
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(tokens).logits


def _run_case(case: dict, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from safetensors import safe_open

    from msrl_core.models import ModelConfig, build_gpt, load_hf_checkpoint, save_hf_checkpoint
    from msrl_core.reshard import Parallel

    src, dst = os.path.join(case["dir"], "hf"), os.path.join(case["dir"], "saved")
    if rank == 0:
        m = tiny_hf_model(case["arch"], case["hf"])
        kw = {"max_shard_size": case["max_shard_size"]} if case.get("max_shard_size") else {}
        m.save_pretrained(src, **kw)
    dist.barrier()
    mc = ModelConfig.from_pretrained(src)
    train = Parallel(tp=case.get("tp", 1), pp=case.get("pp", 1), ep=case.get("ep", 1))
    model = build_gpt(mc, train, seed=1234, reinit=True).eval()
    report = load_hf_checkpoint(model, src)
    res: dict = {
        "rope_theta": mc.rope_theta,
        "norm_epsilon": mc.norm_epsilon,
        "tensors_read": report.tensors_read,
        "bytes_read": report.bytes_read,
        "files": [os.path.basename(f) for f in report.files],
        "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "checkpoint_tensors": len(_tensors(src, safe_open)),
        "checkpoint_bytes": sum(t.numel() * t.element_size() for t in _tensors(src, safe_open).values()),
    }
    tokens = torch.randint(0, mc.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(7))
    got = mh._megatron_logits(model, ps, tokens)
    if got is not None:
        ref = _hf_logits(src, tokens)
        res["logits_max_abs_diff"] = float((got[..., : mc.vocab_size] - ref).abs().max())
        res["logits_scale"] = float(ref.abs().max())
        res["padded_logits_zero"] = bool((got[..., mc.vocab_size :] == 0).all())
    # Megatron -> HF through the forward plan, compared with the source checkpoint tensor by tensor
    files = save_hf_checkpoint(model, dst, mc, train)
    if rank == 0:
        res["saved_files"] = sorted(os.path.basename(f) for f in files)
        want = _tensors(src, safe_open)
        have = _tensors(dst, safe_open)
        res["saved_names_equal"] = sorted(want) == sorted(have)
        res["saved_max_abs_diff"] = max(float((want[n] - have[n]).abs().max()) for n in want if n in have)
        res["saved_logits_equal"] = bool(torch.equal(_hf_logits(dst, tokens), _hf_logits(src, tokens)))
        res["saved_config_same_model"] = ModelConfig.from_pretrained(dst) == mc
    if case.get("grad"):
        res["grad"] = _grads_vs_transformers(model, mc, train, src, tokens, rank)
        res["train"] = _train_steps(model, mc, src, tokens, rank)
    if case.get("errors"):
        res["errors"] = _one_rank_bad(model, src, os.path.join(case["dir"], "broken"), rank)
    return res


def _one_rank_bad(model, src: str, broken: str, rank: int) -> dict:
    """Rank 1 loads a checkpoint that lacks a tensor, rank 0 a good one: both raise (agreed), neither
    writes a parameter, and the world goes on (no rank left in a collective)."""
    import shutil

    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from msrl_core.models import CheckpointError, load_hf_checkpoint

    if rank == 0:
        os.makedirs(broken)
        shutil.copy(os.path.join(src, "config.json"), broken)
        t = load_file(os.path.join(src, "model.safetensors"))
        t.pop("model.layers.1.mlp.down_proj.weight")
        save_file(t, os.path.join(broken, "model.safetensors"))
    dist.barrier()
    before = mh._crcs(model)
    out: dict = {}
    try:
        load_hf_checkpoint(model, broken if rank == 1 else src)
        out["raised"] = None
    except CheckpointError as e:
        out["raised"], out["msg"] = type(e).__name__, str(e)
    out["intact"] = mh._crcs(model) == before
    return out


def _tensors(path: str, safe_open) -> dict:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 (a safe_open handle)
    return out


def _grads_vs_transformers(model, mc, train, src: str, tokens, rank: int) -> dict:
    """One backward of ``sum(logits * W)`` through :func:`pipeline_forward` on every rank, completed by
    :func:`finish_grads`, the gradients brought to HF names by the forward plan (``stream_buckets`` over the
    gradients), compared on rank 0 with transformers' gradients of the same loss."""
    import re

    import torch
    import transformers as tf

    from msrl_core.models import finish_grads, grad_norm, megatron_groups, pipeline_forward
    from msrl_core.reshard import stream_buckets, to_hf

    V = mc.vocab_size
    W = torch.randn(*tokens.shape, V, generator=torch.Generator().manual_seed(11))
    model.zero_grad(set_to_none=True)
    out = pipeline_forward(model, tokens)
    if out.dim() == 3:  # this rank holds the logits (dst stage)
        (out[..., :V] * W).sum().backward()
    else:
        out.backward()
    finish_grads(model)
    norm = grad_norm(model)
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    got: dict = {}
    for bucket in stream_buckets(
        grads, to_hf(mc, train), megatron_groups(), names="hf", bucket_bytes=1 << 16
    ):
        got.update((n, t.clone()) for n, t in bucket)
    if rank != 0:
        return {}
    hf = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    (hf(tokens).logits * W).sum().backward()
    want: dict = {}
    for n, p in hf.named_parameters():
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up|down)_proj", n)
        if m is None:
            want[n] = p.grad
            continue
        for e in range(p.shape[0]):
            x = f"{m.group(1)}{e}."
            if m.group(2) == "down":
                want[x + "down_proj.weight"] = p.grad[e]
            else:
                f = p.shape[1] // 2
                want[x + "gate_proj.weight"], want[x + "up_proj.weight"] = p.grad[e, :f], p.grad[e, f:]
    scale = max(float(g.abs().max()) for g in want.values())
    diff = {n: float((got[n].reshape(g.shape) - g).abs().max()) for n, g in want.items() if n in got}
    worst = max(diff, key=diff.__getitem__)
    hf_norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in want.values())))
    return {
        "names_equal": sorted(want) == sorted(got),
        "max_abs_diff": diff[worst],
        "worst": worst,
        "scale": scale,
        "grad_norm": norm,
        "hf_grad_norm": hf_norm,
    }


def _train_steps(model, mc, src: str, tokens, rank: int, steps: int = 3, lr: float = 0.05) -> dict:
    """``steps`` SGD steps of next-token cross-entropy on every rank (pipeline_forward, finish_grads, the
    same update of every shard); the losses on the logits' rank, and transformers' losses of the same steps
    on rank 0."""
    import torch
    import torch.nn.functional as F
    import transformers as tf

    from msrl_core.models import finish_grads, pipeline_forward

    V = mc.vocab_size
    targets = torch.randint(0, V, tokens.shape, generator=torch.Generator().manual_seed(5))
    losses = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        out = pipeline_forward(model, tokens)
        if out.dim() == 3:
            loss = F.cross_entropy(out[..., :V].reshape(-1, V), targets.reshape(-1))
            loss.backward()
            losses.append(float(loss))
        else:
            out.backward()
        finish_grads(model)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(lr * p.grad)
    res: dict = {"losses": losses}
    if rank == 0:
        hf = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
        opt = torch.optim.SGD(hf.parameters(), lr=lr)
        hf_losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = F.cross_entropy(hf(tokens).logits.reshape(-1, V), targets.reshape(-1))
            loss.backward()
            opt.step()
            hf_losses.append(float(loss))
        res["hf_losses"] = hf_losses
    return res
