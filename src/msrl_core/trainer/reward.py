"""Rule rewards for verifiable answers (numeric exact match, answer format), loading a user reward function
from ``reward.fn = "pkg.module:function"``, and :func:`score`, which turns a user function's failure into
a :class:`RewardError` naming the function and the prompt.

Two signatures, told apart by the parameter names (:func:`reward_style`):

- ``fn(prompt, response, answer)`` (this trainer's);
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, called with keywords
  as verl calls it (``extra_info`` only when the function takes it).

Either returns a finite number, or a dict with a numeric ``"score"`` whose other numeric entries are logged
as ``reward/<key>/mean`` (verl's ``reward_extra_info``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msrl_core.trainer.errors import ConfigError, RewardError

RewardFn = Callable[[Any, str, str], float]

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")
# Explicit answer markers: GSM8K's "#### 42", "answer: 42" (any case), LaTeX "\boxed{42}".
_MARKERS = re.compile(r"####|answer\s*[:：]|\\boxed\{", re.IGNORECASE)
_SPEC = re.compile(r"^(?P<module>[^:]+):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$")

#: What :func:`rule_reward` gives a wrong answer in the expected format (verl's gsm8k ``format_score``).
FORMAT_SCORE = 0.1
#: Longest prompt excerpt an error message quotes.
PROMPT_EXCERPT = 80


def _canonical(number: str) -> str:
    value = float(number.replace(",", ""))
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def extract_answer(text: str) -> str | None:
    """The answer in ``text``: the first number after the last answer marker (``####``, ``answer:``,
    ``\\boxed{``), else the last number anywhere; canonical (``"1,000.0"`` -> ``"1000"``); None if none."""
    markers = list(_MARKERS.finditer(text))
    if markers:
        found = _NUMBER.search(text, markers[-1].end())
        return _canonical(found.group()) if found else None
    numbers = _NUMBER.findall(text)
    return _canonical(numbers[-1]) if numbers else None


def exact_match_numeric(response: str, answer: str) -> float:
    """1.0 when the response's answer equals the reference numerically (relative 1e-6), else 0.0.

    ``answer`` may be a bare number or a full solution ending in ``#### N``.
    """
    pred, gold = extract_answer(response), extract_answer(str(answer))
    if pred is None or gold is None:
        return 0.0
    p, g = float(pred), float(gold)
    return 1.0 if abs(p - g) <= 1e-6 * max(1.0, abs(g)) else 0.0


def format_reward(response: str) -> float:
    """1.0 when the response states its answer explicitly: a marker followed by a number, else 0.0."""
    markers = list(_MARKERS.finditer(response))
    return 1.0 if markers and _NUMBER.search(response, markers[-1].end()) else 0.0


def rule_reward(prompt: Any, response: str, answer: str) -> float:
    """The default reward: 1.0 for the right number, :data:`FORMAT_SCORE` for a wrong one stated in the
    answer format, 0.0 otherwise. ``prompt`` is unused (the signature every reward function shares)."""
    del prompt
    if exact_match_numeric(response, answer):
        return 1.0
    return FORMAT_SCORE * format_reward(response)


def _import_module(module: str, spec: str) -> Any:
    if module.endswith(".py"):  # a file path, as verl's custom_reward_function.path
        path = Path(module)
        if not path.is_file():
            raise ConfigError(f"reward.fn={spec!r}: file {module!r} does not exist")
        loader_spec = importlib.util.spec_from_file_location(f"msrl_reward_{path.stem}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise ConfigError(f"reward.fn={spec!r}: cannot import file {module!r}")
        mod = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(mod)
        except Exception as exc:
            raise ConfigError(
                f"reward.fn={spec!r}: importing {module!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        return mod
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise ConfigError(
                f"reward.fn={spec!r}: module {module!r} not found (is it installed or on PYTHONPATH?)"
            ) from None
        raise ConfigError(f"reward.fn={spec!r}: importing {module!r} failed: {exc}") from exc
    except Exception as exc:
        raise ConfigError(
            f"reward.fn={spec!r}: importing {module!r} raised {type(exc).__name__}: {exc}"
        ) from exc


#: verl's reward-function parameters (``verl.utils.reward_score.default_compute_score``).
VERL_PARAMS = ("data_source", "solution_str", "ground_truth")


def reward_style(fn: Callable[..., Any]) -> str:
    """``"verl"`` when ``fn`` takes verl's ``data_source, solution_str, ground_truth`` by name, else
    ``"prompt"`` (``fn(prompt, response, answer)``)."""
    try:
        params = inspect.signature(fn).parameters
    except ValueError:  # builtins without a signature
        return "prompt"
    return "verl" if all(p in params for p in VERL_PARAMS) else "prompt"


def _takes_extra_info(fn: Callable[..., Any]) -> bool:
    params = inspect.signature(fn).parameters
    return "extra_info" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``"pkg.module:function"`` (or ``"path/to/file.py:function"``) and check it can be called as
    ``fn(prompt, response, answer)`` or as verl's ``compute_score(data_source, solution_str, ground_truth,
    extra_info=None)``. Raises :class:`ConfigError` saying which part is wrong."""
    m = _SPEC.match(spec.strip())
    if m is None:
        raise ConfigError(f"reward.fn={spec!r} must be of the form pkg.module:function")
    module, attr = m.group("module"), m.group("attr")
    obj: Any = _import_module(module, spec)
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise ConfigError(
                f"reward.fn={spec!r}: {module!r} has no attribute {part!r}; callables there: {public[:12]}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"reward.fn={spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    try:
        if reward_style(obj) == "verl":
            inspect.signature(obj).bind(data_source="d", solution_str="s", ground_truth="g")
        else:
            inspect.signature(obj).bind("prompt", "response", "answer")
    except TypeError:
        raise ConfigError(
            f"reward.fn={spec!r}: {attr}{inspect.signature(obj)} cannot be called as "
            "fn(prompt, response, answer) nor as compute_score(data_source, solution_str, ground_truth, "
            "extra_info=None)"
        ) from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return obj  # type: ignore[no-any-return]


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def call_reward(fn: Callable[..., Any], record: dict[str, Any], response: str) -> Any:
    """``fn``'s raw result for ``response`` to ``record`` (``prompt``, ``answer`` and, from verl data,
    ``data_source`` and ``extra_info``), in ``fn``'s own signature."""
    if reward_style(fn) == "verl":
        kw: dict[str, Any] = {
            "data_source": record.get("data_source"),
            "solution_str": response,
            "ground_truth": record["answer"],
        }
        if _takes_extra_info(fn):
            kw["extra_info"] = record.get("extra_info")
        return fn(**kw)
    return fn(record["prompt"], response, record["answer"])


def _number(fn: Callable[..., Any], value: Any, what: str, excerpt: str) -> float:
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise RewardError(
            f"reward function {_name(fn)} returned {what}{value!r}, not a number (prompt {excerpt!r})"
        ) from None
    if not math.isfinite(result):
        raise RewardError(
            f"reward function {_name(fn)} returned {what}{value!r}, not a finite number (prompt {excerpt!r})"
        )
    return result


def score_record(
    fn: Callable[..., Any], record: dict[str, Any], response: str
) -> tuple[float, dict[str, float]]:
    """``(score, extras)`` of ``response`` to ``record``: a number, or a dict's ``"score"`` and its other
    numeric entries. An exception, a non-number or a dict without ``"score"`` becomes a
    :class:`RewardError` naming the function and the (truncated) prompt."""
    excerpt = str(record.get("prompt"))
    if len(excerpt) > PROMPT_EXCERPT:
        excerpt = excerpt[: PROMPT_EXCERPT - 3] + "..."
    try:
        value = call_reward(fn, record, response)
    except Exception as exc:
        raise RewardError(
            f"reward function {_name(fn)} raised {type(exc).__name__}: {exc} (prompt {excerpt!r})"
        ) from exc
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardError(
                f"reward function {_name(fn)} returned a dict without 'score' (keys {sorted(value)}; "
                f"prompt {excerpt!r})"
            )
        extras = {
            str(k): _number(fn, v, f"{k!r}=", excerpt)
            for k, v in value.items()
            if k != "score" and isinstance(v, (int, float, bool))
        }
        return _number(fn, value["score"], "'score'=", excerpt), extras
    return _number(fn, value, "", excerpt), {}


def score(fn: RewardFn, prompt: Any, response: str, answer: str) -> float:
    """``fn(prompt, response, answer)`` as a float (see :func:`score_record`)."""
    return score_record(fn, {"prompt": prompt, "answer": answer}, response)[0]


__all__ = [
    "FORMAT_SCORE",
    "RewardError",
    "RewardFn",
    "exact_match_numeric",
    "extract_answer",
    "format_reward",
    "load_reward_fn",
    "reward_style",
    "rule_reward",
    "score",
    "score_record",
]
