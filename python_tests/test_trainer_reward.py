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


# ---- verl's reward signature and dict rewards -------------------------------------------------------------


def verl_reward(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "acc": 1.0, "split": extra_info["split"]}


def verl_reward_no_extra(data_source, solution_str, ground_truth):
    return 0.5 if data_source == "gsm8k" else 0.0


def test_verl_signature_is_chosen_by_its_parameter_names():
    from msrl_core.trainer.reward import reward_style, score_record

    assert reward_style(verl_reward) == "verl" and reward_style(rule_reward) == "prompt"
    rec = {"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2", "data_source": "gsm8k"}
    assert score_record(verl_reward, {**rec, "extra_info": {"split": 3}}, "2") == (
        1.0,
        {"acc": 1.0, "split": 3.0},
    )
    assert score_record(verl_reward_no_extra, rec, "2") == (0.5, {})  # extra_info not passed to it
    assert score_record(rule_reward, {"prompt": "1+1=", "answer": "2"}, "2") == (1.0, {})


def test_load_reward_fn_accepts_the_verl_signature(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1\n"
    )
    fn = load_reward_fn(f"{f}:compute_score")
    assert fn(data_source="x", solution_str="y", ground_truth="z") == 1


@pytest.mark.parametrize(
    "value, message",
    [
        ("high", r"returned 'high', not a number"),
        ({"acc": 1.0}, r"returned a dict without 'score' \(keys \['acc'\]"),
        ({"score": "x"}, r"returned 'score'='x', not a number"),
        ({"score": 1.0, "acc": float("nan")}, r"returned 'acc'=nan, not a finite number"),
        (None, r"returned None, not a number"),
    ],
)
def test_non_number_rewards_are_clear_errors(value, message):
    from msrl_core.trainer.reward import score_record

    with pytest.raises(RewardError, match=message):
        score_record(lambda prompt, response, answer: value, {"prompt": "p", "answer": "a"}, "r")


def test_dict_reward_extras_are_logged_per_step(tmp_path):
    """A dict reward's extra entries reach the step's metrics as reward/<key>/mean."""
    import trainer_util
    from msrl_core.trainer.run import open_session
    from msrl_core.trainer.task import arithmetic_records, write_jsonl

    recs = [
        dict(r, data_source="arith", extra_info={"split": 2}) for r in arithmetic_records(12, 2, 5, seed=0)
    ]
    data = write_jsonl(recs, str(tmp_path / "d.jsonl"))
    cfg = load_config(
        None,
        [
            *trainer_util.TINY_RUN,
            f"data.train_files={data}",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"reward.fn={__file__}:verl_reward",
        ],
    )
    s = open_session(cfg, log=lambda _: None)
    try:
        m = s.trainer.step(next(s.loader))
    finally:
        s.trainer.close()
    assert m["reward/acc/mean"] == 1.0 and m["reward/split/mean"] == 2.0
    assert 0.0 <= m["grpo/score/mean"] <= 1.0
