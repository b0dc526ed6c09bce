"""Checkpoints in the run directory.

``checkpoints/step_<k>/`` (k = steps completed) holds

- a Hugging Face checkpoint directory: ``model.safetensors`` + ``config.json`` (the policy in the Hugging
  Face layout, ``to_hf`` through ``allgather_swap``), the tokenizer with its chat template and
  ``generation_config.json``: loadable with transformers' ``from_pretrained`` and trainable again as
  ``model.path``;
- ``train_state/rank<r>.safetensors``: each training rank's Megatron-layout shard (what resume loads);
- ``train_state/optimizer_rank<r>.pt``: the optimizer state (tensors and numbers only, read with
  ``weights_only=True``). In a folder of their own: vLLM loads every ``*.safetensors`` at the top of a
  directory that has no index, so a training shard beside ``model.safetensors`` made the checkpoint
  unloadable there;
- ``trainer_state.json``: the step and the prompt loader's position.

A checkpoint directory is written under a temporary name and renamed when complete, so an interrupted save
never leaves a half checkpoint that resume would pick.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

CKPT_DIR = "checkpoints"
TRAIN_STATE = "train_state"  # the ranks' training shards and optimizer states, beside the HF files


def step_dir(run_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(run_dir) / CKPT_DIR / f"step_{step}"


def save_hf(views: dict[str, Any], hf_config: Any, out: Path, tokenizer: Any = None) -> None:
    """Write the HF-layout weights (copies of the views: safetensors refuses shared storage), the config
    and, given a Hugging Face tokenizer, it and its generation config."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().clone().contiguous() for k, v in views.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    if hf_config is not None:
        hf_config.to_json_file(str(out / "config.json"))
    if tokenizer is not None and hasattr(getattr(tokenizer, "hf", None), "save_pretrained"):
        from msrl_core.trainer.hf_build import save_tokenizer

        save_tokenizer(out, tokenizer)


def save_rank(
    run_dir: str | os.PathLike[str],
    step: int,
    rank: int,
    train_state: dict[str, Any],
    optimizer_state: dict[str, Any],
) -> None:
    """One rank's shard and optimizer state of the checkpoint of ``step``, into its temporary directory
    (every rank, in its own process; :func:`finish` completes the checkpoint)."""
    from safetensors.torch import save_file

    tmp = _tmp_dir(run_dir, step)
    (tmp / TRAIN_STATE).mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().cpu().clone().contiguous() for k, v in train_state.items()},
        str(tmp / TRAIN_STATE / f"rank{rank}.safetensors"),
    )
    torch.save(optimizer_state, tmp / TRAIN_STATE / f"optimizer_rank{rank}.pt")


def finish(
    run_dir: str | os.PathLike[str],
    step: int,
    trainer_state: dict[str, Any],
    hf: tuple[dict[str, Any], Any, Any] | None,
) -> Path:
    """After every rank's :func:`save_rank`: the HF weights and the trainer state, then the rename that
    makes the checkpoint of ``step`` complete. Returns the final directory."""
    final = step_dir(run_dir, step)
    tmp = _tmp_dir(run_dir, step)
    if hf is not None:
        save_hf(*hf[:2], tmp, tokenizer=hf[2])
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def _tmp_dir(run_dir: str | os.PathLike[str], step: int) -> Path:
    final = step_dir(run_dir, step)
    return final.with_name(final.name + ".tmp")


def trainer_state(path: Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint directory."""
    return json.loads((path / "trainer_state.json").read_text())


def latest(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if p.name.startswith("step_") and (p / "trainer_state.json").is_file()]
    done = [p for p in done if p.name[5:].isdigit()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def resolve(run_dir: str | os.PathLike[str], resume: bool | str | None) -> Path | None:
    """``trainer.resume``: false/None (fresh), true or ``auto`` (the latest checkpoint in the run dir, None
    if there is none) or a checkpoint directory."""
    if resume is None or resume is False or resume == "":
        return None
    if resume is True or resume == "auto":
        return latest(run_dir)
    p = Path(resume)
    if not (p / "trainer_state.json").is_file():
        raise FileNotFoundError(
            f"trainer.resume={resume!r} is not a checkpoint directory (no trainer_state.json); "
            f"use 'auto' or a {CKPT_DIR}/step_<k> directory"
        )
    return p


def load(path: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(train_state, optimizer_state, trainer_state) of one rank."""
    from safetensors.torch import load_file

    train = load_file(str(path / TRAIN_STATE / f"rank{rank}.safetensors"))
    opt = torch.load(path / TRAIN_STATE / f"optimizer_rank{rank}.pt", weights_only=True)
    state = json.loads((path / "trainer_state.json").read_text())
    return train, opt, state
