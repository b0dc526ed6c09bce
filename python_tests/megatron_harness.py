"""Multi-process harness for the reshard tests: real megatron-core GPTModel on CPU over gloo, resharded with
msrl_core, loaded into the transformers model of the same architecture, logits compared.

``run(cases, world)`` spawns ``world`` processes once and runs every case in them (process start-up and the
megatron/transformers imports dominate the cost); each rank returns a dict of results per case.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import traceback
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))

SEQ = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cases: list[dict], world: int = 2, timeout: float = 600.0) -> list[dict]:
    """Run ``cases`` in ``world`` spawned processes; returns per-rank ``{case_name: result}``."""
    return spawn(_main, cases, world, timeout, "megatron workers")


def spawn(main, cases: list, world: int, timeout: float, what: str) -> list[dict]:
    """Spawn ``main(rank, world, port, cases, out_dir)`` in ``world`` processes once; each rank writes
    ``rank{r}.json``. Returns the per-rank results; kills the workers past ``timeout``."""
    import time

    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(prefix="msrl_mg_")
    ctx = mp.start_processes(
        main, args=(world, free_port(), cases, out), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=2.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{what} did not finish in {timeout} s")
    res = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            res.append(json.load(f))
    return res


# ---------------------------------------------------------------------------------------------------------
# inside the workers


def _main(rank: int, world: int, port: int, cases: list[dict], out: str) -> None:
    serve(rank, world, port, cases, out, _run_case)


def serve(rank: int, world: int, port: int, cases: list[dict], out: str, run_case) -> None:
    """A worker's body: join the gloo world, run ``run_case(case, rank, world)`` for every case (an exception
    is recorded as the case's result), write ``rank{r}.json``."""
    sys.path.insert(0, HERE)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import megatron_compat

    megatron_compat.patch()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    for case in cases:
        try:
            results[case["name"]] = run_case(case, rank, world)
        except Exception as e:  # recorded, the test asserts on it
            results[case["name"]] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def model_config(case: dict):
    from msrl_core.reshard import ModelConfig

    return ModelConfig(**case["model"])


def hf_model(cfg, rope_theta: float | None = None):
    import torch
    import transformers as tf

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.hd,
        rms_norm_eps=cfg.norm_epsilon,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta or cfg.rope_theta},
    )
    if cfg.arch == "qwen2":
        c, M = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif cfg.arch == "llama":
        c, M = tf.LlamaConfig(attention_bias=cfg.qkv_bias, mlp_bias=False, **common), tf.LlamaForCausalLM
    elif cfg.arch == "qwen3_moe":
        c = tf.Qwen3MoeConfig(
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.moe_intermediate_size,
            num_experts_per_tok=cfg.moe_router_topk,
            norm_topk_prob=cfg.moe_norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
        M = tf.Qwen3MoeForCausalLM
    elif cfg.arch == "qwen2_moe":
        common.pop("head_dim")
        assert cfg.hd * cfg.num_attention_heads == cfg.hidden_size
        c = tf.Qwen2MoeConfig(
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            num_experts_per_tok=cfg.moe_router_topk,
            norm_topk_prob=cfg.moe_norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            qkv_bias=cfg.qkv_bias,
            **common,
        )
        M = tf.Qwen2MoeForCausalLM
    else:
        raise ValueError(cfg.arch)
    c._attn_implementation = "eager"
    torch.manual_seed(0)
    return M(c).eval()


def load_hf(model, cfg, tensors: dict) -> None:
    """Load HF checkpoint-layout tensors (per-expert MoE names) into a transformers 5 model, whose MoE
    experts are fused ``gate_up_proj [E, 2F, H]`` / ``down_proj [E, H, F]``."""
    import torch

    sd = dict(tensors)
    if cfg.is_moe:
        for i in range(cfg.num_layers):
            h = f"model.layers.{i}.mlp.experts."
            E = cfg.num_experts
            sd[h + "gate_up_proj"] = torch.stack(
                [
                    torch.cat([sd.pop(h + f"{e}.gate_proj.weight"), sd.pop(h + f"{e}.up_proj.weight")])
                    for e in range(E)
                ]
            )
            sd[h + "down_proj"] = torch.stack([sd.pop(h + f"{e}.down_proj.weight") for e in range(E)])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    # Llama's attention_bias also adds an o_proj bias, which Megatron's add_qkv_bias does not have: zero it
    for m in [m for m in missing if m.endswith("self_attn.o_proj.bias")]:
        model.get_parameter(m).data.zero_()
        missing.remove(m)
    assert not missing and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def hf_load_weights(model, cfg, bucket) -> None:
    """A ``load_weights`` for a transformers 5 model fed HF checkpoint names bucket by bucket (per-expert MoE
    tensors written into the fused ``gate_up_proj [E, 2F, H]`` / ``down_proj [E, H, F]``)."""
    import re

    import torch

    with torch.no_grad():
        for name, t in bucket:
            m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight", name)
            if m is None:
                model.get_parameter(name).copy_(t)
                continue
            head, e, which = m.group(1), int(m.group(2)), m.group(3)
            if which == "down":
                model.get_parameter(head + "down_proj")[e].copy_(t)
            else:
                f = t.shape[0]
                lo = 0 if which == "gate" else f
                model.get_parameter(head + "gate_up_proj")[e, lo : lo + f].copy_(t)


def _stream_into_hf(model, plan, groups, cfg, tokens, ref_logits, bucket_bytes: int) -> dict:
    """stream_buckets (HF names) loaded bucket by bucket into a fresh transformers model; logits vs Megatron's
    and the measured peak of the stream against gather scratch + one output bucket."""
    import torch

    from msrl_core.reshard import stream_buckets
    from msrl_core.reshard.memory import MemoryProbe

    hf = hf_model(cfg)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("self_attn.o_proj.bias"):  # Megatron's add_qkv_bias has no o_proj bias
                p.zero_()
    stream = stream_buckets(model, plan, groups, names="hf", bucket_bytes=bucket_bytes)
    with MemoryProbe() as probe:
        for bucket in stream:
            hf_load_weights(hf, cfg, bucket)
    t = stream.telemetry
    res = {
        "buckets": t.buckets,
        "peak": probe.peak_bytes,
        "scratch": t.gather_scratch_bytes + t.output_scratch_bytes,
        "output_scratch": t.output_scratch_bytes,
        "largest_tensor": max(int(v.numel()) * v.element_size() for v in hf.state_dict().values()),
    }
    if ref_logits is not None:
        with torch.no_grad():
            got = hf(tokens).logits
        res["logits_max_abs_diff"] = float((got - ref_logits[..., : cfg.vocab_size]).abs().max())
    return res


def _build_megatron(cfg, tp: int, pp: int, ep: int):
    """The package's builder (:func:`msrl_core.models.build_gpt`), values randomised deterministically."""
    from megatron.core import parallel_state as ps

    from msrl_core.models import build_gpt, megatron_groups
    from msrl_core.reshard import Parallel

    model = build_gpt(cfg, Parallel(tp=tp, pp=pp, ep=ep), seed=1234, reinit=True).eval()
    _randomize(model, ps)
    return model, megatron_groups(), ps


def _randomize(model, ps) -> None:
    """Deterministic values: replicated params equal on every TP rank, sharded params differ per rank,
    expert params differ per EP rank, tied output layer equal to the embedding."""
    import torch

    tp_rank = ps.get_tensor_model_parallel_rank()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    for name, p in model.named_parameters():
        key_name, stage = name, pp_rank
        if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            key_name, stage = "embedding.word_embeddings.weight", 0
        sharded = getattr(p, "tensor_model_parallel", False)
        expert = ".experts." in name
        key = f"{key_name}|{stage}|{tp_rank if sharded else 0}|{ep_rank if expert else 0}"
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        with torch.no_grad():
            if "layernorm" in name or "norm" in name.split(".")[-2]:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embedding" in key_name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _megatron_logits(model, ps, tokens):
    """Forward through all PP stages (send/recv between stages); logits on the last stage, else None."""
    import torch
    import torch.distributed as dist

    pos = torch.arange(tokens.shape[1]).unsqueeze(0)
    pp = ps.get_pipeline_model_parallel_world_size()
    with torch.no_grad():
        if pp == 1:
            return model(tokens, pos, None)
        st = ps.get_pipeline_model_parallel_rank()
        grp = ps.get_pipeline_model_parallel_group()
        H = model.config.hidden_size
        if st > 0:
            h = torch.empty(tokens.shape[1], tokens.shape[0], H)
            dist.recv(h, src=dist.get_global_rank(grp, st - 1))
            model.set_input_tensor(h)
        y = model(tokens, pos, None)
        if st < pp - 1:
            dist.send(y.contiguous(), dst=dist.get_global_rank(grp, st + 1))
            return None
        return y


def _crcs(model) -> dict:
    # clone: .numpy() on a parameter would make its storage non-resizable (no swap-out possible)
    return {n: zlib.crc32(p.detach().clone().numpy().tobytes()) for n, p in model.named_parameters()}


def _run_case(case: dict, rank: int, world: int) -> dict:
    import torch

    import msrl_core
    from msrl_core.reshard import Parallel, megatron_to_vllm, naive_reshard, reference, to_hf

    cfg = model_config(case)
    tp, pp, ep = case.get("tp", 1), case.get("pp", 1), case.get("ep", 1)
    model, groups, ps = _build_megatron(cfg, tp, pp, ep)
    train = Parallel(tp=tp, pp=pp, ep=ep)
    res: dict = {"rank": rank}
    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(7))
    ref_logits = _megatron_logits(model, ps, tokens)
    before = _crcs(model)

    plan = to_hf(cfg, train)
    flat, views = plan.allocate_inference()
    swap = msrl_core.allgather_swap(
        model, flat, plan, groups, bucket_bytes=case.get("bucket_bytes", 32 << 10), measure=True
    )
    res["hf_telemetry"] = {k: v for k, v in swap.telemetry.items() if isinstance(v, (int, float, str, bool))}
    res["freed_all"] = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    res["param_objects_kept"] = len(list(model.parameters())) == len(before)
    if ref_logits is not None:
        hf = hf_model(cfg)
        load_hf(hf, cfg, views)
        with torch.no_grad():
            got = hf(tokens).logits
        V = cfg.vocab_size
        res["logits_max_abs_diff"] = float((got - ref_logits[..., :V]).abs().max())
        res["logits_scale"] = float(ref_logits[..., :V].abs().max())
    if case.get("save") and rank == 0:  # the HF-layout tensors, for the vLLM tier (vllm_tests/)
        torch.save({"hf": {k: v.clone() for k, v in views.items()}}, case["save"])
    swap.swap_back()
    swap.wait()
    res["restored_equal"] = _crcs(model) == before
    again = _megatron_logits(model, ps, tokens)
    if ref_logits is not None:
        res["forward_after_swap_back_equal"] = bool(torch.equal(again, ref_logits))
    res["stream_hf"] = _stream_into_hf(model, plan, groups, cfg, tokens, ref_logits, 16 << 10)

    # vLLM layout, real distributed execution: infer tp = world (rank = infer rank), vs vLLM rules from HF
    if case.get("vllm_tp"):
        ti = case["vllm_tp"]
        hf_full = {k: v.clone() for k, v in views.items()}
        vplan = megatron_to_vllm(cfg, train, Parallel(tp=ti, ep=case.get("vllm_ep", 1)))
        vflat, vviews = vplan.allocate_inference(infer_rank=rank % ti)
        vs = msrl_core.allgather_swap(
            model,
            vflat,
            vplan,
            groups,
            bucket_bytes=16 << 10,
            verify=True,
            gather=case.get("gather", "auto"),
            measure=True,
        )
        exp = reference.hf_to_vllm(cfg, vplan.infer, rank % ti, hf_full)
        res["vllm_names_equal"] = sorted(exp) == sorted(vviews)
        res["vllm_mismatch"] = [n for n in exp if n in vviews and not torch.equal(exp[n], vviews[n])]
        res["vllm_telemetry"] = {
            k: v for k, v in vs.telemetry.items() if isinstance(v, (int, float, str, bool))
        }
        vs.swap_back().wait()
        res["vllm_restored_equal"] = _crcs(model) == before
        got = {}
        for bucket in msrl_core.reshard.stream_buckets(
            model, vplan, groups, names="vllm", bucket_bytes=8 << 10
        ):
            got.update((n, t.clone()) for n, t in bucket)
        res["stream_vllm_names_equal"] = sorted(got) == sorted(exp)
        res["stream_vllm_mismatch"] = [n for n in exp if n in got and not torch.equal(exp[n], got[n])]
        # same run: naive path (per-parameter all_gather + torch slicing, everything kept)
        _, naive_bytes = naive_reshard(model, vplan, groups, infer_rank=rank % ti)
        res["naive_bytes_vllm"] = naive_bytes + int(vflat.numel())
        _, naive_hf = naive_reshard(model, plan, groups, infer_rank=0)
        res["naive_bytes_hf"] = naive_hf + int(flat.numel())

    if case.get("errors"):
        res["errors"] = _error_cases(model, plan, groups, cfg, train, before, tokens, ps)
    return res


def _error_cases(model, plan, groups, cfg, train, before, tokens, ps) -> dict:
    """Bad inputs that need real process groups; each records the message and whether weights survived."""
    import msrl_core
    from msrl_core.reshard import Parallel, ReshardError, to_hf

    out = {}

    def attempt(label, fn):
        try:
            fn()
            out[label] = {"raised": None}
        except ReshardError as e:
            out[label] = {"raised": type(e).__name__, "msg": str(e)}
        except Exception as e:  # wrong type of error
            out[label] = {"raised": "OTHER:" + type(e).__name__, "msg": str(e)}
        out[label]["intact"] = _crcs(model) == before

    flat, _ = plan.allocate_inference()
    import torch.distributed as dist

    # bad input on one rank only: every rank gets an error, none is left blocked in a collective
    bad = dict(model.named_parameters())
    if dist.get_rank() == 1:
        del bad["decoder.layers.1.mlp.linear_fc2.weight"]
    attempt("one_rank_bad", lambda: msrl_core.allgather_swap(bad, flat, plan, groups))
    attempt("missing_tp_group", lambda: msrl_core.allgather_swap(model, flat, plan, {**groups, "tp": None}))
    p1 = to_hf(cfg, Parallel(tp=1))
    f1, _ = p1.allocate_inference()
    attempt("wrong_group_size", lambda: msrl_core.allgather_swap(model, f1, p1, groups))
    return out
