"""Rule rewards, loading a reward function by import path, and wrapping a failing one."""

from __future__ import annotations

import math

import pytest

from msrl_core.errors import MsrlError
from msrl_core.trainer.config import load_config, validate
from msrl_core.trainer.errors import ConfigError
from msrl_core.trainer.reward import (
    FORMAT_SCORE,
    RewardError,
    exact_match_numeric,
    extract_answer,
    format_reward,
    load_reward_fn,
    rule_reward,
    score,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 + 4 = 7", "7"),  # last number
        ("so 12 apples, then 5", "5"),
        ("#### 42", "42"),
        ("I think 3. #### 1,234 more text 9", "1234"),  # first number after the last marker
        ("Answer: -5, not 7", "-5"),
        ("answer： 2.50", "2.5"),
        ("The final answer is \\boxed{17} because 3", "17"),
        ("value 6.0", "6"),
        ("1,2,3", "3"),  # a list is not a thousands separator
        ("no digits here", None),
        ("#### nothing", None),  # a marker without a number
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_exact_match_numeric():
    assert exact_match_numeric("so the total is 12", "12") == 1.0
    assert exact_match_numeric("#### 12.0", "Natalia sold 48/2 = 24 ... #### 12") == 1.0
    assert exact_match_numeric("#### 13", "12") == 0.0
    assert exact_match_numeric("no answer", "12") == 0.0
    assert exact_match_numeric("12", "unknown") == 0.0
    assert exact_match_numeric("1,000", "1000") == 1.0


def test_format_and_rule_reward():
    assert format_reward("#### 5") == 1.0
    assert format_reward("answer: x") == 0.0
    assert format_reward("5") == 0.0
    assert rule_reward("2+3=", "#### 5", "5") == 1.0
    assert rule_reward("2+3=", "5", "5") == 1.0  # right without the marker still counts
    assert rule_reward("2+3=", "#### 6", "5") == FORMAT_SCORE
    assert rule_reward("2+3=", "6", "5") == 0.0


def _module(tmp_path, monkeypatch, name, body):
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, name, raising=False)


def test_load_reward_fn_by_module_and_file(tmp_path, monkeypatch):
    _module(
        tmp_path,
        monkeypatch,
        "msrl_rw_ok",
        "class K:\n    @staticmethod\n    def f(p, r, a):\n        return 0.5\n",
    )
    fn = load_reward_fn("msrl_rw_ok:K.f")
    assert fn("p", "r", "a") == 0.5
    assert load_reward_fn("msrl_core.trainer.reward:rule_reward") is rule_reward
    (tmp_path / "file_rw.py").write_text("def g(prompt, response, answer, extra=1):\n    return 2.0\n")
    assert load_reward_fn(f"{tmp_path / 'file_rw.py'}:g")("p", "r", "a") == 2.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("msrl_rw_bad.f", "must be of the form pkg.module:function"),
        ("msrl_rw_bad:", "must be of the form"),
        ("msrl_rw_missing_pkg.sub:f", r"module 'msrl_rw_missing_pkg.sub' not found"),
        ("msrl_rw_bad:nope", r"has no attribute 'nope'; callables there: \['f', 'three_args'\]"),
        ("msrl_rw_bad:VALUE", r"'VALUE' is a int, not a function"),
        ("msrl_rw_bad:f", r"f\(x\) cannot be called as fn\(prompt, response, answer\)"),
        ("msrl_rw_broken:f", r"importing 'msrl_rw_broken' raised ZeroDivisionError"),
        ("msrl_rw_deps:f", r"importing 'msrl_rw_deps' failed: No module named 'not_installed_dep'"),
        ("/nonexistent/x.py:f", r"file '/nonexistent/x.py' does not exist"),
    ],
)
def test_load_reward_fn_errors(tmp_path, monkeypatch, spec, message):
    _module(
        tmp_path,
        monkeypatch,
        "msrl_rw_bad",
        "VALUE = 3\ndef f(x):\n    return x\ndef three_args(a, b, c):\n    pass\n",
    )
    _module(tmp_path, monkeypatch, "msrl_rw_broken", "1 / 0\n")
    _module(tmp_path, monkeypatch, "msrl_rw_deps", "import not_installed_dep\n")
    with pytest.raises(ConfigError, match=message):
        load_reward_fn(spec)


def test_validate_imports_the_reward_fn():
    cfg = load_config(None, ["data.train_files=x.jsonl", "reward.fn=msrl_rw_absent_mod:f"])
    with pytest.raises(ConfigError, match="module 'msrl_rw_absent_mod' not found"):
        validate(cfg)


def test_score_wraps_failures_naming_function_and_prompt():
    def boom(prompt, response, answer):
        raise KeyError("label")

    long_prompt = "Q" * 200
    with pytest.raises(RewardError, match=r"boom raised KeyError: 'label' \(prompt 'QQQ.*\.\.\.'\)") as info:
        score(boom, long_prompt, "r", "a")
    assert isinstance(info.value, MsrlError) and isinstance(info.value, RuntimeError)
    assert "Q" * 77 + "..." in str(info.value) and "Q" * 78 not in str(info.value)  # truncated to 80
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(RewardError, match=r"returned 'yes', not a number \(prompt '1\+1'\)"):
        score(lambda p, r, a: "yes", "1+1", "r", "a")
    with pytest.raises(RewardError, match="returned nan, not a finite number"):
        score(lambda p, r, a: math.nan, "p", "r", "a")
    assert score(rule_reward, "2+2", "#### 4", "4") == 1.0
    assert score(lambda p, r, a: True, "p", "r", "a") == 1.0
