"""verl's Megatron engine on msrl_core's weight switch, switched on by configuration:

    actor_rollout_ref.model.external_lib=msrl_core.integrations.verl

verl imports the modules named there inside every worker (``HFModelConfig.__post_init__`` →
``import_external_libs``). Importing this module checks the verl version and replaces, on
``verl.workers.engine.megatron.transformer_impl.MegatronEngine`` (and so on its LM-head and value-head
subclasses, which do not override them):

- ``get_per_tensor_param``: the ``(hf_name, tensor)`` iterator verl's rollout side loads is produced by
  :class:`~msrl_core.integrations.megatron.HFWeightExport` (``stream_buckets`` under Hugging Face names:
  one bucketed gather and one fused copy per bucket) instead of Megatron-Bridge / mbridge exporting one
  parameter at a time. Returns ``(iterator, None)`` like verl's. LoRA, QAT, FP8 export, MTP layers,
  virtual pipeline stages, architectures msrl_core's plan does not know and any model its checks reject
  (every rank alike, after their agreement) fall back to verl's own method (one warning says why). A
  tensor the rank holds as one contiguous range of its own parameter (TP 1 dense weights, its own experts,
  replicated norms) is yielded as a view of the parameter, with no gather and no copy, as mbridge does at
  TP 1; another EP rank's expert as a view of the gather scratch; the rest from the reused output bucket;
- ``to``: weight offload to persistent pinned host mirrors in one batched copy each way
  (:class:`~msrl_core.integrations.megatron.MirrorOffload`), and the optimizer state and fp32 master
  weights through :class:`~msrl_core.reshard.TrainingStateOffload`, instead of verl's pageable per-buffer
  copies. Gradients are freed on offload and come back as zeros, as in verl;
- ``save_checkpoint`` / ``load_checkpoint``: wrapped only so that they see the weights on the device
  (they call verl's offload helpers directly, which know nothing of the mirrors) and leave them
  offloaded through the mirrors afterwards.

Environment (read at import; put them in ``ray_kwargs.ray_init.runtime_env.env_vars`` to reach the workers):
``MSRL_VERL_WEIGHTS`` = ``stream`` (default) | ``verl``; ``MSRL_VERL_OFFLOAD`` = ``mirror`` (default) |
``verl``; ``MSRL_VERL_BUCKET_MB`` = positive int (default 64); ``MSRL_VERL_COPY`` = ``0`` (default) | ``1``
(yield clones instead of views of the reused bucket); ``MSRL_VERL_INPLACE`` = ``1`` (default) | ``0`` (copy
every tensor through the stream's scratch instead of yielding views of the parameters and the gather
scratch).

Supported verl versions: :data:`SUPPORTED_VERL`. Both have the same ``MegatronEngine.get_per_tensor_param``
and ``to`` (compared line by line); any other version raises :class:`UnsupportedVerl` at import.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from msrl_core.errors import Unsupported
from msrl_core.reshard import ReshardError

from .megatron import HFWeightExport, MirrorOffload

__all__ = [
    "SUPPORTED_VERL",
    "Settings",
    "UnsupportedVerl",
    "check_version",
    "install",
    "settings",
    "uninstall",
]

logger = logging.getLogger(__name__)

# verl 0.9.1 (PyPI) and verl-project/verl main at 1dda039 (0.10.0.dev): the same two methods.
SUPPORTED_VERL = ("0.9.1", "0.10.0.dev")

_SIGNATURES = {
    "get_per_tensor_param": ("self", "base_sync_done", "kwargs"),
    "to": ("self", "device", "model", "optimizer", "grad"),
    "save_checkpoint": ("self", "local_path", "hdfs_path", "global_step", "max_ckpt_to_keep", "kwargs"),
    "load_checkpoint": ("self", "local_path", "hdfs_path", "del_local_after_load", "kwargs"),
}

ORIGINAL: dict[str, Any] = {}  # verl's own methods while the patch is installed


class UnsupportedVerl(Unsupported, ImportError):  # type: ignore[misc]
    """The installed verl is not a version this adapter was written and tested against."""


def check_version(version: str, where: str = "") -> None:
    """Raise :class:`UnsupportedVerl` unless ``version`` is one of :data:`SUPPORTED_VERL`."""
    if version not in SUPPORTED_VERL:
        at = f" at {where}" if where else ""
        raise UnsupportedVerl(
            f"msrl_core.integrations.verl supports verl {' and '.join(SUPPORTED_VERL)}; found verl "
            f"{version!r}{at}. Install verl==0.9.1, or drop msrl_core.integrations.verl from "
            "actor_rollout_ref.model.external_lib to run verl unchanged"
        )


@dataclass(frozen=True)
class Settings:
    weights: str = "stream"
    offload: str = "mirror"
    bucket_bytes: int = 64 << 20
    copy: bool = False
    inplace: bool = True


def settings(env: Mapping[str, str] | None = None) -> Settings:
    """The adapter's settings from the environment; a bad value raises ``ValueError`` naming it."""
    env = os.environ if env is None else env

    def choice(key: str, allowed: tuple[str, ...]) -> str:
        v = env.get(key, allowed[0])
        if v not in allowed:
            raise ValueError(f"{key}={v!r}; allowed: {', '.join(allowed)}")
        return v

    mb = env.get("MSRL_VERL_BUCKET_MB", "64")
    if not mb.isdigit() or int(mb) < 1:
        raise ValueError(f"MSRL_VERL_BUCKET_MB={mb!r}; allowed: a positive integer (MiB)")
    return Settings(
        weights=choice("MSRL_VERL_WEIGHTS", ("stream", "verl")),
        offload=choice("MSRL_VERL_OFFLOAD", ("mirror", "verl")),
        bucket_bytes=int(mb) << 20,
        copy=choice("MSRL_VERL_COPY", ("0", "1")) == "1",
        inplace=choice("MSRL_VERL_INPLACE", ("1", "0")) == "1",
    )


# ---------------------------------------------------------------------------------------------------------
# the overrides


def _export(engine: Any) -> HFWeightExport:
    exp = getattr(engine, "_msrl_export", None)
    if exp is None:
        s = _SETTINGS
        exp = engine._msrl_export = HFWeightExport(
            bucket_bytes=s.bucket_bytes, copy=s.copy, inplace=s.inplace
        )
    return exp


def _offload(engine: Any) -> MirrorOffload:
    off = getattr(engine, "_msrl_offload", None)
    if off is None:
        off = engine._msrl_offload = MirrorOffload()
    return off


def fallback_reason(engine: Any) -> str | None:
    """Why ``get_per_tensor_param`` must run verl's own code for this engine, or ``None``."""
    from msrl_core.reshard import ModelConfig

    if _SETTINGS.weights == "verl":
        return "MSRL_VERL_WEIGHTS=verl"
    if getattr(engine, "peft_cls", None) is not None:
        return "LoRA (peft) is on"
    if getattr(engine, "_qat_enabled", False):
        return "QAT is on"
    if getattr(getattr(engine, "bridge", None), "export_weight_dtype", None) == "fp8":
        return "the bridge exports FP8"
    if getattr(getattr(engine.model_config, "mtp", None), "enable", False):
        return "MTP layers are on"
    if len(engine.module) != 1:
        return f"{len(engine.module)} model chunks (virtual pipeline stages)"
    model_type = getattr(engine.model_config.hf_config, "model_type", None)
    if model_type not in ModelConfig.ARCHS:
        return f"model_type {model_type!r} (msrl_core supports {', '.join(ModelConfig.ARCHS)})"
    return None


_warned: set[str] = set()


def get_per_tensor_param(self: Any, base_sync_done: bool = False, **kwargs: Any) -> tuple[Any, Any]:
    """verl's contract: ``(iterator of (hf_name, tensor), peft_config)``, every rank iterating to the end."""
    off = getattr(self, "_msrl_offload", None)
    if off is not None and off.model_offloaded:
        # first, also before verl's own export: verl's loader knows nothing of the mirrors.
        # As in verl, the weights come back and the gradients do not.
        off.load_model(self.module, grad=False)
    reason = fallback_reason(self)
    if reason is None:
        from verl.utils.megatron_utils import load_megatron_model_to_gpu

        load_megatron_model_to_gpu(self.module, load_grad=False)  # a no-op unless verl's own code offloaded
        try:
            # the checks and the ranks' agreement run before this returns: every rank raises alike
            return _export(self).weights(self.module, self.model_config.hf_config), None
        except ReshardError as e:
            reason = f"msrl_core's plan does not fit this model: {e}"
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("msrl_core.integrations.verl: verl's own get_per_tensor_param is used: %s", reason)
    return ORIGINAL["get_per_tensor_param"](self, base_sync_done=base_sync_done, **kwargs)


def to(self: Any, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
    """verl's ``to``, with the pinned-mirror swap in place of the pageable copies."""
    if _SETTINGS.offload == "verl":
        return ORIGINAL["to"](self, device, model=model, optimizer=optimizer, grad=grad)
    from verl.utils import device as verl_device
    from verl.workers.engine.base import BaseEngine

    # verl's own argument check
    BaseEngine.to(self, device=device, model=model, optimizer=optimizer, grad=grad)
    device_name = verl_device.get_device_name()
    off = _offload(self)
    opt = getattr(self, "optimizer", None)
    if device == device_name:
        if model:
            off.load_model(self.module, grad=grad)
        if optimizer and opt is not None:
            off.load_optimizer()
    elif device == "cpu":
        if model:
            off.offload_model(self.module)
        if optimizer and opt is not None:
            off.offload_optimizer(opt, self.module)
    else:
        raise ValueError(f"Invalid device {device!r}; allowed: {device_name!r}, 'cpu'")
    return None


def _around_checkpoint(name: str) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        off = getattr(self, "_msrl_offload", None)
        if off is None or _SETTINGS.offload == "verl":
            return ORIGINAL[name](self, *args, **kwargs)
        param, optim = self._is_offload_param, self._is_offload_optimizer
        on = off.model_offloaded
        self.to(verl_device_name(), model=on, optimizer=off.optimizer_offloaded, grad=on)
        # verl's checkpoint code offloads through its own helpers when these are set: ours do it after
        self._is_offload_param = self._is_offload_optimizer = False
        try:
            return ORIGINAL[name](self, *args, **kwargs)
        finally:
            self._is_offload_param, self._is_offload_optimizer = param, optim
            if param or optim:
                self.to("cpu", model=param, optimizer=optim, grad=param)

    wrapper.__name__ = name
    wrapper.__doc__ = f"verl's ``{name}`` with the weights on the device while it runs (mirror offload)."
    return wrapper


def verl_device_name() -> str:
    from verl.utils import device as verl_device

    return verl_device.get_device_name()


_PATCHES = {
    "get_per_tensor_param": get_per_tensor_param,
    "to": to,
    "save_checkpoint": _around_checkpoint("save_checkpoint"),
    "load_checkpoint": _around_checkpoint("load_checkpoint"),
}


def _engine_class() -> Any:
    import verl

    check_version(verl.__version__, os.path.dirname(verl.__file__))
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    for name, want in _SIGNATURES.items():
        have = tuple(inspect.signature(getattr(MegatronEngine, name)).parameters)
        if have != want:
            raise UnsupportedVerl(
                f"verl {verl.__version__}: MegatronEngine.{name}{have} is not the signature this adapter "
                f"replaces, {want}"
            )
    return MegatronEngine


def install() -> None:
    """Replace the four methods on verl's ``MegatronEngine`` (idempotent)."""
    if ORIGINAL:
        return
    cls = _engine_class()
    for name, fn in _PATCHES.items():
        ORIGINAL[name] = cls.__dict__[name]
        setattr(cls, name, fn)


def uninstall() -> None:
    """Put verl's own methods back."""
    if not ORIGINAL:
        return
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    for name, fn in ORIGINAL.items():
        setattr(MegatronEngine, name, fn)
    ORIGINAL.clear()


_SETTINGS = settings()
install()
