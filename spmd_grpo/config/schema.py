"""The sections `data`, `algorithm`, `trainer` and the root `Config`, with the values derived from several
fields. Names follow EasyR1/verl; deviations: `norm_adv_by_std_in_grpo` (verl's) takes a third value `batch`;
DAPO's switches are `algorithm.filter_groups` and `algorithm.overlong_buffer` (verl: `reward_model.*`)."""

from __future__ import annotations

from dataclasses import field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

import spmd_grpo.config.checks as c
from spmd_grpo.config.workers import WorkerConfig

DataSource = Annotated[
    c.NonEmpty,
    c.rule(
        lambda s: not s.startswith("builtin:") or s[8:] in c.BUILTIN_DATASETS,
        f"unknown builtin data set; available: {', '.join('builtin:' + t for t in c.BUILTIN_DATASETS)}",
    ),
]


@dataclass(config=c.SECTION)
class DataConfig:
    train_files: DataSource = "builtin:color"
    """`hub/repo@split`, a local parquet file or directory, or `builtin:<task>` (synthetic: data/synthetic.py)."""
    val_files: DataSource | None = None
    """The validation data, same forms; needed by `trainer.val_freq` and `trainer.val_before_train`."""
    prompt_key: c.NonEmpty = "problem"
    """Column of the problem text, with one `<image>` marker per image."""
    answer_key: c.NonEmpty = Field("answer", description="Column of the ground truth.")
    image_key: c.NonEmpty = "images"
    """Column of the images (list of `{bytes, path}`); a file without it has text-only rows."""
    format_prompt: str | None = None
    """A jinja file rendering `content` (the problem) into the user message; None: the problem as is."""
    system_prompt: str | None = None
    """A system message before the user turn (a special token in it is an error at load)."""
    max_prompt_length: c.Positive = 512
    """Prompt tokens after image-token expansion; longer prompts are filtered at load, never truncated."""
    max_response_length: c.Positive = 512
    """Most tokens sampled per response (vLLM `max_tokens`); the constant of `seq-mean-token-sum-norm`."""
    rollout_batch_size: c.Positive = 16
    """Prompts drawn per step across all ranks; each yields worker.rollout.n samples."""
    val_batch_size: c.OffOrPositive = -1
    """Validation prompts per generation batch, rounded up to a multiple of the world size (-1: all)."""
    val_max_samples: c.OffOrPositive = -1
    """Validate on the first N examples of the validation set (-1: all)."""
    min_pixels: c.Positive = 3136
    """Images are resized (qwen-vl-utils `smart_resize`) into [min_pixels, max_pixels], for trainer and vLLM."""
    max_pixels: c.Positive = Field(262144, description="See `min_pixels`.")
    video_key: c.NonEmpty = "videos"
    """Column of the videos (paths or bytes), one `<video>` marker each; frames by qwen-vl-utils' rules with
    the keys below (None: its default)."""
    video_fps: c.PositiveFloat | None = None
    """Frames sampled per second (qwen_vl_utils FPS)."""
    video_min_frames: c.Positive | None = Field(None, description="Fewest sampled frames (FPS_MIN_FRAMES).")
    video_max_frames: c.Positive | None = Field(None, description="Most sampled frames (FPS_MAX_FRAMES).")
    video_min_pixels: c.Positive | None = None
    """Pixels per frame at least (VIDEO_MIN_TOKEN_NUM x factor^2)."""
    video_max_pixels: c.Positive | None = None
    """Pixels per frame at most (VIDEO_MAX_TOKEN_NUM x factor^2), lowered by the total below."""
    video_total_pixels: c.Positive | None = None
    """Pixels of all frames of a video together (MODEL_SEQ_LEN x factor^2 x 0.9)."""
    shuffle: c.Bool = True
    """Each epoch is a permutation of the data set, drawn from `seed`."""
    seed: c.NonNegative = Field(1, description="Seed of the data order.")
    max_bad_fraction: c.Fraction = 0.1
    """Rows failing to decode are skipped; more than this fraction is an error."""
    num_builtin_examples: c.Positive = Field(256, description="Size of a `builtin:` data set.")

    def __post_init__(self) -> None:
        low, high = self.video_min_frames, self.video_max_frames
        c.require(
            low is None or high is None or high >= low,
            f"video_max_frames ({high}) must be >= video_min_frames ({low})",
        )
        c.require(
            self.max_pixels >= self.min_pixels,
            f"max_pixels ({self.max_pixels}) must be >= min_pixels ({self.min_pixels})",
        )


@dataclass(config=c.SECTION)
class FilterGroupsConfig:
    """DAPO dynamic sampling (Yu et al. 2025, sec. 3.2)."""

    enable: c.Bool = False
    """Drop groups whose `metric` is equal for all samples, generating until enough are kept (rebalanced)."""
    metric: c.NonEmpty = "accuracy"
    """Reward key whose spread keeps a group (`accuracy`, `overall`, or a custom reward's key)."""
    max_num_gen_batches: c.Int = 10
    """Generation batches per step before giving up with an error; <= 0: unlimited."""
    train_batch_size: c.OffOrPositive = -1
    """Prompt groups trained on per step (-1: data.rollout_batch_size, the prompts of each generation batch)."""


@dataclass(config=c.SECTION)
class OverlongBufferConfig:
    """DAPO overlong reward shaping (Yu et al. 2025, sec. 3.4); both values are checked even while disabled."""

    enable: c.Bool = False
    """Add the soft overlong penalty to each sample's `overall` score (`reward/overlong_penalty`)."""
    length: c.NonNegative = 512
    """L: no penalty up to `max_response_length - L` tokens, then linear to `-penalty_factor` at the maximum."""
    penalty_factor: c.NonNegativeFloat = Field(1.0, description="The largest penalty.")


@dataclass(config=c.SECTION)
class RolloutCorrectionConfig:
    """verl's rollout correction of vLLM's sampling vs the old policy (formulas: algorithm/correction.py)."""

    rollout_is: Literal["token", "sequence"] | None = None
    """IS weight level (null: off); weights are truncated at rollout_is_threshold (TIS)."""
    rollout_is_threshold: Annotated[c.Float, Field(ge=1)] = 2.0
    """TIS cap C: w = min(pi_old / pi_rollout, C)."""
    rollout_rs: Literal["token", "sequence", "geometric"] | None = None
    """Rejection level (null: off): ratios outside [lower, rollout_rs_threshold] leave loss and normaliser."""
    rollout_rs_threshold: c.Float = Field(2.0, ge=1, description="The upper bound.")
    rollout_rs_threshold_lower: Annotated[c.Float, Field(gt=0, le=1)] | None = None
    """null: 1 / rollout_rs_threshold."""


@dataclass(config=c.SECTION)
class AlgorithmConfig:
    adv_estimator: Literal["grpo"] = "grpo"
    """Group-relative advantages (GRPO), normalised as norm_adv_by_std_in_grpo says."""
    norm_adv_by_std_in_grpo: c.Bool | Literal["batch"] = True
    """true: (s - group mean) / (group std + adv_eps) (GRPO); false: s - group mean (Dr.GRPO); batch: the
    global batch's std (TRL's scale_rewards=batch; not in verl)."""
    adv_eps: c.PositiveFloat = Field(1e-6, description="The eps of the division.")
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    use_kl_loss: c.Bool = True
    """Build the reference model and add `kl_coef` x the KL estimate to the loss (`actor/kl_loss`)."""
    kl_penalty: Literal["low_var_kl", "kl", "abs", "mse"] = "low_var_kl"
    """d = logp - logp_ref: kl: d; abs: |d|; mse: d^2 / 2; low_var_kl: exp(-d) + d - 1 (k3) in [-10, 10]."""
    kl_coef: c.NonNegativeFloat = Field(0.01, description="Weight of the KL loss.")


LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow"]
Loggers = Annotated[tuple[LoggerName, ...], c.rule(lambda v: len(set(v)) == len(v), "lists a logger twice")]


@dataclass(config=c.SECTION)
class TrainerConfig:
    project_name: c.NonEmpty = "spmd_grpo"
    """The project (wandb, swanlab) or experiment (mlflow) the run is logged under."""
    experiment_name: c.NonEmpty = "run"
    """The run's name in the trackers, and its directory under output_dir."""
    logger: Loggers = ("console", "jsonl")
    """Where rank 0 sends metrics: console, jsonl (what `python -m spmd_grpo.report` plots), tensorboard,
    wandb, swanlab, mlflow (optional extras: `pip install 'spmd_grpo[wandb]'`)."""
    output_dir: c.NonEmpty = Field("runs", description="The run's files go to output_dir/experiment_name.")
    total_epochs: c.Positive = Field(1, description="Epochs over the training set, when `max_steps` is null.")
    max_steps: Annotated[c.Int, Field(ge=1)] | None = None
    """Stop after this many steps (null: total_epochs over the training set)."""
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    """auto: npu when `torch_npu` imports and sees a device, else cuda when available, else cpu."""
    seed: c.NonNegative = 1
    """Seeds the ranks' RNGs, the vLLM engines and the per-request sampling seeds."""
    val_freq: c.OffOrPositive = -1
    """Validate every N steps and after the last (-1: never)."""
    val_before_train: c.Bool = False
    """Validate once before the first step of a new run (not at a resume, where verl validates again)."""
    val_generations_to_log: c.NonNegative = 4
    """Validation generations sent to the loggers' tables."""
    save_freq: c.OffOrPositive = -1
    """Save every N steps and after the last (-1: only when a signal stops the run)."""
    save_limit: c.OffOrPositive = Field(2, description="Keep the newest N complete checkpoints (-1: all).")
    resume: c.NonEmpty = "auto"
    """auto: from the run's newest complete checkpoint (a new run if none); none: a new run (an error if one
    exists); or a global_step_N directory."""
    allow_config_change: tuple[str, ...] = ()
    """Keys allowed to differ on resume although they change what the saved state means (model, data, ...)."""
    collective_timeout_s: c.Positive = 1800
    """Timeout of every collective: the waiting ranks fail, naming the ranks still in a phase (on Ascend
    HCCL_EXEC_TIMEOUT is 60 s less unless set)."""
    preempt_grace_s: Annotated[c.Float, Field(gt=0, le=c.C_INT_MAX)] = 25.0
    """After SIGTERM/SIGINT: save at the next step boundary, or exit (128 + signal) with no new checkpoint
    after this long. Keep it below Slurm's KillWait (`spmd_grpo.launch` sets torchrun's shutdown timeout)."""
    log_every: c.Positive = 1
    """The console logger's line interval (the first and last steps are always printed)."""
    log_memory: c.Bool = True
    """Log one memory line per phase (rollout, update) per rank (rank<r>.log; rank 0 also to the console)."""


@dataclass(config=c.SECTION)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.output_dir) / self.trainer.experiment_name

    @property
    def max_model_len(self) -> int:
        """Prompt + response tokens: the longest sequence vLLM and the trainer see."""
        return self.data.max_prompt_length + self.data.max_response_length

    @property
    def num_train_groups(self) -> int:
        """Prompt groups trained on per step (DAPO's train_batch_size when set, else the rollout batch)."""
        fg = self.algorithm.filter_groups
        return fg.train_batch_size if fg.enable and fg.train_batch_size > 0 else self.data.rollout_batch_size

    def total_steps(self, steps_per_epoch: int) -> int:
        return self.trainer.max_steps or self.trainer.total_epochs * steps_per_epoch
