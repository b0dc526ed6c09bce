"""``msrl train``: validate the config, build the engines, run the steps, keep metrics, checkpoints and
the report. Errors are clear messages (:class:`RunError` and the config/data/reward errors); Ctrl-C stops
after the current step, keeping the metrics and saving a last checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from msrl_core.trainer import checkpoint as ckpt
from msrl_core.trainer.config import TrainerConfig, model_config, save_config, to_yaml, validate
from msrl_core.trainer.data import PromptLoader, load_prompts, split
from msrl_core.trainer.errors import ConfigError, DataError
from msrl_core.trainer.reward import load_reward_fn
from msrl_core.trainer.task import CharTokenizer

#: Exit code of a run stopped by Ctrl-C (the shell's 128 + SIGINT).
EXIT_INTERRUPTED = 130


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    interrupted: bool
    final_checkpoint: Path | None
    rows: list[dict[str, Any]]


def resolve_device(cfg: Any) -> str:
    """``trainer.device`` resolved on this machine (auto: cuda, then npu, then cpu); an unavailable device
    is a :class:`ConfigError` naming it and what is available."""
    from msrl_core.trainer.engines import select_device

    try:
        return select_device(cfg.trainer.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_engine(cfg: TrainerConfig, seed: int, device: str = "cpu") -> Any:
    """The trained policy (an :class:`msrl_core.trainer.actor.Actor`) of ``actor.engine``: ``megatron``, the
    megatron-core ranks (``actor.dp`` x ``tp`` x ``pp`` x ``ep``) as workers of a worker group (local
    processes or Ray actors, ``trainer.workers``); ``hf``, transformers in this process (one replica)."""
    from msrl_core.trainer.actor import LocalActor, WorkerActor

    if cfg.actor.engine == "hf":
        from msrl_core.trainer.engines.hf import HFTrainEngine

        return LocalActor(HFTrainEngine(cfg.model, seed=seed, device=device))
    if cfg.trainer.workers == "ray":
        _ensure_ray(cfg)
    return WorkerActor(cfg, seed=seed, device=device)


def _ensure_ray(cfg: TrainerConfig) -> None:
    """Ray for the workers: the cluster at ``dock.ray_address`` when given, else the running one, else a
    small loopback one (as the Ray dock starts)."""
    import ray

    if ray.is_initialized():
        return
    from msrl_core.trainer.grpo import LOOPBACK_RAY

    if cfg.dock.ray_address:
        ray.init(address=cfg.dock.ray_address, log_to_driver=False)
    else:
        ray.init(**LOOPBACK_RAY)  # type: ignore[arg-type]


def sampler_factory(cfg: TrainerConfig, device: str = "cpu") -> Callable[[dict[str, Any]], Any]:
    """The rollout engine of ``rollout.engine`` over the HF-layout views that ``allgather_swap`` fills."""
    if cfg.rollout.engine == "vllm":
        from msrl_core.trainer.engines.vllm_rollout import VLLMSampler, check_available

        check_available()  # before any engine is built
        model_dir = Path(cfg.trainer.output_dir) / "vllm_model"
        mc = model_config(cfg.model)
        return lambda views: VLLMSampler(cfg, mc, views, model_dir, cfg.trainer.seed)
    from msrl_core.trainer.engines.hf import HFSampler

    return lambda views: HFSampler(cfg.model, views, device)


def load_data(cfg: TrainerConfig) -> tuple[list[dict], list[dict]]:
    d = cfg.data
    assert d.train_files is not None  # validate() checked it
    records = load_prompts(d.train_files, d.prompt_key, d.answer_key)
    if d.val_files:
        train, val = records, load_prompts(d.val_files, d.prompt_key, d.answer_key)
    elif d.val_fraction > 0:
        train, val = split(records, d.val_fraction, d.seed)
    else:
        train, val = records, []
    return [dict(r, _row=i) for i, r in enumerate(train)], val


def load_tokenizer(cfg: TrainerConfig) -> Any:
    """The checkpoint's tokenizer (``model.path``), or the built-in character tokenizer of a model built in
    code (the demo task's alphabet)."""
    if cfg.model.path:
        from msrl_core.trainer.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(cfg.model.path)
    return CharTokenizer()


def encode_prompts(tok: Any, cfg: Any, records: list[dict], what: str) -> None:
    """Tokenize every prompt once (``record["prompt_ids"]``); each must encode (chat messages need a chat
    template) and fit ``rollout.max_prompt_length`` (the message names the record)."""
    limit = cfg.rollout.max_prompt_length
    for r in records:
        where = f"{what} record {r.get('index', '?')} (prompt {str(r['prompt'])[:40]!r})"
        try:
            ids = np.asarray(tok.encode(r["prompt"]), np.int64)
        except (ValueError, DataError) as e:
            raise DataError(f"{where}: {e}") from None
        r["prompt_ids"] = ids
        n = len(ids)
        if n > limit:
            raise DataError(f"{where}: {n} tokens exceed rollout.max_prompt_length={limit}")


class _StopFlag:
    """SIGINT during a run: the first stops after the current step; a second one interrupts at once."""

    def __init__(self) -> None:
        self.set = False
        self._old: Any = None

    def __enter__(self) -> _StopFlag:
        if threading_main():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.set:
            raise KeyboardInterrupt
        self.set = True
        print(
            "\nmsrl: Ctrl-C: stopping after this step (again to interrupt now)", file=sys.stderr, flush=True
        )

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _line(step: int, m: dict[str, Any]) -> str:
    def f(k: str, fmt: str = "{:.3f}") -> str:
        v = m.get(k)
        return "-" if v is None else fmt.format(v)

    val = f" val {f('val/score/mean')}" if "val/score/mean" in m else ""
    return (
        f"step {step:4d} | score {f('grpo/score/mean')}{val} | len {f('response_length/mean', '{:.2f}')} | "
        f"pg {f('actor/pg_loss', '{:+.4f}')} kl {f('actor/kl_loss', '{:.4f}')} "
        f"ent {f('actor/entropy')} | diff {f('training/rollout_probs_diff_max', '{:.1e}')} | "
        f"{f('timing/all', '{:.2f}')}s {f('e2e_tps', '{:.0f}')} tok/s"
    )


@dataclass
class Session:
    """What one run holds: its data, tokenizer, engines, trainer and prompt loader (:func:`open_session`)."""

    cfg: TrainerConfig
    run_dir: Path
    tokenizer: Any
    train_records: list[dict]
    val_records: list[dict]
    engine: Any
    trainer: Any
    loader: PromptLoader
    rank: int


def open_session(
    cfg: TrainerConfig,
    *,
    before_training: Callable[[Any, Any, list[dict]], None] | None = None,
    swap: bool | None = None,
    dock_options: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> Session:
    """Validate ``cfg``, record it in the run directory, read the data and the tokenizer, build the engines
    and the trainer. Every bad input fails here, before the first step. ``before_training(engine,
    tokenizer, records)`` runs on the engine before the trainer copies it as the reference policy."""
    from msrl_core.trainer.grpo import GRPOTrainer

    validate(cfg)
    run_dir = Path(cfg.trainer.output_dir)
    log("resolved config:\n" + to_yaml(cfg))
    save_config(cfg, run_dir)
    log(f"run directory: {run_dir}")
    train_records, val_records = load_data(cfg)
    tok = load_tokenizer(cfg)
    if cfg.model.vocab_size < tok.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {tok.vocab_size} tokens"
        )
    encode_prompts(tok, cfg, train_records, "training")
    encode_prompts(tok, cfg, val_records, "validation")
    reward_fn = load_reward_fn(cfg.reward.fn)
    device = resolve_device(cfg)  # before any engine is built
    make_sampler = sampler_factory(cfg, device)  # a missing rollout engine fails here too
    seed = cfg.trainer.seed
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    engine = build_engine(cfg, seed, device)
    if before_training is not None:
        before_training(engine, tok, train_records)
    loader = PromptLoader(train_records, cfg.data.global_batch_size, cfg.data.seed)
    trainer = GRPOTrainer(
        cfg, tok, train_records, reward_fn, engine, make_sampler, swap=swap, dock_options=dock_options
    )
    return Session(cfg, run_dir, tok, train_records, val_records, engine, trainer, loader, 0)


def resume(s: Session, path: Path) -> int:
    """Load the checkpoint at ``path`` into every rank's engines (policy, reference, optimizer) and the
    loader; returns the step to continue at."""
    tstate = ckpt.trainer_state(path)
    s.engine.load(str(path))
    s.loader.load_state_dict(tstate["loader"])
    step = int(tstate["step"])
    s.trainer.step_index = step
    return step


def save(s: Session, step: int) -> Path:
    """The checkpoint of ``step``: every rank's shards (each in its own process), then the HF directory and
    the trainer state."""
    from msrl_core.trainer.hf_build import checkpoint_config

    trainer = s.trainer
    s.engine.save(str(s.run_dir), step)
    hf = (trainer.hf_weights(), checkpoint_config(s.cfg.model, s.tokenizer), s.tokenizer)
    state = {"step": step, "loader": s.loader.state_dict(), "time": time.time()}
    return ckpt.finish(s.run_dir, step, state, hf)


def train(
    cfg: TrainerConfig,
    *,
    before_training: Callable[[Any, Any, list[dict]], None] | None = None,
    swap: bool | None = None,
    dock_options: dict[str, Any] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> RunResult:
    """Run ``cfg`` (a loaded config) to ``trainer.steps``. ``before_training(engine, tokenizer, records)``
    runs once on a fresh (not resumed) run, e.g. the demo's format warm-up."""
    from msrl_core.trainer.metrics import MetricsWriter, read_metrics
    from msrl_core.trainer.report import plot, summary_table

    resume_from = ckpt.resolve(Path(cfg.trainer.output_dir), cfg.trainer.resume)
    hook = before_training if resume_from is None else None  # a resumed run continues from its checkpoint
    s = open_session(cfg, before_training=hook, swap=swap, dock_options=dock_options, log=log)
    run_dir, engine, trainer = s.run_dir, s.engine, s.trainer
    start = 0
    if resume_from is not None:
        start = resume(s, resume_from)
        log(f"resumed from {resume_from} at step {start}")
    loader, val_records = s.loader, s.val_records
    steps, val_every, save_every = cfg.trainer.steps, cfg.trainer.val_every, cfg.trainer.save_every
    last_ckpt: Path | None = resume_from
    interrupted = False
    done = start
    if start == 0 and (run_dir / "metrics.jsonl").exists():
        log(f"fresh run in {run_dir}: the previous metrics.jsonl is replaced")
    writer = MetricsWriter(run_dir, tensorboard=cfg.trainer.tensorboard, resume_step=start)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=start, desc="GRPO", unit="step", dynamic_ncols=True, file=sys.stderr)
    say = bar.write if bar is not None else log
    try:
        with _StopFlag() as stop:
            for step in range(start, steps):
                batch = next(loader)
                val = val_records if val_records and val_every and step % val_every == 0 else None
                m = trainer.step(batch, val)
                writer.write(step, m)
                done = step + 1
                say(_line(step, m))
                if bar is not None:
                    bar.update(1)
                if save_every and done % save_every == 0 and done < steps:
                    last_ckpt = save(s, done)
                if stop.set:
                    interrupted = True
                    break
            # the final policy: validation after the last update, and its checkpoint
            if val_records and val_every and not interrupted:
                trainer.hf_weights()
                v = trainer.validate(val_records)
                writer.write(done, {"val/score/mean": v})
                say(f"step {done:4d} | val {v:.3f} (final policy)")
            if done > start or last_ckpt is None:
                last_ckpt = save(s, done)
            say(f"checkpoint (Hugging Face safetensors + training state): {last_ckpt}")
    finally:
        writer.close()
        if bar is not None:
            bar.close()
        close_sampler = getattr(trainer.sampler, "close", None)  # a vLLM engine's processes stop here
        if close_sampler is not None:
            close_sampler()
        trainer.close()
        engine.close()
    rows = read_metrics(run_dir)
    if rows:
        log(summary_table(rows))
        for p in plot(run_dir):
            log(f"wrote {p}")
    return RunResult(run_dir, done, interrupted, last_ckpt, rows)


def default_output_dir(base: str) -> str:
    return os.path.join(base, time.strftime("%Y%m%d-%H%M%S"))
