"""Importing msrl_core.integrations.verl against the installed verl: which methods it replaces, the version
and signature checks at import (one clear message each), the fallbacks to verl's own export, settings."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

QWEN2 = SimpleNamespace(model_type="qwen2")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


def _last_line(p: subprocess.CompletedProcess) -> str:
    return p.stderr.strip().splitlines()[-1]


def test_installs_on_megatron_engine_and_uninstalls():
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine, MegatronEngineWithLMHead

    import msrl_core.integrations.verl as mv

    assert MegatronEngine.get_per_tensor_param is mv.get_per_tensor_param
    assert MegatronEngine.to is mv.to
    assert (
        MegatronEngineWithLMHead.get_per_tensor_param is mv.get_per_tensor_param
    )  # inherited, not overridden
    assert sorted(mv.ORIGINAL) == ["get_per_tensor_param", "load_checkpoint", "save_checkpoint", "to"]
    mv.install()  # idempotent: verl's originals stay recorded
    assert mv.ORIGINAL["to"].__module__ == "verl.workers.engine.megatron.transformer_impl"
    mv.uninstall()
    try:
        assert MegatronEngine.to.__module__ == "verl.workers.engine.megatron.transformer_impl"
        assert not mv.ORIGINAL
    finally:
        mv.install()
    assert MegatronEngine.to is mv.to


def test_an_unsupported_verl_version_fails_at_import():
    p = _run(
        """
        import verl
        verl.__version__ = "0.8.0"
        import msrl_core.integrations.verl
        """
    )
    assert p.returncode != 0
    line = _last_line(p)
    assert line.startswith(
        "msrl_core.integrations.verl.UnsupportedVerl: msrl_core.integrations.verl supports "
        "verl 0.9.1 and 0.10.0.dev; found verl '0.8.0' at "
    ), line
    assert (
        "Install verl==0.9.1, or drop msrl_core.integrations.verl from actor_rollout_ref.model.external_lib"
        in line
    )


def test_a_changed_method_signature_fails_at_import_and_patches_nothing():
    p = _run(
        """
        from verl.workers.engine.megatron.transformer_impl import MegatronEngine
        def to(self, device, model=True):
            pass
        MegatronEngine.to = to
        try:
            import msrl_core.integrations.verl
        finally:
            gptp = MegatronEngine.get_per_tensor_param
            assert MegatronEngine.to is to and gptp.__module__.startswith("verl.")
        """
    )
    line = _last_line(p)
    assert (
        "UnsupportedVerl: verl 0.9.1: MegatronEngine.to('self', 'device', 'model') is not the signature"
        in line
    )


@pytest.mark.parametrize(
    "attrs,reason",
    [
        ({"peft_cls": object()}, "LoRA (peft) is on"),
        ({"_qat_enabled": True}, "QAT is on"),
        ({"bridge": SimpleNamespace(export_weight_dtype="fp8")}, "the bridge exports FP8"),
        ({"module": [1, 2]}, "2 model chunks (virtual pipeline stages)"),
        (
            {"model_config": SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v3"))},
            "model_type 'deepseek_v3'",
        ),
        (
            {"model_config": SimpleNamespace(hf_config=QWEN2, mtp=SimpleNamespace(enable=True))},
            "MTP layers are on",
        ),
        ({}, None),
    ],
)
def test_fallback_to_verls_own_export(attrs, reason):
    import msrl_core.integrations.verl as mv

    eng = SimpleNamespace(
        peft_cls=None,
        _qat_enabled=False,
        bridge=SimpleNamespace(),
        module=[object()],
        model_config=SimpleNamespace(hf_config=QWEN2),
    )
    for k, v in attrs.items():
        setattr(eng, k, v)
    got = mv.fallback_reason(eng)
    assert (got is None) if reason is None else got.startswith(reason), got


@pytest.mark.parametrize(
    "env,msg",
    [
        ({"MSRL_VERL_WEIGHTS": "mbridge"}, "MSRL_VERL_WEIGHTS='mbridge'; allowed: stream, verl"),
        ({"MSRL_VERL_OFFLOAD": "pageable"}, "MSRL_VERL_OFFLOAD='pageable'; allowed: mirror, verl"),
        ({"MSRL_VERL_BUCKET_MB": "-4"}, "MSRL_VERL_BUCKET_MB='-4'; allowed: a positive integer (MiB)"),
        ({"MSRL_VERL_COPY": "yes"}, "MSRL_VERL_COPY='yes'; allowed: 0, 1"),
        ({"MSRL_VERL_INPLACE": "true"}, "MSRL_VERL_INPLACE='true'; allowed: 1, 0"),
    ],
)
def test_settings_name_the_bad_value(env, msg):
    import msrl_core.integrations.verl as mv

    with pytest.raises(ValueError) as e:
        mv.settings(env)
    assert str(e.value) == msg
    assert mv.settings({"MSRL_VERL_BUCKET_MB": "8", "MSRL_VERL_COPY": "1"}) == mv.Settings(
        bucket_bytes=8 << 20, copy=True
    )
    assert mv.settings({"MSRL_VERL_INPLACE": "0"}) == mv.Settings(inplace=False)
    assert mv.settings({}).inplace


def _small_engine(monkeypatch):
    import torch
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    eng = object.__new__(MegatronEngineWithLMHead)
    eng.module = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))]
    params = list(eng.module[0].parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    eng.optimizer = torch.optim.Adam(params, lr=0.0)
    eng.optimizer.step()
    eng._is_offload_param = eng._is_offload_optimizer = True
    return eng, params


@pytest.mark.parametrize("method", ["save_checkpoint", "load_checkpoint"])
@pytest.mark.parametrize("fails", [False, True])
def test_checkpoint_methods_see_the_weights_and_leave_them_offloaded(monkeypatch, method, fails):
    import torch

    import msrl_core.integrations.verl as mv

    eng, params = _small_engine(monkeypatch)
    before = [p.detach().clone() for p in params]
    eng.to("cpu")  # verl's device name on this CPU machine is "cuda": "cpu" offloads
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    seen = {}

    def original(self, local_path, *a, **k):
        seen["weights"] = all(p.untyped_storage().nbytes() > 0 for p in params)
        seen["moments"] = all(
            self.optimizer.state[p]["exp_avg"].untyped_storage().nbytes() > 0 for p in params
        )
        seen["flags"] = (self._is_offload_param, self._is_offload_optimizer)
        seen["path"] = local_path
        if fails:
            raise OSError("disk full")

    monkeypatch.setitem(mv.ORIGINAL, method, original)
    if fails:
        with pytest.raises(OSError, match="disk full"):
            getattr(eng, method)("/ckpt/step_3")
    else:
        getattr(eng, method)("/ckpt/step_3")
    assert seen == {"weights": True, "moments": True, "flags": (False, False), "path": "/ckpt/step_3"}
    # afterwards (also after an error): verl's flags back, everything offloaded through the mirrors again
    assert (eng._is_offload_param, eng._is_offload_optimizer) == (True, True)
    assert eng._msrl_offload.model_offloaded and eng._msrl_offload.optimizer_offloaded
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    eng.to("cuda")
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(bool((p.grad == 0).all()) for p in params)  # gradients come back as zeros, as in verl


def test_a_fallback_gets_the_weights_back_from_the_mirrors_first(monkeypatch):
    import msrl_core.integrations.verl as mv

    eng, params = _small_engine(monkeypatch)
    eng.to("cpu")
    monkeypatch.setattr(mv, "_SETTINGS", mv.Settings(weights="verl"))
    seen = {}

    def original(self, base_sync_done=False, **kw):
        seen["weights"] = all(p.untyped_storage().nbytes() > 0 for p in params)
        seen["grads"] = any(p.grad.untyped_storage().nbytes() > 0 for p in params)
        return iter(()), None

    monkeypatch.setitem(mv.ORIGINAL, "get_per_tensor_param", original)
    gen, peft = eng.get_per_tensor_param(base_sync_done=True)
    assert list(gen) == [] and peft is None
    assert seen == {"weights": True, "grads": False}  # verl's loader never sees freed storages
    assert not eng._msrl_offload.model_offloaded
