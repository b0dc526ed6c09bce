"""Hugging Face checkpoints in and out of Megatron shards, through the one reshard plan.

In: :func:`load_hf_checkpoint` asks the plan for this rank's Megatron parameters as pieces of HF tensors
(:meth:`~msrl_core.reshard.ReshardPlan.megatron_targets`, the plan's layout rules read in reverse) and reads
just those slices from the safetensors files (memory-mapped; a TP rank reads its rows or columns, an EP rank
its experts, a PP stage its layers). Out: :func:`save_hf_checkpoint` streams the forward plan's HF-layout
buckets (:func:`~msrl_core.reshard.stream_buckets`) into safetensors shards on one writer rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from msrl_core.reshard.errors import CheckpointError, ReshardError
from msrl_core.reshard.layout import ModelConfig, Parallel, Target
from msrl_core.reshard.plan import ReshardPlan, to_hf
from msrl_core.reshard.steps import Deadline, _collective, check_params, normalize_params

__all__ = [
    "CheckpointError",
    "LoadReport",
    "SafetensorsCheckpoint",
    "ShardLayout",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class ShardLayout:
    """Which shard of the training layout this rank holds: the parallel sizes and this rank's PP stage, TP
    rank and EP rank."""

    train: Parallel = field(default_factory=Parallel)
    pp_rank: int = 0
    tp_rank: int = 0
    ep_rank: int = 0

    def __post_init__(self) -> None:
        for what, v, n in (
            ("pp_rank", self.pp_rank, self.train.pp),
            ("tp_rank", self.tp_rank, self.train.tp),
            ("ep_rank", self.ep_rank, self.train.ep),
        ):
            if not isinstance(v, int) or not 0 <= v < n:
                raise CheckpointError(f"ShardLayout.{what} must be in [0, {n}), got {v!r}")

    @classmethod
    def from_megatron(cls) -> ShardLayout:
        """This rank's layout from megatron-core's ``parallel_state`` (single rank when it is not set up)."""
        try:
            from megatron.core import parallel_state as ps
        except ImportError:
            return cls()
        if not ps.model_parallel_is_initialized():
            return cls()
        ep = ps.get_expert_model_parallel_world_size()
        train = Parallel(
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            ep=ep,
            etp=ps.get_expert_tensor_parallel_world_size(),
        )
        return cls(
            train,
            ps.get_pipeline_model_parallel_rank(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_expert_model_parallel_rank(),
        )


@dataclass
class LoadReport:
    """What one rank read: tensors (slices of them counted once per tensor), bytes, and the files opened."""

    tensors_read: int = 0
    bytes_read: int = 0
    files: list[str] = dataclasses.field(default_factory=list)


class SafetensorsCheckpoint:
    """The tensors of a Hugging Face checkpoint directory: ``model.safetensors`` or the shards listed by
    ``model.safetensors.index.json``. Headers only until a slice is read; reads are memory-mapped slices."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._files: dict[str, Any] = {}
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint directory {path} does not exist")
        index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    wm = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"cannot read the weight_map of {index}: {e}") from e
            if not isinstance(wm, dict):
                raise CheckpointError(f"{index}: weight_map is not an object")
            self.weight_map: dict[str, str] = {str(k): str(v) for k, v in wm.items()}
            self.listing = index
        elif os.path.isfile(single):
            self.weight_map = {}
            self.listing = single
            for name in self._open(SINGLE).keys():  # noqa: SIM118 (a safe_open handle)
                self.weight_map[name] = SINGLE
        else:
            raise CheckpointError(f"no weights in {path}: neither {SINGLE} nor {INDEX} exists")

    def _open(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._files:
            full = os.path.join(self.path, file)
            if os.path.basename(file) != file or not os.path.isfile(full):
                raise CheckpointError(f"checkpoint file {full} (listed in {INDEX}) does not exist")
            try:
                self._files[file] = safe_open(full, framework="pt")
            except Exception as e:
                raise CheckpointError(f"cannot open {full}: {type(e).__name__}: {e}") from e
        return self._files[file]

    def file_of(self, name: str) -> str:
        return os.path.join(self.path, self.weight_map[name])

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape; a :class:`CheckpointError` naming the file when the tensor is absent."""
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name!r} (not in {self.listing})")
        f = self._open(file)
        try:
            return tuple(int(x) for x in f.get_slice(name).get_shape())
        except Exception as e:
            raise CheckpointError(
                f"tensor {name!r} is listed for {self.file_of(name)} but is not in that file ({e})"
            ) from e

    def read(self, name: str, row0: int, nrows: int, col0: int, ncols: int) -> Any:
        """Rows ``[row0, row0 + nrows)`` x cols ``[col0, col0 + ncols)`` of ``name`` seen as ``[rows, cols]``
        (a 1-D tensor is ``[n, 1]``), as a torch tensor of the stored dtype."""
        sl = self._open(self.weight_map[name]).get_slice(name)
        if len(sl.get_shape()) == 1:
            return sl[row0 : row0 + nrows].reshape(nrows, 1)
        return sl[row0 : row0 + nrows, col0 : col0 + ncols]

    def close(self) -> None:
        self._files.clear()


def _params_of(model_or_shards: Any) -> dict[str, Any]:
    if isinstance(model_or_shards, Mapping) or hasattr(model_or_shards, "named_parameters"):
        return normalize_params(model_or_shards)
    raise CheckpointError(
        "model_or_shards must be a module or a {name: tensor} mapping, got "
        f"{type(model_or_shards).__name__}"
    )


def _check_params(plan: ReshardPlan, params: dict[str, Any], stage: int) -> None:
    """The parameters are the stage's set of the layout, shapes and dtype alike (the switch's own check)."""
    try:
        check_params(plan, params, stage)
    except ReshardError as e:
        raise CheckpointError(f"the Megatron shards do not fit {plan.cfg.arch} {plan.train}: {e}") from e


def _check_checkpoint(plan: ReshardPlan, ckpt: SafetensorsCheckpoint) -> None:
    """Every tensor of the model is in the checkpoint with the shape ``config.json`` implies (headers only):
    a partial checkpoint is refused on every rank, also where this rank's slices happen to be present."""
    for name in plan.hf:
        want = plan.hf[name].shape
        have = ckpt.shape(name)
        if have != want:
            raise CheckpointError(
                f"tensor {name!r} in {ckpt.file_of(name)} has shape {have}; config.json implies {want}"
            )


def _agree(ok: bool, device: Any, group: Any, what: str, timeout: float) -> bool:
    """All ranks' verdicts (MIN over ``group``, default the world) when torch.distributed is up, within
    ``timeout`` seconds (a rank that never calls makes it a :class:`CheckpointError`, not a hang)."""
    import functools

    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    try:
        _collective(
            functools.partial(dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=group, async_op=True),
            Deadline(timeout),
        )
    except ReshardError as e:
        raise CheckpointError(
            f"{what}: the ranks did not agree within {timeout:g} s (every rank of the group must call it): "
            f"{e}"
        ) from e
    return bool(flag.item())


def load_hf_checkpoint(
    model_or_shards: Any,
    path: str,
    layout: ShardLayout | None = None,
    *,
    config: ModelConfig | None = None,
    group: Any = None,
    timeout: float = 300.0,
) -> LoadReport:
    """Fill this rank's Megatron shards (a ``GPTModel``, any module, or ``{stage-local name: tensor}``) in
    place from the Hugging Face checkpoint at ``path``, through the reshard plan run in reverse.

    ``layout``: this rank's shard (default :meth:`ShardLayout.from_megatron`); ``config``: the model
    (default ``ModelConfig.from_pretrained(path)``; the dtype is the parameters'). Only the slices this rank
    holds are read (and cast to the parameters' dtype); Megatron's vocab-padding rows are zeroed.

    Everything is checked before any parameter is written: a missing file or tensor (of the whole model, not
    only this rank's part), a tensor whose shape is not what ``config.json`` implies, a parameter missing
    from the model or mis-shaped raise a :class:`CheckpointError` naming the file and the tensor. With
    torch.distributed initialised the ranks of ``group`` (default: the world) agree on the checks within
    ``timeout`` seconds, so all raise together and every one of them must call this; a rank whose own check
    passed raises an error saying another rank's failed."""
    import torch

    local_error: Exception | None = None
    params: dict[str, Any] = {}
    targets: list[Target] = []
    ckpt: SafetensorsCheckpoint | None = None
    try:
        layout = ShardLayout.from_megatron() if layout is None else layout
        params = _params_of(model_or_shards)
        if not params:
            raise CheckpointError("model_or_shards has no parameters")
        dtype = str(next(iter(params.values())).dtype).replace("torch.", "")
        if config is None:
            config = ModelConfig.from_pretrained(path, dtype=dtype)
        else:
            config = dataclasses.replace(config, dtype=dtype)
        plan = to_hf(config, layout.train)
        targets = plan.megatron_targets(layout.pp_rank, layout.tp_rank, layout.ep_rank)
        _check_params(plan, params, layout.pp_rank)
        ckpt = SafetensorsCheckpoint(path)
        _check_checkpoint(plan, ckpt)
    except Exception as e:
        local_error = e
    device = next(iter(params.values())).device if params else torch.device("cpu")
    ok = _agree(local_error is None, device, group, f"load_hf_checkpoint({path})", timeout)
    if local_error is not None:
        raise local_error
    if not ok:
        raise CheckpointError(f"load_hf_checkpoint({path}): another rank's checks failed (see its error)")
    assert ckpt is not None
    report = LoadReport()
    seen: set[str] = set()
    with torch.no_grad():
        for t in targets:
            p = params[t.name]
            view = p.view(t.rows, t.cols)
            if sum(pc.nrows * pc.ncols for pc in t.pieces) < t.numel:
                view.zero_()  # Megatron's vocab padding
            for pc in t.pieces:
                x = ckpt.read(pc.hf, pc.row0, pc.nrows, pc.col0, pc.ncols)
                view[pc.dst_row : pc.dst_row + pc.nrows, pc.dst_col : pc.dst_col + pc.ncols].copy_(x)
                report.bytes_read += x.numel() * x.element_size()
                seen.add(pc.hf)
    report.tensors_read = len(seen)
    report.files = sorted({ckpt.file_of(n) for n in seen})
    ckpt.close()
    return report


def _shards_of(stream: Iterator[list[tuple[str, Any]]], max_bytes: int, dtype: Any, write: bool):
    """Group the stream's tensors into shards of at most ``max_bytes`` (a larger tensor alone); yields
    ``{name: tensor}`` (owned copies) on the writer, ``None`` per bucket elsewhere (the stream is consumed
    on every rank)."""
    cur: dict[str, Any] = {}
    size = 0
    for bucket in stream:
        if not write:
            continue
        for name, t in bucket:
            x = t.to(dtype=dtype, copy=True) if dtype is not None else t.clone()
            nb = x.numel() * x.element_size()
            if cur and size + nb > max_bytes:
                yield cur
                cur, size = {}, 0
            cur[name] = x
            size += nb
    if write and cur:
        yield cur


def save_hf_checkpoint(
    model_or_shards: Any,
    path: str,
    config: ModelConfig,
    train: Parallel,
    groups: Mapping[str, Any] | None = None,
    *,
    hf_config: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
    generation_config: Any = None,
    dtype: Any = None,
    max_shard_bytes: int = 2 << 30,
    bucket_bytes: int = 64 << 20,
    writer_rank: int = 0,
    timeout: float = 300.0,
) -> list[str]:
    """Write a Hugging Face checkpoint directory from Megatron shards, through the forward reshard plan
    (:func:`~msrl_core.reshard.stream_buckets` with HF names over ``groups``, default
    :func:`~msrl_core.models.megatron_groups`). A collective: every rank of the training groups calls it.

    The writer (global rank ``writer_rank``) writes ``config.json`` (``hf_config`` when given, else the one
    :func:`~msrl_core.models.hf_config` makes of ``config``), ``model.safetensors`` or shards of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``, and ``tokenizer`` / ``generation_config``
    (anything with ``save_pretrained``). ``dtype``: the saved dtype (default: the parameters'). The ranks
    of the world agree on the writer's outcome (within ``timeout`` seconds, also each bucket's bound);
    returns the files written (on the writer; ``[]`` elsewhere)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from msrl_core.reshard import stream_buckets

    from .config import hf_config as make_hf_config

    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    params = _params_of(model_or_shards)
    pdtype = str(next(iter(params.values())).dtype).replace("torch.", "")
    config = dataclasses.replace(config, dtype=pdtype)
    if groups is None:
        from .megatron import megatron_groups

        groups = megatron_groups()
    rank = dist.get_rank() if dist.is_initialized() else 0
    write = rank == writer_rank
    plan = to_hf(config, train)
    stream = stream_buckets(
        model_or_shards, plan, groups, names="hf", bucket_bytes=bucket_bytes, timeout=timeout
    )
    files: list[str] = []
    error: Exception | None = None
    weight_map: dict[str, str] = {}
    tmp: list[str] = []
    for shard in _shards_of(stream, max_shard_bytes, dtype, write):
        if error is not None:
            continue
        try:
            os.makedirs(path, exist_ok=True)
            f = os.path.join(path, f".msrl-shard-{len(tmp):05d}.safetensors")
            save_file(shard, f, metadata={"format": "pt"})
            tmp.append(f)
            weight_map.update((n, f) for n in shard)
        except Exception as e:
            error = e
    if write and error is None:
        try:
            saved = config  # config.json names the dtype the tensors are saved in
            if dtype is not None:
                saved = dataclasses.replace(config, dtype=str(dtype).replace("torch.", ""))
            files = _finish(
                path, tmp, weight_map, saved, hf_config, tokenizer, generation_config, make_hf_config
            )
        except Exception as e:
            error = e
    if write and error is not None:
        for f in tmp:
            if os.path.exists(f):
                os.remove(f)
    device = next(iter(params.values())).device
    ok = _agree(error is None, device, None, f"save_hf_checkpoint({path})", timeout)
    if error is not None:
        raise CheckpointError(
            f"save_hf_checkpoint({path}) failed: {type(error).__name__}: {error}"
        ) from error
    if not ok:
        raise CheckpointError(
            f"save_hf_checkpoint({path}): the writer rank {writer_rank} failed (see its error)"
        )
    return files


def _finish(
    path, tmp, weight_map, config, hf_config, tokenizer, generation_config, make_hf_config
) -> list[str]:
    """Write the config, tokenizer and generation config, then the index (more than one shard), then move the
    shards to HF's names (last: a failure before leaves no weights file); older weight files that the new
    ones do not replace are removed (a stale index or shard would be read instead)."""
    cfg_file = os.path.join(path, "config.json")
    if hf_config is not None:
        with open(cfg_file, "w") as fh:
            json.dump(dict(hf_config), fh, indent=2, sort_keys=True)
    else:
        make_hf_config(config).save_pretrained(path)
    for obj in (tokenizer, generation_config):
        if obj is not None:
            obj.save_pretrained(path)
    n = len(tmp)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    rename = dict(zip(tmp, names))
    index = os.path.join(path, INDEX)
    if n > 1:
        total = sum(os.path.getsize(f) for f in tmp)
        wm = {k: rename[v] for k, v in sorted(weight_map.items())}
        with open(index + ".tmp", "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": wm}, fh, indent=2)
        os.replace(index + ".tmp", index)
    elif os.path.exists(index):
        os.remove(index)
    for f, name in rename.items():
        os.replace(f, os.path.join(path, name))
    for f in os.listdir(path):
        if f not in names and re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", f):
            os.remove(os.path.join(path, f))
    return [os.path.join(path, x) for x in names] + ([index] if n > 1 else []) + [cfg_file]
