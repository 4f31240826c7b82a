"""The benchmark scripts' command lines, checked without running a benchmark: every command the README, the
benchmark docs and the scripts' docstrings give names a script that exists and only options that script
defines; torchrun passes every option of a script run under it through to the script; the configurations
that the training-run benchmarks start pass the config checks (through the scripts' own lazy imports, where a
renamed loader helper once stopped step_throughput at its first run)."""

import ast
import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
PAGES = [
    REPO / "README.md",
    BENCHMARKS / "README.md",
    REPO / "docs" / "benchmarks.md",
    *sorted(BENCHMARKS.glob("*.py")),
]
COMMAND = re.compile(r"benchmarks/(\w+)\.py([^`\n|;]*)")  # the script and the rest of its line
UNDER_TORCHRUN = re.compile(r"torchrun[^`\n]*?benchmarks/(\w+)\.py")
OPTION = re.compile(r"(?<![\w-])--?[a-zA-Z][\w-]*")


@functools.cache
def defined_options(script: Path) -> frozenset[str]:
    """The option strings of every `add_argument` call in `script`, and argparse's own -h/--help (each script
    parsed once: the pages name the same scripts about 80 times)."""
    calls = [n for n in ast.walk(ast.parse(script.read_text())) if isinstance(n, ast.Call)]
    return frozenset({"-h", "--help"}) | {
        a.value
        for call in calls
        if isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"
        for a in call.args
        if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")
    }


def test_documented_benchmark_commands_name_existing_scripts_and_options():
    problems, seen = [], 0
    for page in PAGES:
        for name, rest in COMMAND.findall(page.read_text()):
            script, where = BENCHMARKS / f"{name}.py", page.relative_to(REPO)
            if not script.exists():
                problems.append(f"{where}: benchmarks/{name}.py does not exist")
                continue
            unknown = set(OPTION.findall(rest)) - defined_options(script)
            problems += [f"{where}: benchmarks/{name}.py has no option {sorted(unknown)}"] if unknown else []
            seen += 1
    assert not problems, problems
    assert seen > 40  # the pattern still finds the commands


def test_torchrun_passes_every_option_of_the_scripts_run_under_it():
    """torchrun's parser also expands abbreviations of its own options after the script name: a script
    option that abbreviates one (`--n`: --nnodes, --nproc-per-node, ...) stops the command there."""
    from torch.distributed.run import parse_args

    scripts = {name for page in PAGES for name in UNDER_TORCHRUN.findall(page.read_text())}
    assert {"dapo_rebalance", "lora_sync", "sync_memory", "load_memory"} <= scripts, scripts
    refused = []
    for name in sorted(scripts):
        script = BENCHMARKS / f"{name}.py"
        for option in sorted(defined_options(script) - {"-h", "--help"}):
            try:
                args = parse_args(["--nproc_per_node", "1", str(script), option, "1"])
            except SystemExit:
                refused.append(f"{name}: {option}")
                continue
            assert args.training_script_args == [option, "1"], (name, option, args.training_script_args)
    assert not refused, f"torchrun takes these script options as its own: {refused}"


def test_training_run_benchmarks_check_their_configs_before_starting(capsys):
    from benchmarks import bare_limit, shared_prompt, step_throughput

    ap = step_throughput.parser()
    step_throughput.check_configs(ap, ap.parse_args(["--configs", ",".join(step_throughput.CONFIGS)]))
    _, used = step_throughput.overrides("on", step_throughput.known_keys())
    assert len(used) == len(step_throughput.FEATURES), used  # a renamed key would silently drop a feature
    # update / fwd divides by a forward-only pass: the separate old pass, else the reference pass, else none
    phases = {}
    for name, extra in [
        ("off", []),
        ("on", []),
        ("on-dapo", []),
        ("on", ["--set", "algorithm.use_kl_loss=false"]),
    ]:
        ranks, run_overrides, _ = step_throughput.run_config(
            name, Path("unbuilt"), ap.parse_args(extra), Path("x")
        )
        phases[name, *extra[1:]] = step_throughput.forward_phase(run_overrides, ranks)
    assert list(phases.values()) == ["old_log_prob", "ref", "ref", None], phases
    ap = bare_limit.parser()
    bare_limit.check_configs(ap, ap.parse_args([]), Path("unbuilt"))
    ap = shared_prompt.parser()
    shared_prompt.check_configs(ap, ap.parse_args([]))

    ap = step_throughput.parser()
    with pytest.raises(SystemExit) as stop:
        step_throughput.check_configs(ap, ap.parse_args(["--prompts", "1", "--configs", "on,on-dapo"]))
    assert stop.value.code == 2
    assert (
        "configuration on-dapo (2 rank(s)): data.rollout_batch_size (1) must be divisible"
        in capsys.readouterr().err
    )
