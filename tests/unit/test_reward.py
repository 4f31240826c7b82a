"""Math reward, user reward files (the README's example included), validation of reward outputs, DAPO
overlong penalty."""

from pathlib import Path

import pytest
import torch

from spmd_grpo.algorithm.reward import (
    _BUILTIN_REWARDS,
    RewardError,
    load_reward_function,
    math_reward,
    overlong_penalty,
    score_samples,
)
from spmd_grpo.config.checks import BUILTIN_REWARDS


def sample(response: str, ground_truth: str = "4", **extra) -> dict:
    return {"response": response, "response_length": len(response), "ground_truth": ground_truth, **extra}


# ---- math reward --------------------------------------------------------------------------------------------


def test_math_reward_correct_with_and_without_format():
    with_format = sample("<think>2 + 2 = 4</think> The answer is \\boxed{4}.")
    without_format = sample("The answer is \\boxed{4}")
    wrong_with_format = sample("<think>hmm</think>\\boxed{5}")
    results = math_reward([with_format, without_format, wrong_with_format])
    # 0.9 * accuracy + 0.1 * format
    assert results[0] == {"overall": 1.0, "format": 1.0, "accuracy": 1.0}
    assert results[1] == {"overall": pytest.approx(0.9), "format": 0.0, "accuracy": 1.0}
    assert results[2] == {"overall": pytest.approx(0.1), "format": 1.0, "accuracy": 0.0}


def test_math_reward_normalises_whitespace_around_tags_like_easyr1():
    # "< think >" and "</ think >" become "<think>" and "</think>"; mathruler grades 1/2 == 0.5
    (result,) = math_reward([sample("\n< think > x </ think >\n\\boxed{\\frac{1}{2}}\n", ground_truth="0.5")])
    assert result == {"overall": 1.0, "format": 1.0, "accuracy": 1.0}


def test_math_reward_format_weight():
    (result,) = math_reward([sample("\\boxed{4}")], format_weight=0.5)
    assert result["overall"] == pytest.approx(0.5)  # 0.5 * 1 + 0.5 * 0
    with pytest.raises(ValueError, match="format_weight"):
        math_reward([], format_weight=1.5)


# ---- loading ------------------------------------------------------------------------------------------------


def test_builtin_rewards_apply_the_configured_format_weight():
    """worker.reward.format_weight reaches the built-in rewards: overall = (1 - w) * accuracy + w * format."""
    right_no_format, format_only = sample("\\boxed{4}"), sample("<think>x</think>\\boxed{5}")
    for w in (0.0, 0.1, 0.5):
        math = load_reward_function("math", format_weight=w)
        assert [r["overall"] for r in math([right_no_format, format_only])] == [
            pytest.approx(1 - w),
            pytest.approx(w),
        ]
        (color,) = load_reward_function("color", format_weight=w)([sample("x 3", ground_truth="3")])
        assert color == {"overall": pytest.approx(1 - w), "format": 0.0, "accuracy": 1.0}
    assert load_reward_function("math").__qualname__ == "math_reward"  # named in reward errors
    with pytest.raises(ValueError, match="format_weight must be in"):
        load_reward_function("math", format_weight=1.5)


def test_builtin_names_agree_with_the_config():
    assert set(_BUILTIN_REWARDS) == set(BUILTIN_REWARDS)


def test_load_builtin_and_user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class Weights:\n"
        "    length: float = 0.01\n"
        "NOT_A_FUNCTION = 3\n"
        "def length_reward(samples):\n"
        "    return [{'overall': Weights().length * s['response_length']} for s in samples]\n"
    )
    fn = load_reward_function(f"{path}:length_reward")
    assert score_samples(fn, [sample("abcd")])["overall"].tolist() == [pytest.approx(0.04)]

    for bad_spec, message in [
        (f"{tmp_path / 'missing.py'}:fn", "does not exist"),
        (f"{path}:nope", "no attribute 'nope'"),
        (f"{path}:NOT_A_FUNCTION", "not callable"),
        ("mathh", "must be one of"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            load_reward_function(bad_spec)
        assert repr(bad_spec) in str(info.value)


REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "reward_length_penalty.py"


def test_the_readme_reward_example_is_the_shipped_file_and_scores_as_it_says():
    assert EXAMPLE.read_text() in (REPO / "README.md").read_text()  # shown whole, as it ships
    fn = load_reward_function(f"{EXAMPLE}:reward")
    right = sample("so x = 4.", ground_truth="4", uid=0, sample_index=0, data_source="geo3k")
    scores = score_samples(fn, [right, sample("x is 5", ground_truth="4"), sample("", ground_truth="4")])
    assert scores["overall"].tolist() == pytest.approx([1 - 0.009, -0.006, 0.0])
    assert scores["accuracy"].tolist() == [1.0, 0.0, 0.0]
    assert scores["length_cost"].tolist() == pytest.approx([0.009, 0.006, 0.0])


def test_a_reward_function_that_cannot_take_the_batch_is_refused_at_load(tmp_path):
    """verl's per-sample shape (or a missing argument) failed only at the first step's reward, after the
    model and vLLM had loaded; batch functions with extra optional or keyword-only parameters still load."""
    path = tmp_path / "shapes.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
        "def no_arguments():\n    return []\n"
        "def batch(samples, scale=1.0, *, key='overall'):\n    return [{key: scale} for _ in samples]\n"
        "def star(*args, **kwargs):\n    return [{'overall': 0.0} for _ in args[0]]\n"
    )
    for name, says in [
        ("compute_score", "compute_score(data_source, solution_str, ground_truth, extra_info=None) cannot be "
         "called with one argument (missing a required argument: 'solution_str')"),
        ("no_arguments", "no_arguments() cannot be called with one argument (too many positional arguments)"),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as info:
            load_reward_function(f"{path}:{name}")
        assert says in str(info.value) and "once per batch with a list of sample dicts" in str(info.value)
    for name in ("batch", "star"):
        assert score_samples(load_reward_function(f"{path}:{name}"), [sample("a")])["overall"].tolist() == [
            1.0 if name == "batch" else 0.0
        ]


def test_user_file_import_error_names_spec(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import definitely_not_a_module_xyz\n")
    with pytest.raises(ValueError, match="importing") as info:
        load_reward_function(f"{path}:fn")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


# ---- score_samples ------------------------------------------------------------------------------------------


def test_score_samples_returns_float32_tensors_per_key():
    scores = score_samples(math_reward, [sample("<think></think>\\boxed{4}"), sample("\\boxed{3}")])
    assert set(scores) == {"overall", "format", "accuracy"}
    assert scores["overall"].dtype == torch.float32
    torch.testing.assert_close(scores["overall"], torch.tensor([1.0, 0.0]))


def test_nan_reward_names_the_sample():
    def nan_on_second(samples):
        return [{"overall": 1.0}, {"overall": float("nan")}]

    samples = [sample("a", uid="u-0"), sample("b", uid="u-1")]
    with pytest.raises(RewardError, match=r"sample 1 \(uid='u-1'\).*'overall' = nan"):
        score_samples(nan_on_second, samples)


def test_reward_fn_exception_is_wrapped_with_batch():
    def boom(samples):
        raise KeyError("ground_truth")

    with pytest.raises(
        RewardError, match=r"boom \(.*test_reward.py\) raised KeyError.*step 7 train batch.*2 samples"
    ) as info:
        score_samples(boom, [sample("a", uid="p0"), sample("b", uid="p1")], batch_name="step 7 train batch")
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(
    "error", [SystemExit(0), KeyboardInterrupt()], ids=["SystemExit", "KeyboardInterrupt"]
)
def test_a_reward_fn_that_exits_fails_the_step_naming_its_file(tmp_path, error):
    """`SystemExit` is not an `Exception`: uncaught, sys.exit(0) in a reward function ended the job with
    exit code 0 and nothing trained."""
    path = tmp_path / "exits.py"
    path.write_text("import sys\n\ndef fn(samples):\n    raise ERROR\n")
    fn = load_reward_function(f"{path}:fn")
    fn.__globals__["ERROR"] = error
    with pytest.raises(RewardError, match=rf"fn \({path}\) raised {type(error).__name__}"):
        score_samples(fn, [sample("a", uid="p0")], batch_name="step 1 train batch")


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ({"overall": 1.0}, "returned a dict"),
        ([{"overall": 1.0}], "returned 1 results for 2 samples"),
        ([{"overall": 1.0}, {"acc": 1.0}], "sample 1.*no 'overall'"),
        ([{"overall": 1.0}, {"overall": 1.0, "acc": 1.0}], "sample 1.*differ"),
        ([{"overall": 1.0}, {"overall": "1.0"}], "sample 1.*'1.0'.*not a real number"),
        ([{"overall": 1.0, "acc": float("inf")}, {"overall": 1.0, "acc": 1.0}], "sample 0.*'acc' = inf"),
        ([{"overall": 1.0}, [1.0]], "sample 1.*expected a dict"),
    ],
)
def test_invalid_reward_outputs_raise(returned, message):
    with pytest.raises(RewardError, match=message):
        score_samples(lambda samples: returned, [sample("a"), sample("b")])


# ---- overlong penalty ---------------------------------------------------------------------------------------


def test_overlong_penalty_below_inside_and_at_end_of_buffer():
    # L_max = 20, L_buf = 4, factor 1 -> expected = 16; penalty = min(-(len - 16) / 4, 0)
    lengths = torch.tensor([10, 16, 18, 20])
    #          below: 0, at the buffer start: 0, inside: -(2) / 4 = -0.5, at the end: -(4) / 4 = -1
    out = overlong_penalty(lengths, max_response_length=20, buffer_length=4, penalty_factor=1.0)
    assert out.tolist() == [0.0, 0.0, -0.5, -1.0]
    # the factor scales the slope: at the end of the buffer the penalty is -factor
    assert overlong_penalty(lengths, 20, 4, 0.5).tolist() == [0.0, 0.0, -0.25, -0.5]


@pytest.mark.parametrize("buffer_length", [0, 21])
def test_overlong_penalty_validates_buffer(buffer_length):
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(
            torch.tensor([1]), max_response_length=20, buffer_length=buffer_length, penalty_factor=1.0
        )


def test_a_reward_file_runs_once_per_process(tmp_path):
    """The preflight check imports the user's file and the trainer asks for it again: its top level (which
    may load a model or open a connection) runs once."""
    runs = tmp_path / "runs.txt"
    reward = tmp_path / "once.py"
    reward.write_text(f"open({str(runs)!r}, 'a').write('ran\\n')\n\ndef fn(samples):\n    return []\n")
    first = load_reward_function(f"{reward}:fn")
    assert load_reward_function(f"{reward}:fn") is first
    assert runs.read_text() == "ran\n"
