"""Worker side of test_verl_weights.py: per case, the same megatron-core GPTModel through verl's own
``MegatronEngine.get_per_tensor_param`` (mbridge's export) and through the patched one (msrl_core's
``stream_buckets``), compared tensor by tensor; then the patched ``to`` round trip."""

from __future__ import annotations

import verl_util  # first: puts python_tests on sys.path

import integrations_util as iu  # noqa: E402


def differential_case(case: dict, rank: int, world: int) -> dict:
    import torch

    import msrl_core.integrations.verl as mv
    from msrl_core.integrations.megatron import HFWeightExport, megatron_layout
    from msrl_core.reshard import reference

    model, cfg, hf_config, ps = iu.build(case)
    eng = verl_util.verl_engine(model, hf_config)
    params = dict(model.named_parameters())
    res: dict = {"fallback": mv.fallback_reason(eng)}

    eng._msrl_export = HFWeightExport(bucket_bytes=16 << 10)  # the default (64 MiB) holds this model whole
    theirs, theirs_twice = verl_util.collect(mv.ORIGINAL["get_per_tensor_param"](eng)[0])
    gen, peft = eng.get_per_tensor_param()
    ours, ours_twice = verl_util.collect(gen)
    res["peft_config"] = peft
    res["twice"] = theirs_twice + ours_twice
    res["ours_vs_verl"] = iu.compare(ours, theirs)
    if "lm_head.weight" in theirs and "lm_head.weight" not in ours:  # tied embeddings, PP > 1 (see the test)
        res["verl_lm_head_equals_embedding"] = torch.equal(
            theirs.pop("lm_head.weight"), ours["model.embed_tokens.weight"]
        )
        res["ours_vs_verl_but_lm_head"] = iu.compare(ours, theirs)
    tele = eng._msrl_export.telemetry
    res["ours_buckets"] = tele.buckets
    res["telemetry"] = {
        k: getattr(tele, k)
        for k in (
            "inplace_tensors",
            "scratch_views",
            "bytes_inplace",
            "bytes_yielded",
            "gather_buckets",
            "skipped_buckets",
            "direct_buckets",
            "gather_scratch_bytes",
            "output_scratch_bytes",
        )
    }
    # the in-place tensors are views of this rank's own parameter storages (no copy); the others are not
    storages = {p.untyped_storage().data_ptr() for p in params.values()}
    res["aliasing"] = sum(
        t.untyped_storage().data_ptr() in storages for _, t in eng.get_per_tensor_param()[0]
    )
    res["dtypes"] = sorted({str(t.dtype) for t in ours.values()})
    _, train = megatron_layout(eng.module, hf_config, ps)
    res["verl_vs_reference"] = iu.compare(
        theirs, reference.megatron_to_hf(cfg, train, iu.all_shards(params, ps))
    )

    # the patched to(): verl's device name is "cuda" on this CPU machine, so to("cpu") offloads and
    # to("cuda") loads (verl's own to("cpu") would free the CPU storages it has just "copied")
    for p in params.values():
        p.grad = torch.ones_like(p)
    eng.optimizer = torch.optim.Adam(list(params.values()), lr=0.0)  # state, unchanged weights
    eng.optimizer.step()
    before = iu.crcs(params)
    moments = {id(p): {k: v.clone() for k, v in eng.optimizer.state[p].items()} for p in params.values()}
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params.values()}
    eng.to("cpu")
    off = eng._msrl_offload
    res["offloaded"] = {
        "weights": all(p.untyped_storage().nbytes() == 0 for p in params.values()),
        "grads": all(p.grad.untyped_storage().nbytes() == 0 for p in params.values()),
        "optimizer": all(
            eng.optimizer.state[p]["exp_avg"].untyped_storage().nbytes() == 0 for p in params.values()
        ),
        "weight_bytes": off.stats.weight_bytes,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "storages": len(storages),  # DDP: one parameter buffer (padded) per dtype / expert kind
        "storage_bytes": sum(storages.values()),
    }
    # verl's update_weights order: get_per_tensor_param with the weights offloaded brings them back first
    again, _ = verl_util.collect(eng.get_per_tensor_param()[0])
    res["after_offload_vs_verl"] = iu.compare(again, theirs)
    res["grads_still_freed"] = all(p.grad.untyped_storage().nbytes() == 0 for p in params.values())
    eng.to("cpu", model=True, optimizer=False, grad=False)
    eng.to("cuda")
    res["restored_equal"] = iu.crcs(params) == before
    res["grads_zero"] = all(bool((p.grad == 0).all()) for p in params.values())
    res["optimizer_back"] = all(
        eng.optimizer.state[p]["exp_avg"].untyped_storage().nbytes() > 0 for p in params.values()
    )
    res["optimizer_equal"] = all(
        torch.equal(eng.optimizer.state[p][k], v) for p in params.values() for k, v in moments[id(p)].items()
    )
    return res


def main(rank: int, world: int, port: int, cases: list[dict], out: str) -> None:
    import megatron_harness

    megatron_harness.serve(rank, world, port, cases, out, differential_case)
