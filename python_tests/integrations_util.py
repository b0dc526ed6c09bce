"""Worker side of the Megatron-engine integration tests (python_tests/test_integrations_verl.py and the verl
tier, verl_tests/): a real megatron-core GPTModel on CPU over gloo, its weights through
``msrl_core.integrations.megatron.HFWeightExport`` compared with the reference HF layout (plain torch,
``msrl_core.reshard.reference``), and ``MirrorOffload`` round trips."""

from __future__ import annotations

import zlib


def build(case: dict):
    """(model, cfg, hf_config, parallel_state) for a case: megatron_harness's GPTModel (local layer spec)."""
    import megatron_harness

    cfg = megatron_harness.model_config(case)
    model, _groups, ps = megatron_harness._build_megatron(
        cfg, case.get("tp", 1), case.get("pp", 1), case.get("ep", 1)
    )
    hf_config = megatron_harness.hf_model(cfg).config
    return model, cfg, hf_config, ps


def all_shards(params: dict, ps) -> dict:
    """{(stage, tp_rank, ep_rank): {local-spec name: tensor}} of every rank (tiny models: gathered)."""
    import torch.distributed as dist

    from msrl_core.reshard.steps import normalize_params

    key = (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )
    mine = {n: p.detach().clone() for n, p in normalize_params(params).items()}
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, (key, mine))
    # with EP > 1 the experts (expert TP 1) vary with the EP rank and the rest with the TP rank, and the
    # ranks need not cover every (tp, ep) pair: compose the shards the reference wants from the two halves
    ep = ps.get_expert_model_parallel_world_size()
    dense: dict = {}
    experts: dict = {}
    for (s, t, e), d in got:
        dense.setdefault((s, t), {n: v for n, v in d.items() if ep == 1 or ".experts." not in n})
        experts.setdefault((s, e), {n: v for n, v in d.items() if ep > 1 and ".experts." in n})
    return {
        (s, t, e): {**dense[(s, t)], **experts[(s2, e)]} for (s, t) in dense for (s2, e) in experts if s2 == s
    }


def compare(got: dict, exp: dict) -> dict:
    """Names, shapes, dtypes and values of two ``{hf_name: tensor}``; what differs, by name."""
    import torch

    return {
        "names_equal": sorted(got) == sorted(exp),
        "missing": sorted(set(exp) - set(got))[:8],
        "extra": sorted(set(got) - set(exp))[:8],
        "shape_mismatch": [n for n in exp if n in got and tuple(got[n].shape) != tuple(exp[n].shape)][:8],
        "dtype_mismatch": [n for n in exp if n in got and got[n].dtype != exp[n].dtype][:8],
        "value_mismatch": [
            n
            for n in exp
            if n in got and got[n].shape == exp[n].shape and not torch.equal(got[n].to(exp[n].dtype), exp[n])
        ][:8],
        "count": len(got),
    }


def crcs(params: dict) -> dict:
    return {n: zlib.crc32(p.detach().clone().numpy().tobytes()) for n, p in params.items()}


# ---------------------------------------------------------------------------------------------------------
# the quick case (python_tests): HFWeightExport vs the reference HF layout, MirrorOffload round trip


def export_and_offload_case(case: dict, rank: int, world: int) -> dict:
    import torch

    from msrl_core.integrations.megatron import HFWeightExport, MirrorOffload, megatron_layout
    from msrl_core.reshard import SwapStateError, reference

    model, cfg, hf_config, ps = build(case)
    params = dict(model.named_parameters())
    res: dict = {}
    lcfg, train = megatron_layout([model], hf_config, ps)
    res["layout"] = {"arch": lcfg.arch, "dtype": lcfg.dtype, "tp": train.tp, "pp": train.pp, "ep": train.ep}
    exp = reference.megatron_to_hf(cfg, train, all_shards(params, ps))
    export = HFWeightExport(bucket_bytes=case.get("bucket_bytes", 16 << 10))
    got = {n: t.clone() for n, t in export.weights([model], hf_config, ps)}
    res["vs_reference"] = compare(got, exp)
    res["buckets"] = export.telemetry.buckets
    res["plan_reused"] = export.plan(lcfg, train) is next(iter(export._plans.values()))

    before = crcs(params)
    res["param_bytes"] = sum(p.nbytes for p in params.values())
    for p in params.values():
        p.grad = torch.ones_like(p)
    off = MirrorOffload()
    off.offload_model([model])
    res["weights_freed"] = all(p.untyped_storage().nbytes() == 0 for p in params.values())
    res["grads_freed"] = all(p.grad.untyped_storage().nbytes() == 0 for p in params.values())
    res["weight_bytes"] = off.stats.weight_bytes
    res["host_new_first"] = off.stats.host_new_bytes
    first = next(iter(params))
    try:
        params[first].sum()
        res["guarded"] = ""
    except SwapStateError as e:
        res["guarded"] = str(e)
    res["first"] = first
    off.offload_model([model])  # idempotent
    off.load_model([model], grad=True)
    res["restored_equal"] = crcs(params) == before
    res["grads_zero"] = all(bool((p.grad == 0).all()) for p in params.values())
    off.offload_model([model])
    res["host_new_second"] = off.stats.host_new_bytes
    off.load_model([model], grad=False)
    res["grads_left_freed"] = all(p.grad.untyped_storage().nbytes() == 0 for p in params.values())
    off.load_model([model], grad=True)

    # optimizer state + fp32 masters through TrainingStateOffload
    opt = torch.optim.Adam(list(params.values()), lr=1e-3)
    opt.step()
    moments = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params.values()}
    off.offload_optimizer(opt, [model])
    res["optimizer_freed"] = off.stats.optimizer_bytes
    res["moments_freed"] = all(
        opt.state[p]["exp_avg"].untyped_storage().nbytes() == 0 for p in params.values()
    )
    off.load_optimizer()
    res["moments_equal"] = all(
        torch.equal(opt.state[p][k], v) for p in params.values() for k, v in moments[id(p)].items()
    )
    res["moment_bytes"] = sum(
        opt.state[p][k].nbytes for p in params.values() for k in ("exp_avg", "exp_avg_sq")
    )
    return res


def quick_main(rank: int, world: int, port: int, cases: list[dict], out: str) -> None:
    import megatron_harness

    megatron_harness.serve(rank, world, port, cases, out, export_and_offload_case)
