"""`python -m spmd_grpo.report RUN_DIR`: the PNG and the summary from a metrics.jsonl written here, also while
the run is still writing it (a partial last line), and clear failures when there is nothing to plot."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from spmd_grpo.telemetry.report import PANELS, main, read_metrics, series, summary

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(step: int) -> dict:
    return {
        "step": step,
        "critic/score/mean": 0.1 + 0.08 * step,
        "response_length/mean": 4.0 - 0.1 * step,
        "response_length/max": 4.0,
        "response_length/min": 3.0,
        "actor/kl_loss": 1e-3 * step,
        "actor/ppo_kl": 0.0,
        "actor/entropy": 6.2 - 0.3 * step,
        "actor/pg_clipfrac": 0.01,
        "actor/pg_clipfrac_lower": 0.0,
        "rollout/logprob_diff_mean": 1e-7,
        "rollout/logprob_diff_max": 1e-6 * step,
        "timing_s/step": 1.0 + 0.1 * step,
        "timing_s/gen": 0.5,
        "timing_s/update_actor": 0.3,
    }


def _write_run(run_dir: Path, steps: int, tail: str = "") -> Path:
    """metrics.jsonl as the jsonl logger writes it: validation at steps 0 and `steps`, `tail` appended raw."""
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "val-core/color/acc/mean@1": 0.05, "timing_s/testing": 2.0}]
    rows += [_row(s) for s in range(1, steps + 1)]
    rows[-1]["val-core/color/acc/mean@1"] = 0.9
    rows[-1]["timing_s/save_checkpoint"] = 3.0
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return run_dir


SUMMARY = [
    "10 training steps logged (last step 10)",
    "reward (critic/score/mean): first 5 steps 0.340 -> last 5 steps 0.740",
    "val-core/color/acc/mean@1: step 0 0.050 -> step 10 0.900",
    "response length (last step): 3.0",
    "KL (last step): 1.00e-02",
    "entropy (last step): 3.200",
    "logprob gap trainer vs vLLM: max over steps 1.0e-05",
    "step time: median 1.55 s, sum 16 s",
    "validation and checkpoints (outside the step time): 5 s",
]


@pytest.fixture(scope="module")
def reported(tmp_path_factory) -> tuple[Path, Path, int, str]:
    """(run dir, PNG, exit code, stdout) of `main([RUN, --out PNG])` on a 10-step run whose step 11 is still
    being written. Drawing the eight panels is most of this file's time, so the tests share one report."""
    root = tmp_path_factory.mktemp("report")
    run = _write_run(root / "run", 10, tail='{"step": 11, "critic/score/mea')
    png = root / "elsewhere" / "curves.png"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main([str(run), "--out", str(png)])
    return run, png, code, stdout.getvalue()


def test_report_while_the_run_is_still_writing(reported):
    run, png, code, _ = reported
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(11))  # the half-written step 11 is left out
    assert code == 0 and png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 20_000
    assert summary(rows) == SUMMARY


def test_every_panel_has_its_metrics_in_a_trainer_row(tmp_path):
    rows = read_metrics(_write_run(tmp_path / "run", 3) / "metrics.jsonl")
    for title, names, _ in PANELS:
        assert any(series(rows, name) for name in names), title


def test_repeated_steps_keep_the_last_row_and_a_bad_middle_line_is_an_error(tmp_path):
    run = _write_run(tmp_path / "run", 3, tail=json.dumps({**_row(3), "critic/score/mean": 0.5}) + "\n")
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["critic/score/mean"] == 0.5
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "{broken", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(run / "metrics.jsonl")


def test_cli_prints_the_summary_and_the_plot_path(reported):
    run, png, _, stdout = reported
    assert stdout.splitlines() == [f"run {run}:", *(f"  {line}" for line in SUMMARY), f"plot: {png}"]
    assert not (run / "report.png").exists()  # --out replaces the default RUN_DIR/report.png


def test_nothing_to_plot_yet(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 1
    assert "metrics.jsonl" in capsys.readouterr().out
    run = tmp_path / "starting"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "val-co')
    assert main([str(run)]) == 1
    assert capsys.readouterr().out == f"report: {run / 'metrics.jsonl'}: no complete step yet\n"
    assert not (run / "report.png").exists()


def test_a_null_value_is_left_out_and_a_row_without_a_step_is_an_error(tmp_path, capsys):
    run = _write_run(tmp_path / "run", 2, tail=json.dumps({**_row(3), "critic/score/mean": None}) + "\n")
    rows = read_metrics(run / "metrics.jsonl")
    assert "critic/score/mean" not in rows[-1]
    assert series(rows, "critic/score/mean")["critic/score/mean"][0] == [1, 2]
    assert summary(rows)[0] == "3 training steps logged (last step 3)"
    (run / "metrics.jsonl").write_text('{"critic/score/mean": 0.2}\n')
    assert main([str(run)]) == 1
    assert capsys.readouterr().out == f"report: {run / 'metrics.jsonl'}:1: no integer `step` in the row\n"
