"""The smoke job's pass criterion (`spmd_grpo.smoke.learned_at`, `report`): the mean reward of 5 consecutive
training steps must reach 0.8 within the run; a run that does not learn (a learning rate of 0 keeps the
reward where the random policy has it) fails. The job itself is `make smoke-test` (`make smoke-test-moe` and
`make smoke-test-qwen3_5` for the other families' smoke configs, checked here to load and validate)."""

import pytest

from spmd_grpo.config.loader import load_config
from spmd_grpo.config.validate import validate
from spmd_grpo.models.families import FAMILIES
from spmd_grpo.smoke import SMOKE_MODELS, TARGET, WINDOW, learned_at, read_rows, report, smoke_config


def _rows(scores, key="critic/score/mean", validation_first=True):
    rows = [{"step": 0, "val-core/color/acc/mean@1": 0.25}] if validation_first else []
    for step, score in enumerate(scores, start=1):
        rows.append({"step": step, key: score, "response_length/mean": 1.0, "rollout/logprob_diff_max": 1e-6,
                     "timing_s/step": 1.0})  # fmt: skip
    return rows


def test_met_at_the_first_window_whose_mean_reaches_the_target():
    # Windows ending at steps 5, 6, 7: means 0.56, 0.72, 0.80 (the first at or above 0.8).
    scores = [0.2, 0.4, 0.6, 0.8, 0.8, 1.0, 0.8, 0.0]
    assert WINDOW == 5 and TARGET == 0.8
    assert learned_at(_rows(scores)) == 7
    assert learned_at(_rows(scores[:6])) is None  # not yet met while the run goes on
    assert learned_at(_rows([1.0] * 4)) is None  # fewer steps than the window
    assert learned_at([{"step": 0, "val-core/color/acc/mean@1": 1.0}]) is None  # validation rows never count


def test_one_good_step_among_bad_ones_is_not_learning():
    assert learned_at(_rows([0.1, 0.1, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1])) is None  # best window 0.64


def test_dapo_runs_are_judged_by_the_score_of_everything_generated():
    rows = _rows([0.9] * 5, key="critic/score/mean")
    for r in rows[1:]:
        r["train/gen_score/mean"] = 0.5  # the filtered batch looks better than what was generated
    assert learned_at(rows) is None


def test_a_run_that_does_not_learn_fails_and_one_that_learns_passes(capsys):
    flat = [0.03, 0.02, 0.04, 0.03] * 25  # lr=0: 100 steps at the random policy's reward
    assert report(_rows(flat), learned_at(_rows(flat)), 100, 1.0) == 1
    assert "not reached in 100 steps (best 0.032): FAIL" in capsys.readouterr().out
    rising = [min(1.0, 0.03 * step) for step in range(1, 41)]
    learned = learned_at(_rows(rising))
    assert learned == 29  # steps 25-29 average 0.81
    assert report(_rows(rising), learned, 100, 1.0) == 0
    assert "reached at step 29 (0.810): PASS" in capsys.readouterr().out
    assert report([{"step": 0, "val-core/color/acc/mean@1": 0.0}], None, 100, 1.0) == 1  # no training step


def test_a_row_still_being_written_is_not_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_rows(path) == []
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "crit')
    assert read_rows(path) == [{"step": 1}, {"step": 2}]


@pytest.mark.parametrize("family", sorted(SMOKE_MODELS))
def test_each_family_smoke_config_validates_for_its_model_on_2_ranks(family, tmp_path):
    """The config `--family` picks loads, validates at world 2 and asks vLLM's CPU build for a dtype it serves
    the family's tiny model in (Qwen3.5: bf16)."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert SMOKE_MODELS[family].family == family
    cfg = load_config(smoke_config(family), [f"worker.actor.model.model_path={tmp_path}"])
    validate(cfg, 2)
    assert FAMILIES[family].rollout_dtype_error(cfg.worker.rollout.dtype, "cpu") is None
    assert cfg.trainer.experiment_name.startswith("smoke")
