"""The configuration's top-level sections (`data`, `algorithm`, `trainer`) and the root `Config`, as frozen
pydantic dataclasses: types and ranges are declared on the fields, each field's docstring is its
documentation (docs/configuration.md is generated from them: `make docs`), and a rule between fields of one
section is the section's `__post_init__`, whose message starts with the field it names.

Section names follow EasyR1/verl so their users recognise them: ``data``, ``algorithm``, ``worker.actor``,
``worker.rollout``, ``worker.ref``, ``worker.reward``, ``trainer``. Deviations from EasyR1's schema:
``algorithm.norm_adv_by_std_in_grpo`` is verl's name (with a third value, ``batch``); DAPO's switches live
under ``algorithm.filter_groups`` and ``algorithm.overlong_buffer`` (verl: ``algorithm.filter_groups`` and
``reward_model.overlong_buffer``). Values derived from several fields (``Config.max_model_len``,
``Config.num_train_groups``, ``Config.total_steps``) are computed here and nowhere else.
"""

from __future__ import annotations

import importlib.util
from dataclasses import field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic.dataclasses import dataclass

from spmd_grpo.config.checks import (
    BUILTIN_DATASETS,
    SECTION,
    Bool,
    Float,
    Fraction,
    Int,
    NonEmpty,
    NonNegative,
    NonNegativeFloat,
    OffOrPositive,
    Positive,
    PositiveFloat,
    Str,
    require,
)
from spmd_grpo.config.workers import WorkerConfig


def _known_builtin(source: str) -> str:
    if source.startswith("builtin:"):
        require(
            source.removeprefix("builtin:") in BUILTIN_DATASETS,
            f"unknown builtin data set; available: {', '.join('builtin:' + t for t in BUILTIN_DATASETS)}",
        )
    return source


DataSource = Annotated[NonEmpty, AfterValidator(_known_builtin)]
VideoInt = Annotated[Int, Field(gt=0)] | None
VideoFloat = Annotated[Float, Field(gt=0)] | None


# --------------------------------------------------------------------------------------------- sections
@dataclass(config=SECTION)
class DataConfig:
    train_files: DataSource = "builtin:color"
    """`hub/repo@split`, a local parquet file or directory, or `builtin:<task>` (synthetic, see data/synthetic.py)."""
    val_files: DataSource | None = None
    """The validation data, same forms. Required when `trainer.val_freq` is not -1 or `trainer.val_before_train` is
    true."""
    prompt_key: NonEmpty = "problem"
    """Column holding the problem text, with one `<image>` marker per image."""
    answer_key: NonEmpty = "answer"
    """Column holding the ground truth."""
    image_key: NonEmpty = "images"
    """Column holding the images (list of `{bytes, path}`); a file without it has text-only rows."""
    format_prompt: Str | None = None
    """Path to a jinja file rendering `content` (the problem) into the user message; None = problem as is."""
    system_prompt: Str | None = None
    """A system message before the user turn. A special token written in it is an error at load."""
    max_prompt_length: Positive = 512
    """Prompt tokens after image-token expansion; longer prompts are filtered at load, never truncated."""
    max_response_length: Positive = 512
    """Most tokens sampled per response (vLLM `max_tokens`); also the constant of `loss_agg_mode:
    seq-mean-token-sum-norm` and the end of the overlong buffer."""
    rollout_batch_size: Positive = 16
    """Prompts drawn per step across all ranks; each yields worker.rollout.n samples."""
    val_batch_size: OffOrPositive = -1
    """Validation prompts per generation batch, over all ranks (-1: the whole validation set in one batch)."""
    val_max_samples: OffOrPositive = -1
    """Validate on the first N examples of the validation set (-1: all)."""
    min_pixels: Positive = 3136
    """Images are resized (qwen-vl-utils `smart_resize`) into [`min_pixels`, `max_pixels`]; the trainer's processor
    and vLLM get the same bounds."""
    max_pixels: Positive = 262144
    """See `min_pixels`. Must be >= `min_pixels`."""
    video_key: NonEmpty = "videos"
    """Column of each row's videos: a list of file paths or encoded bytes (or {bytes, path}), one `<video>`
    marker per video in the problem text. Frames are sampled and resized by qwen-vl-utils' rules (the six
    keys below; None: the installed qwen-vl-utils' default, the pixel ones for the model's patch x merge)."""
    video_fps: VideoFloat = None
    """Frames sampled per second of video (qwen_vl_utils FPS)."""
    video_min_frames: VideoInt = None
    """Fewest sampled frames (qwen_vl_utils FPS_MIN_FRAMES)."""
    video_max_frames: VideoInt = None
    """Most sampled frames (qwen_vl_utils FPS_MAX_FRAMES)."""
    video_min_pixels: VideoInt = None
    """Pixels per frame at least (qwen_vl_utils VIDEO_MIN_TOKEN_NUM x factor^2)."""
    video_max_pixels: VideoInt = None
    """Pixels per frame at most (qwen_vl_utils VIDEO_MAX_TOKEN_NUM x factor^2), lowered for long videos by
    the total budget."""
    video_total_pixels: VideoInt = None
    """Pixels of all frames of a video together (qwen_vl_utils MODEL_SEQ_LEN x factor^2 x 0.9)."""
    shuffle: Bool = True
    """Each epoch is a permutation of the data set (drawn from `data.seed`)."""
    seed: NonNegative = 1
    """Seed of the data order."""
    max_bad_fraction: Fraction = 0.1
    """Rows failing to decode are skipped; more than this fraction is an error."""
    num_builtin_examples: Positive = 256
    """Size of a `builtin:` dataset."""

    def __post_init__(self) -> None:
        low, high = self.video_min_frames, self.video_max_frames
        require(
            low is None or high is None or high >= low,
            f"video_max_frames ({high}) must be >= video_min_frames ({low})",
        )
        require(
            self.max_pixels >= self.min_pixels,
            f"max_pixels ({self.max_pixels}) must be >= min_pixels ({self.min_pixels})",
        )


@dataclass(config=SECTION)
class FilterGroupsConfig:
    """DAPO dynamic sampling (Yu et al. 2025, sec. 3.2)."""

    enable: Bool = False
    """Drop prompt groups whose `metric` is equal for all their samples and keep generating until enough groups are
    kept; the kept samples are then rebalanced so every rank trains on the same number."""
    metric: NonEmpty = "accuracy"
    """Reward key whose spread decides whether a group is kept (`accuracy`, `overall`, or a custom key)."""
    max_num_gen_batches: Int = 10
    """Generation batches per step before giving up with an error; <= 0 means unlimited."""
    train_batch_size: OffOrPositive = -1
    """Prompt groups to train on per step (-1: data.rollout_batch_size); each generation batch draws
    data.rollout_batch_size prompts, so a larger rollout batch needs fewer generation batches."""

    def num_train_groups(self, rollout_batch_size: int) -> int:
        """Prompt groups trained on per step: train_batch_size when DAPO is on and it is set, else the
        rollout batch."""
        return self.train_batch_size if self.enable and self.train_batch_size > 0 else rollout_batch_size


@dataclass(config=SECTION)
class OverlongBufferConfig:
    """DAPO overlong reward shaping (Yu et al. 2025, sec. 3.4); both values are checked even while disabled."""

    enable: Bool = False
    """Add the soft overlong penalty to each sample's `overall` score (logged as `reward/overlong_penalty`)."""
    length: NonNegative = 512
    """Buffer length L: the penalty is 0 up to `max_response_length - L` tokens, then falls linearly to
    `-penalty_factor` at `max_response_length`. >= 0 always; with `enable`: in (0, `data.max_response_length`]."""
    penalty_factor: NonNegativeFloat = 1.0
    """Largest penalty."""


@dataclass(config=SECTION)
class RolloutCorrectionConfig:
    """Rollout correction (verl's ``algorithm.rollout_correction``): importance weights and rejection for the
    gap between vLLM's sampling distribution and the trainer's old policy (formulas in algorithm/correction.py)."""

    rollout_is: Literal["token", "sequence"] | None = None
    """IS weight level: token | sequence | null (off). Weights are truncated at rollout_is_threshold (TIS)."""
    rollout_is_threshold: Annotated[Float, Field(ge=1)] = 2.0
    """TIS cap C >= 1: w = min(pi_old / pi_rollout, C)."""
    rollout_rs: Literal["token", "sequence", "geometric"] | None = None
    """Rejection (masked IS) level: token | sequence | geometric | null (off); tokens or whole sequences whose
    ratio lies outside [rollout_rs_threshold_lower, rollout_rs_threshold] leave the loss and its normaliser."""
    rollout_rs_threshold: Annotated[Float, Field(ge=1)] = 2.0
    """The upper bound."""
    rollout_rs_threshold_lower: Annotated[Float, Field(gt=0, le=1)] | None = None
    """null: 1 / rollout_rs_threshold."""


def _no_drgrpo(value: object) -> object:
    require(
        value != "drgrpo",
        "Dr.GRPO is GRPO without the std division: set algorithm.norm_adv_by_std_in_grpo=false (verl's key), "
        "with worker.actor.loss_agg_mode=seq-mean-token-sum-norm for its loss",
    )
    return value


@dataclass(config=SECTION)
class AlgorithmConfig:
    adv_estimator: Annotated[Literal["grpo"], BeforeValidator(_no_drgrpo)] = "grpo"
    """Group-relative advantages (GRPO); its normalisation is norm_adv_by_std_in_grpo."""
    norm_adv_by_std_in_grpo: Bool | Literal["batch"] = True
    """The advantage's normalisation, verl's key: true: (s - group mean) / (group std + adv_eps) (GRPO);
    false: s - group mean (Dr.GRPO, Liu et al. 2025); batch: (s - group mean) / (batch std + adv_eps), the
    std over the whole global batch (TRL's scale_rewards=batch; not in verl)."""
    adv_eps: PositiveFloat = 1e-6
    """The eps of the division."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    use_kl_loss: Bool = True
    """Build the reference model and add `kl_coef` x the KL estimate to the loss (`actor/kl_loss`)."""
    kl_penalty: Literal["low_var_kl", "kl", "abs", "mse"] = "low_var_kl"
    """Per-token estimate, with delta = logp - logp_ref: `kl` delta (k1); `abs` |delta|; `mse` delta^2 / 2 (k2);
    `low_var_kl` exp(-delta) + delta - 1 (k3), clamped to [-10, 10]."""
    kl_coef: NonNegativeFloat = 0.01
    """Weight of the KL loss."""


LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow"]
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab", "mlflow": "mlflow"}
"""The optional loggers: the module each needs; the package extra that installs it has the logger's name."""


def _installed(module: str) -> bool:
    try:  # find_spec only looks the package up: nothing heavy is imported at config time
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported already, with no spec (a module object put in sys.modules)
        return True


def _loggers_installed(loggers: tuple[str, ...]) -> tuple[str, ...]:
    require(len(set(loggers)) == len(loggers), "lists a logger twice")
    for name in loggers:
        module = LOGGER_PACKAGES.get(name)
        require(
            module is None or _installed(module),
            f"{name!r} needs the {module} package: pip install 'spmd_grpo[{name}]'",
        )
    return loggers


@dataclass(config=SECTION)
class TrainerConfig:
    project_name: NonEmpty = "spmd_grpo"
    """The project (wandb, swanlab) or experiment (mlflow) the run is logged under."""
    experiment_name: NonEmpty = "run"
    """The run's name in the trackers, and its directory under output_dir."""
    logger: Annotated[tuple[LoggerName, ...], AfterValidator(_loggers_installed)] = ("console", "jsonl")
    """Where rank 0 sends each step's metrics (verl's names): console (one line per step), jsonl
    (metrics.jsonl + val_generations.jsonl, what `python -m spmd_grpo.report` plots), tensorboard, wandb,
    swanlab, mlflow (each an optional extra: `pip install 'spmd_grpo[wandb]'`)."""
    output_dir: NonEmpty = "runs"
    """The run's files go to output_dir/experiment_name."""
    total_epochs: Positive = 1
    """Epochs over the training set, when `max_steps` is null."""
    max_steps: Annotated[Int, Field(ge=1)] | None = None
    """Stop after this many steps (null: total_epochs over the training set)."""
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    """`auto`: npu when `torch_npu` imports and sees a device, else cuda when available, else cpu."""
    seed: NonNegative = 1
    """Seeds the ranks' RNGs, the vLLM engines and the per-request sampling seeds."""
    val_freq: OffOrPositive = -1
    """Validate every N steps and after the last (-1: never; needs data.val_files)."""
    val_before_train: Bool = False
    """Validate once before the first step; needs `data.val_files`."""
    val_generations_to_log: NonNegative = 4
    """Validation generations sent to the loggers' tables."""
    save_freq: OffOrPositive = -1
    """Save every N steps and after the last (-1: only when a signal stops the run)."""
    save_limit: OffOrPositive = 2
    """Keep the newest N complete checkpoints (-1: all)."""
    resume: NonEmpty = "auto"
    """auto: continue the run in the run directory (from its newest complete checkpoint; a new run if the
    directory holds none) | none: a new run (an error if the directory holds a run) | <path to a
    global_step_N dir>. What each does with the directory: run/start.py."""
    allow_config_change: tuple[Str, ...] = ()
    """Dotted keys that may differ from the saved config on resume although they change what the saved
    state means (model, data, batch shape, objective; list in run/start.py); without them such a change is an
    error."""
    collective_timeout_s: Positive = 1800
    """Timeout of every collective; a collective that outlives it raises on the ranks that wait in it (their error
    names the ranks still in a phase: the stuck one) and torchrun ends the job. In (0, 2**31 - 1]."""
    preempt_grace_s: Annotated[Float, Field(gt=0, le=2**31 - 1)] = 25.0
    """After SIGTERM/SIGINT the run stops at the next step boundary, saving that step; if it is not done
    this many seconds after the signal, the rank exits at once (128 + signal) without a new checkpoint. Keep
    it below torchrun's --shutdown_timeout and Slurm's KillWait (both 30 s by default), which SIGKILL."""
    log_every: Positive = 1
    """The console logger's line interval (the first and last steps are always printed)."""
    log_memory: Bool = True
    """Log one memory line per phase (rollout, update) on rank 0."""


@dataclass(config=SECTION)
class Config:
    """The whole configuration, one field per top-level YAML section."""

    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

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
