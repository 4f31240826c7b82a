"""Configuration: YAML -> frozen dataclasses, dotted command-line overrides, strict validation.

Section names follow EasyR1/verl so their users recognise them: ``data``, ``algorithm``, ``worker.actor``,
``worker.rollout``, ``worker.ref``, ``worker.reward``, ``trainer``.

Everything a user can get wrong is caught here, before any process group or model exists:
  * unknown keys (with the full dotted name and the closest valid key), a key given twice in one YAML
    mapping (file and both lines),
  * wrong types (with the expected type); a float must be finite (NaN and inf are refused everywhere),
  * value rules, checked by ``validate(cfg, world_size)``: first each section's own (ranges, enums, a
    built-in name), in the section's ``check(prefix)`` method where ``prefix`` is its dotted key
    (``worker.rollout.``), then the rules across sections and the world size (batch sizes vs world size and
    group size, TP dividing the world, DAPO's batch and length settings, validation without a validation
    set), then what must exist on this machine, in the sections' ``check_files(prefix)`` (model and
    tokenizer directory or hub id, data files, prompt template, reward file and function, resume directory)
    and the training set's rows against the rollout batch. ``--dry-run`` skips the last part: it plans a job
    for another machine.
``ConfigError`` carries a one-line message naming the key, the value and what is allowed; ``spmd_grpo.train``
prints it and exits with code 2. Values derived from several fields (``Config.max_model_len``,
``Config.num_train_groups``, ``Config.total_steps``) are computed here and nowhere else.

Deviations from EasyR1's schema: ``algorithm.norm_adv_by_std_in_grpo`` and ``algorithm.adv_std_scope`` are
verl's names; DAPO's switches live under ``algorithm.filter_groups`` and ``algorithm.overlong_buffer`` (verl
names them ``algorithm.filter_groups`` and ``reward_model.overlong_buffer``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from spmd_grpo.config.checks import (
    BUILTIN_DATASETS,
    check_data_source,
    require,
    require_at_least,
    require_nonempty,
    require_off_or_positive,
    require_positive,
    require_seconds,
)
from spmd_grpo.config.workers import WorkerConfig


# --------------------------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class DataConfig:
    train_files: str = "builtin:color"
    """`hub/repo@split`, a local parquet file or directory, or `builtin:<task>` (synthetic, see data/synthetic.py)."""
    val_files: str | None = None
    prompt_key: str = "problem"
    answer_key: str = "answer"
    image_key: str = "images"
    format_prompt: str | None = None
    """Path to a jinja file rendering `content` (the problem) into the user message; None = problem as is."""
    system_prompt: str | None = None
    max_prompt_length: int = 512
    """Prompt tokens after image-token expansion; longer prompts are filtered at load, never truncated."""
    max_response_length: int = 512
    rollout_batch_size: int = 16
    """Prompts drawn per step across all ranks; each yields worker.rollout.n samples."""
    val_batch_size: int = -1
    """Validation prompts per generation batch, over all ranks (-1: the whole validation set in one batch)."""
    val_max_samples: int = -1
    """Validate on the first N examples of the validation set (-1: all)."""
    min_pixels: int = 3136
    max_pixels: int = 262144
    video_key: str = "videos"
    """Column of each row's videos: a list of file paths or encoded bytes (or {bytes, path}), one `<video>`
    marker per video in the problem text. Frames are sampled and resized by qwen-vl-utils' rules (the five
    keys below; None: the installed qwen-vl-utils' default, the pixel ones for the model's patch x merge)."""
    video_fps: float | None = None
    """Frames sampled per second of video (qwen_vl_utils FPS)."""
    video_min_frames: int | None = None
    """Fewest sampled frames (qwen_vl_utils FPS_MIN_FRAMES)."""
    video_max_frames: int | None = None
    """Most sampled frames (qwen_vl_utils FPS_MAX_FRAMES)."""
    video_min_pixels: int | None = None
    """Pixels per frame at least (qwen_vl_utils VIDEO_MIN_TOKEN_NUM x factor^2)."""
    video_max_pixels: int | None = None
    """Pixels per frame at most (qwen_vl_utils VIDEO_MAX_TOKEN_NUM x factor^2), lowered for long videos by
    the total budget."""
    video_total_pixels: int | None = None
    """Pixels of all frames of a video together (qwen_vl_utils MODEL_SEQ_LEN x factor^2 x 0.9)."""
    shuffle: bool = True
    seed: int = 1
    max_bad_fraction: float = 0.1
    """Rows failing to decode are skipped; more than this fraction is an error."""
    num_builtin_examples: int = 256
    """Size of a `builtin:` dataset."""

    def check(self, prefix: str) -> None:
        require_positive(
            self,
            prefix,
            "max_prompt_length",
            "max_response_length",
            "rollout_batch_size",
            "min_pixels",
            "num_builtin_examples",
        )
        require_nonempty(self, prefix, "train_files", "prompt_key", "answer_key", "image_key", "video_key")
        video_rules = ("fps", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels")
        for name in (f"video_{rule}" for rule in video_rules):
            value = getattr(self, name)
            require(value is None or value > 0, f"{prefix}{name} must be positive or null, got {value}")
        low, high = self.video_min_frames, self.video_max_frames
        require(
            low is None or high is None or high >= low,
            f"{prefix}video_max_frames ({high}) must be >= {prefix}video_min_frames ({low})",
        )
        require_off_or_positive(self, prefix, "val_batch_size", "val_max_samples")
        require_at_least(self, prefix, 0, "seed")
        require(
            self.max_pixels >= self.min_pixels,
            f"{prefix}max_pixels ({self.max_pixels}) must be >= {prefix}min_pixels ({self.min_pixels})",
        )
        require(
            0 <= self.max_bad_fraction <= 1,
            f"{prefix}max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}",
        )
        for name in ("train_files", "val_files"):
            source = getattr(self, name)
            if source is not None and source.startswith("builtin:"):
                require(
                    source.removeprefix("builtin:") in BUILTIN_DATASETS,
                    f"{prefix}{name}: unknown builtin data set {source!r}; available: "
                    f"{', '.join('builtin:' + t for t in BUILTIN_DATASETS)}",
                )

    def check_files(self, prefix: str) -> None:
        check_data_source(f"{prefix}train_files", self.train_files)
        if self.val_files is not None:
            check_data_source(f"{prefix}val_files", self.val_files)
        if self.format_prompt is not None:
            require(
                Path(self.format_prompt).expanduser().is_file(),
                f"{prefix}format_prompt must be an existing jinja file, got {self.format_prompt!r}: no such file",
            )


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO dynamic sampling (Yu et al. 2025, sec. 3.2)."""

    enable: bool = False
    metric: str = "accuracy"
    """Reward key whose spread decides whether a group is kept (`accuracy`, `overall`, or a custom key)."""
    max_num_gen_batches: int = 10
    """Generation batches per step before giving up with an error; <= 0 means unlimited."""
    train_batch_size: int = -1
    """Prompt groups to train on per step (-1: data.rollout_batch_size); each generation batch draws
    data.rollout_batch_size prompts, so a larger rollout batch needs fewer generation batches."""

    def num_train_groups(self, rollout_batch_size: int) -> int:
        """Prompt groups trained on per step: train_batch_size when DAPO is on and it is set, else the
        rollout batch."""
        return self.train_batch_size if self.enable and self.train_batch_size > 0 else rollout_batch_size

    def check(self, prefix: str) -> None:
        require_nonempty(self, prefix, "metric")
        require_off_or_positive(self, prefix, "train_batch_size")


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO overlong reward shaping (Yu et al. 2025, sec. 3.4)."""

    enable: bool = False
    length: int = 512
    penalty_factor: float = 1.0

    def check(self, prefix: str) -> None:
        require_at_least(self, prefix, 0, "length", "penalty_factor")  # checked even while disabled


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Rollout correction (verl's ``algorithm.rollout_correction``): importance weights and rejection for the
    gap between vLLM's sampling distribution and the trainer's old policy (formulas in algorithm/correction.py)."""

    rollout_is: str | None = None
    """IS weight level: token | sequence | null (off). Weights are truncated at rollout_is_threshold (TIS)."""
    rollout_is_threshold: float = 2.0
    """TIS cap C >= 1: w = min(pi_old / pi_rollout, C)."""
    rollout_rs: str | None = None
    """Rejection (masked IS) level: token | sequence | geometric | null (off); tokens or whole sequences whose
    ratio lies outside [rollout_rs_threshold_lower, rollout_rs_threshold] leave the loss and its normaliser."""
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float | None = None
    """null: 1 / rollout_rs_threshold."""

    def check(self, prefix: str) -> None:
        require(
            self.rollout_is in (None, "token", "sequence"),
            f"{prefix}rollout_is must be one of 'token', 'sequence' or null, got {self.rollout_is!r}",
        )
        require(
            self.rollout_rs in (None, "token", "sequence", "geometric"),
            f"{prefix}rollout_rs must be one of 'token', 'sequence', 'geometric' or null, got {self.rollout_rs!r}",
        )
        cap, upper = self.rollout_is_threshold, self.rollout_rs_threshold
        lower = self.rollout_rs_threshold_lower
        require(
            cap >= 1, f"{prefix}rollout_is_threshold must be >= 1 (a cap on pi_old/pi_rollout), got {cap}"
        )
        require(upper >= 1, f"{prefix}rollout_rs_threshold must be >= 1, got {upper}")
        require(
            lower is None or 0 < lower <= 1,
            f"{prefix}rollout_rs_threshold_lower must be in (0, 1] (or null: 1 / rollout_rs_threshold), got {lower}",
        )


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: Literal["grpo", "drgrpo"] = "grpo"
    """grpo: (s - mean) / (std + eps) per group; drgrpo: s - mean (Liu et al. 2025)."""
    norm_adv_by_std_in_grpo: bool = True
    adv_std_scope: Literal["group", "batch"] = "group"
    adv_eps: float = 1e-6
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    use_kl_loss: bool = True
    kl_penalty: Literal["low_var_kl", "kl", "abs", "mse"] = "low_var_kl"
    kl_coef: float = 0.01

    def check(self, prefix: str) -> None:
        require_positive(self, prefix, "adv_eps")
        require_at_least(self, prefix, 0, "kl_coef")


LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow"]
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab", "mlflow": "mlflow"}
"""The optional loggers: the module each needs; the package extra that installs it has the logger's name."""


@dataclass(frozen=True)
class TrainerConfig:
    project_name: str = "spmd_grpo"
    """The project (wandb, swanlab) or experiment (mlflow) the run is logged under."""
    experiment_name: str = "run"
    """The run's name in the trackers, and its directory under output_dir."""
    logger: tuple[LoggerName, ...] = ("console", "jsonl")
    """Where rank 0 sends each step's metrics (verl's names): console (one line per step), jsonl
    (metrics.jsonl + val_generations.jsonl, what `python -m spmd_grpo.report` plots), tensorboard, wandb,
    swanlab, mlflow (each an optional extra: `pip install 'spmd_grpo[wandb]'`)."""
    output_dir: str = "runs"
    """The run's files go to output_dir/experiment_name."""
    total_epochs: int = 1
    max_steps: int | None = None
    """Stop after this many steps, >= 1 (null: total_epochs over the training set)."""
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    seed: int = 1
    val_freq: int = -1
    """Validate every N steps and after the last (-1: never; needs data.val_files)."""
    val_before_train: bool = False
    val_generations_to_log: int = 4
    save_freq: int = -1
    """Save every N steps and after the last (-1: only when a signal stops the run)."""
    save_limit: int = 2
    """Keep the newest N complete checkpoints (-1: all)."""
    resume: str = "auto"
    """auto: continue the run in the run directory (from its newest complete checkpoint; a new run if the
    directory holds none) | none: a new run (an error if the directory holds a run) | <path to a
    global_step_N dir>. What each does with the directory: run/start.py."""
    allow_config_change: tuple[str, ...] = ()
    """Dotted keys that may differ from the saved config on resume although they change what the saved
    state means (model, data, batch shape, objective; list in run/start.py); without them such a change is an
    error."""
    collective_timeout_s: int = 1800
    preempt_grace_s: float = 25.0
    """After SIGTERM/SIGINT the run stops at the next step boundary, saving that step; if it is not done
    this many seconds after the signal, the rank exits at once (128 + signal) without a new checkpoint. Keep
    it below torchrun's --shutdown_timeout and Slurm's KillWait (both 30 s by default), which SIGKILL."""
    log_every: int = 1
    log_memory: bool = True
    """Log one memory line per phase (rollout, update) on rank 0."""

    def check(self, prefix: str) -> None:
        require_positive(self, prefix, "total_epochs", "log_every")
        require_seconds(self, prefix, "collective_timeout_s", "preempt_grace_s")
        require_nonempty(self, prefix, "project_name", "experiment_name", "output_dir")
        require(
            self.max_steps is None or self.max_steps >= 1,
            f"{prefix}max_steps must be >= 1 or null (total_epochs over the data), got {self.max_steps}",
        )
        require_off_or_positive(self, prefix, "val_freq", "save_freq", "save_limit")
        require_at_least(self, prefix, 0, "seed", "val_generations_to_log")
        require_nonempty(self, prefix, "resume")
        require(
            len(set(self.logger)) == len(self.logger), f"{prefix}logger lists a logger twice: {self.logger}"
        )
        for name in self.logger:
            module = LOGGER_PACKAGES.get(name)
            # find_spec only looks the package up: nothing heavy is imported at config time.
            require(
                module is None or importlib.util.find_spec(module) is not None,
                f"{prefix}logger: {name!r} needs the {module} package: pip install 'spmd_grpo[{name}]'",
            )

    def check_files(self, prefix: str) -> None:
        require(
            self.resume in ("auto", "none") or Path(self.resume).expanduser().is_dir(),
            f"{prefix}resume must be auto, none or an existing checkpoint directory (global_step_N), "
            f"got {self.resume!r}: no such directory",
        )


@dataclass(frozen=True)
class Config:
    """The whole configuration, one field per top-level YAML section."""

    @property
    def run_dir(self) -> Path:
        """trainer.output_dir / trainer.experiment_name: the run's own directory."""
        return Path(self.trainer.output_dir) / self.trainer.experiment_name

    @property
    def max_model_len(self) -> int:
        """Prompt + response tokens: the longest sequence vLLM and the trainer see."""
        return self.data.max_prompt_length + self.data.max_response_length

    @property
    def num_train_groups(self) -> int:
        """Prompt groups trained on per step (DAPO's train_batch_size when set, else the rollout batch)."""
        return self.algorithm.filter_groups.num_train_groups(self.data.rollout_batch_size)

    def total_steps(self, steps_per_epoch: int) -> int:
        """trainer.max_steps, else trainer.total_epochs over the training set."""
        return self.trainer.max_steps or self.trainer.total_epochs * steps_per_epoch

    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
