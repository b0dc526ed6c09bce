"""The ``msrl`` command line.

- ``msrl demo [key=value ...] [--ray]``: the CPU GRPO demo (synthetic arithmetic, tiny model built in code);
- ``msrl train [CONFIG.yaml] [key=value ...] [--ray]``: GRPO with a YAML config and dotted overrides, e.g.
  ``msrl train model.path=Qwen2.5-0.5B-Instruct data.train_files=gsm8k/train.parquet``;
- ``msrl report RUN_DIR``: the summary table and plots of a run directory;
- ``msrl info``: the runtime backends and the build (JSON).

Errors in the config, the data or the reward function, and a failing stage, end with one clear message
on stderr and a non-zero exit code (2: config/data, 1: run failure, 130: stopped with Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from msrl_core import __version__
from msrl_core.runtime import runtime_info

#: What ``msrl train``/``msrl demo`` import, by module, and the distribution that brings it: exactly the
#: ``train`` extra of pyproject.toml (a test keeps the two equal).
TRAIN_MODULES = {
    "torch": "torch",
    "omegaconf": "omegaconf",
    "safetensors": "safetensors",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "pyarrow": "pyarrow",
    "transformers": "transformers",
    "jinja2": "jinja2",
    "megatron.core": "megatron-core",
}


def missing_train_modules() -> list[str]:
    """The distributions of :data:`TRAIN_MODULES` this environment lacks."""
    missing = []
    for module, dist in TRAIN_MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module stubbed out with None
            found = False
        if not found:
            missing.append(dist)
    return missing


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. actor.lr=1e-3")
    p.add_argument("--ray", action="store_true", help="dock.backend=ray (starts a loopback Ray if none runs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (one line per step only)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="msrl", description="msrl_core command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the available device backends and the one in use (JSON)")
    demo = sub.add_parser("demo", help="run the CPU GRPO demo (learns a+b= in minutes)")
    _run_args(demo)
    tr = sub.add_parser("train", help="run GRPO from a YAML config")
    tr.add_argument(
        "config",
        nargs="?",
        help="YAML config (optional: the defaults and key=value overrides alone also make a config)",
    )
    _run_args(tr)
    rep = sub.add_parser("report", help="summary table and plots of a run directory")
    rep.add_argument("run_dir")
    # overrides may come before and after the flags: collect the leftovers that look like key=value
    args, extra = parser.parse_known_args(argv)
    bad = [x for x in extra if x.startswith("-") or "=" not in x or args.command not in ("demo", "train")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    if args.command == "train" and args.config is not None and "=" in args.config:
        args.overrides, args.config = [args.config, *args.overrides], None  # no file, overrides only
    if args.command == "info":
        print(json.dumps({"msrl_core": __version__, **runtime_info()}, indent=2))
        return 0
    if args.command == "report":
        from msrl_core.trainer.report import report_main

        return report_main(args.run_dir)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    missing = missing_train_modules()
    if missing:
        print(
            f"msrl {args.command}: needs the 'train' extra (missing: {', '.join(missing)}): "
            "pip install '.[train]' in the msrl_core checkout (msrl_core is not on PyPI)",
            file=sys.stderr,
        )
        return 2
    from msrl_core.errors import MsrlError
    from msrl_core.trainer.errors import ConfigError, DataError, RewardError
    from msrl_core.trainer.run import EXIT_INTERRUPTED
    from msrl_core.trainer.stages import StageError

    overrides = list(args.overrides) + (["dock.backend=ray"] if args.ray else [])
    try:
        if args.command == "demo":
            from msrl_core.trainer.demo import run_demo

            result = run_demo(overrides, progress=not args.no_progress)
        else:
            from msrl_core.trainer.config import load_config
            from msrl_core.trainer.run import train

            result = train(load_config(args.config, overrides), progress=not args.no_progress)
    except (ConfigError, DataError) as e:
        print(f"msrl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except StageError as e:
        cause = e.error
        if isinstance(cause, RewardError):
            print(f"msrl {args.command}: error in stage '{e.stage}': {cause}", file=sys.stderr)
        else:
            print(f"msrl {args.command}: {e}\n{e.tb}", file=sys.stderr)
        print("metrics of the finished steps are kept in the run directory", file=sys.stderr)
        return 1
    except (MsrlError, FileNotFoundError, FloatingPointError) as e:
        print(f"msrl {args.command}: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # e.g. a lost TP rank: the collective fails after the process-group timeout
        print(f"msrl {args.command}: failed: {type(e).__name__}: {str(e)[:2000]}", file=sys.stderr)
        print("metrics of the finished steps are kept in the run directory", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"msrl {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if result.interrupted:
        print(f"msrl {args.command}: stopped after {result.steps_done} steps (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
