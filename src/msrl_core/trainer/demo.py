"""``msrl demo``: the shipped CPU demo, through the path users run. It writes the synthetic arithmetic task
(``a+b=``) and a freshly initialised model with its tokenizer (the task's characters as a Hugging Face
tokenizer with a chat template: :mod:`msrl_core.trainer.hf_build`) into the run directory, trains from
that directory as ``model.path``, runs a short format-only warm-up (:mod:`msrl_core.trainer.warmup`),
then GRPO with the shipped config ``configs/demo.yaml``. Overrides: trainer keys as in ``msrl train``
(``trainer.seed=2``), and the
demo's own ``demo.*`` keys (:class:`DemoSettings`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from msrl_core.trainer.config import load_config
from msrl_core.trainer.errors import ConfigError
from msrl_core.trainer.task import arithmetic_records, constant_answer_score, write_jsonl


@dataclass
class DemoSettings:
    records: int = 1000  # generated "a+b=" records (train + held-out)
    max_a: int = 2  # a in [0, max_a]
    max_b: int = 5  # b in [0, max_b]
    warmup_steps: int = 60  # supervised steps on the format only (random answers)
    warmup_lr: float = 1e-3
    warmup_batch: int = 128


def demo_config_path() -> Path:
    return Path(str(resources.files("msrl_core.trainer") / "configs" / "demo.yaml"))


def parse(overrides: Sequence[str]) -> tuple[DemoSettings, list[str]]:
    """Split ``demo.*`` overrides (the demo's settings) from the trainer's."""
    settings = DemoSettings()
    fields = {f.name: f for f in dataclasses.fields(DemoSettings)}
    rest = []
    for item in overrides:
        key, _, value = item.partition("=")
        if not key.startswith("demo."):
            rest.append(item)
            continue
        name = key[5:]
        if name not in fields or not _:
            near = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.0)
            raise ConfigError(f"unknown demo setting {key!r}; did you mean 'demo.{near[0]}'?")
        typ = type(getattr(settings, name))
        try:
            setattr(settings, name, typ(value))
        except ValueError:
            raise ConfigError(f"{key}={value!r} must be a {typ.__name__}") from None
    if settings.max_a < 0 or settings.max_b < 0 or settings.records < 10:
        raise ConfigError(f"demo task needs max_a, max_b >= 0 and records >= 10; got {settings}")
    return settings, rest


def prepare(overrides: Sequence[str]) -> tuple[Any, DemoSettings]:
    """The demo's config (task data written into the run directory) and settings."""
    settings, rest = parse(overrides)
    cfg = load_config(demo_config_path(), rest)
    run_dir = Path(cfg.trainer.output_dir)
    if not cfg.data.train_files:
        recs = arithmetic_records(settings.records, settings.max_a, settings.max_b, seed=cfg.data.seed)
        cfg.data.train_files = write_jsonl(recs, str(run_dir / "data" / "arithmetic.jsonl"))
    if not cfg.model.path:  # the demo's model: a Hugging Face directory, trained from as model.path
        from msrl_core.trainer.hf_build import char_tokenizer, write_model_dir
        from msrl_core.trainer.hf_dir import fill_model_section

        model_dir = run_dir / "model"
        if not (cfg.trainer.resume and (model_dir / "config.json").is_file()):
            write_model_dir(model_dir, cfg.model, char_tokenizer(), seed=cfg.trainer.seed)
        cfg.model.path = str(model_dir)
        fill_model_section(cfg.model, {})
    return cfg, settings


def warmup_hook(settings: DemoSettings, log: Any = print) -> Any:
    from msrl_core.trainer.warmup import format_warmup

    def run(engine: Any, tok: Any, records: list[dict]) -> None:
        answers = [str(s) for s in range(settings.max_a + settings.max_b + 1)]
        losses = format_warmup(
            engine,
            tok,
            [r["prompt"] for r in records],
            answers,
            settings.warmup_steps,
            settings.warmup_batch,
            settings.warmup_lr,
            seed=0,
        )
        if losses:
            log(
                f"format warm-up: {len(losses)} steps on random answers (loss {losses[0]:.3f} -> "
                f"{losses[-1]:.3f}); a prompt-blind policy scores at most "
                f"{constant_answer_score(settings.max_a, settings.max_b):.3f}"
            )

    return run


def run_demo(overrides: Sequence[str], **kw: Any) -> Any:
    from msrl_core.trainer.run import train

    cfg, settings = prepare(overrides)
    return train(cfg, before_training=warmup_hook(settings, kw.get("log", print)), **kw)
