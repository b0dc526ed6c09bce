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
