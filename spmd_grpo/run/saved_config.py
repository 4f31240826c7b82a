"""The run's saved config: `<run dir>/config.yaml` written (`write_run_config`), read back as plain values
(`plain_config`), and compared with the config of a resume (`diff_configs`, `meaning_changes`), which
`run.start.plan_start` decides with.

The config diff. The saved config is the checkpoint's `config.yaml` (written with every checkpoint), else
(checkpoints saved before that) the `config.yaml` of the checkpoint's run directory, else, with no
checkpoint, this run directory's `config.yaml`. Both are flattened to dotted keys and compared key by key
(as YAML reads them back, so `1e-6` equals `1.0e-06`; `trainer.resume` and `trainer.allow_config_change`
are not compared). Each difference is either

  * MEANING-CHANGING (`MEANING_CHANGING` below, with the reason printed in the error): the saved state would
    be read as something it is not. An error listing `key: old -> new` and the override that allows it,
    `trainer.allow_config_change=[key,...]` (explicit keys, no wildcard: a careful user names what they
    accept). The list, by what the saved state is:
      - the weights and the optimizer's parameters: `worker.actor.model.model_path` (also the reference
        model), `tokenizer_path` (token ids), `freeze_vision_tower` (which parameters have Adam state), `lora.rank`, `target_modules`,
        `exclude_modules` (which adapters exist) and `alpha` (their scale);
      - the data position (epoch, batches drawn) indexes a filtered, shuffled data set: `data.train_files`,
        the row keys, `format_prompt`, `system_prompt`, `num_builtin_examples`, `max_prompt_length`, the
        pixel limits and the video sampling keys (`data.video_*`: the length filter),
        `worker.rollout.limit_images` and `limit_videos` (rows with more images or videos are skipped: a
        changed limit changed the data set's size and the resume failed after vLLM had loaded),
        `shuffle`, `data.seed` (the order), `rollout_batch_size`;
      - the step the step counter, the data position and the LR schedule count: `data.rollout_batch_size`,
        `worker.rollout.n`, `worker.actor.global_batch_size`, `ppo_epochs`, `data.max_response_length`,
        DAPO's `filter_groups.enable` / `train_batch_size`;
      - the objective the Adam moments were accumulated for (gradient scale and direction):
        `algorithm.adv_estimator`, `norm_adv_by_std_in_grpo`, `worker.actor.loss_mode`,
        `loss_agg_mode`.
    An allowed change to a data-position key drops the saved data position (sampling starts over at the
    first batch of the new data; one warning): the old position would point into other examples.
  * EVERYTHING ELSE takes effect and is reported, one line each (`resume: worker.actor.optim.lr 1e-06 ->
    5e-07`): the learning rate and its schedule (the optimizer's settings come from the config, only Adam's
    moments and the schedule's position from the checkpoint: checkpoint.load_checkpoint), KL/entropy/clip
    coefficients, the reward function, sampling settings, `max_steps`/`total_epochs`, `trainer.seed` (the
    saved RNG streams are restored; the seed only names future sampling seeds), dtypes (the policy's fp32
    master weights are what is saved), parallelism, memory and logging settings.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from spmd_grpo.config.loader import to_dict
from spmd_grpo.config.schema import Config

log = logging.getLogger(__name__)

_WEIGHTS = "the saved weights and optimizer state belong to it"
_DATA = "the saved data position indexes this data set"
_STEP = "a step's shape: the saved step count, data position and LR schedule count these steps"
_OBJECTIVE = "the objective the saved Adam moments were accumulated for"
MEANING_CHANGING: dict[str, str] = {
    "worker.actor.model.model_path": _WEIGHTS + " (and the reference model is built from it)",
    "worker.actor.model.tokenizer_path": "the token ids the policy was trained on",
    "worker.actor.model.freeze_vision_tower": "which parameters the saved optimizer state covers",
    **dict.fromkeys(
        [f"worker.actor.model.lora.{k}" for k in ("rank", "target_modules", "exclude_modules")],
        "which adapters the saved weights and optimizer state are",
    ),
    "worker.actor.model.lora.alpha": "the scale the saved adapters were trained with",
    **dict.fromkeys(
        [
            *(f"data.{k}" for k in ("train_files", "prompt_key", "answer_key", "image_key", "format_prompt")),
            *(f"data.{k}" for k in ("system_prompt", "num_builtin_examples", "max_prompt_length")),
            *(f"data.{k}" for k in ("min_pixels", "max_pixels", "shuffle", "seed", "video_key")),
            # a video's sampled frames and their sizes are its prompt's length: the length filter
            *(f"data.video_{k}" for k in ("fps", "min_frames", "max_frames", "min_pixels", "max_pixels")),
            "data.video_total_pixels",
            # rows with more images or videos than the engine takes are skipped at load: the filter
            "worker.rollout.limit_images",
            "worker.rollout.limit_videos",
        ],
        _DATA,
    ),
    "data.rollout_batch_size": _STEP + "; " + _DATA + " in batches of this size",
    **dict.fromkeys(
        [
            "worker.rollout.n",
            "worker.actor.global_batch_size",
            "worker.actor.ppo_epochs",
            "data.max_response_length",
            "algorithm.filter_groups.enable",
            "algorithm.filter_groups.train_batch_size",
        ],
        _STEP,
    ),
    **dict.fromkeys(
        [
            "algorithm.adv_estimator",
            "algorithm.norm_adv_by_std_in_grpo",
            "worker.actor.loss_mode",
            "worker.actor.loss_agg_mode",
        ],
        _OBJECTIVE,
    ),
}
DATA_POSITION_KEYS = frozenset(k for k, why in MEANING_CHANGING.items() if _DATA in why)
NOT_COMPARED = ("trainer.resume", "trainer.allow_config_change")
_ABSENT = object()


@dataclass(frozen=True)
class ConfigChange:
    """One dotted key whose value differs between the saved config and this one."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value)


# ------------------------------------------------------------------------------------------------ diff
def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys -> leaf values (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# libyaml's emitter and parser where PyYAML was built with them: the values are the same (the representer,
# resolver and constructor are PyYAML's Python ones either way), the round trip 1 ms instead of 14.
_SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def plain_config(cfg: Config) -> dict[str, Any]:
    """`cfg` as its saved `config.yaml` reads back (tuples as lists, floats as YAML writes them)."""
    return yaml.load(yaml.dump(to_dict(cfg), Dumper=_SAFE_DUMPER, sort_keys=False), Loader=_SAFE_LOADER)


def diff_configs(saved: dict[str, Any], new: dict[str, Any]) -> list[ConfigChange]:
    """Every dotted key whose value differs (a key only one side has counts), sorted by key."""
    old_flat, new_flat = flatten(saved), flatten(new)
    keys = sorted((old_flat.keys() | new_flat.keys()) - set(NOT_COMPARED))
    return [
        ConfigChange(k, old_flat.get(k, _ABSENT), new_flat.get(k, _ABSENT))
        for k in keys
        if old_flat.get(k, _ABSENT) != new_flat.get(k, _ABSENT)
    ]


def meaning_changes(changes: list[ConfigChange], allowed: tuple[str, ...]) -> list[ConfigChange]:
    """The changes that would change what the saved state means and are not in `allowed`."""
    return [c for c in changes if c.key in MEANING_CHANGING and c.key not in allowed]


def write_run_config(cfg: Config, step: int) -> None:
    """The resolved config as `<run dir>/config.yaml`; a different one already there (the run's config before a
    resume that changed settings) is kept as `config.until_step_<step>.yaml`."""
    path = cfg.run_dir / "config.yaml"
    if path.is_file() and _read_yaml(path) != plain_config(cfg):
        kept, i = path.with_name(f"config.until_step_{step}.yaml"), 0
        while kept.exists():  # never over an earlier kept one (resumed from this step before)
            i += 1
            kept = path.with_name(f"config.until_step_{step}.{i}.yaml")
        path.replace(kept)
        log.info("the run's previous config moved to %s", kept)
    dump_yaml(cfg, path)


def _read_yaml(path) -> object:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None  # unreadable: kept aside like a different one


def dump_yaml(cfg: Config, path: Path) -> None:
    """The resolved config as YAML (next to the run's logs and in every checkpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    tmp.replace(path)
