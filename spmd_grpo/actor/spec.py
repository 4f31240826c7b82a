"""`UpdateSpec`: everything the forward passes and the update need, derived once from the config, so the actor
functions take one small frozen object instead of the whole config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from spmd_grpo.algorithm.correction import CorrectionSpec
from spmd_grpo.config.schema import Config
from spmd_grpo.models.families import Family, family_of_model_path

ImageFeatures = Literal["per_step", "per_pass", "in_forward"]


@dataclass(frozen=True)
class UpdateSpec:
    """What the trainer-side passes need from the config (one place, derived once)."""

    temperature: float
    pad_token_id: int
    max_response_length: int
    mini_batch_size: int
    """Samples per mini-batch on each rank (worker.actor.global_batch_size / world size)."""
    micro_batch_size: int
    experience_micro_batch_size: int
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_dual: float | None = 3.0
    """None for GSPO (dual clip is defined for the token ratio only)."""
    loss_mode: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    entropy_coef: float = 0.0
    use_kl_loss: bool = False
    kl_penalty: str = "low_var_kl"
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    rollout_correction: CorrectionSpec = field(default_factory=CorrectionSpec)
    """Off (both levels null) unless the config enables it."""
    image_features: ImageFeatures = "in_forward"
    """Where the language model's image features come from, decided once here (`from_config`) and only read
    elsewhere. `per_step`: a frozen tower encodes each prompt's images once per step (`encode_images`) and
    every pass reuses them. `per_pass`: a trained tower; each forward-only pass (`compute_logprobs`: old
    logprobs, reference) encodes each prompt's images once with its own model and drops the features after
    the pass, the update encodes in its forwards (the gradient needs them). `in_forward`: every forward
    encodes its own pixels (reuse off, a run that allows videos, or a family whose language model takes more
    than the tower's final output)."""
    ignored: tuple[str, ...] = ()
    """Settings this spec ignores, each with why (the trainer logs them once at start)."""
    dynamic_batching: bool = False
    """Micro-batches by token budget (the two below) instead of by sample count."""
    max_token_len_for_update: int = 16384
    max_token_len_for_experience: int = 16384
    old_logprobs_from_update: bool = False
    """Take the old logprobs from the update's forward when the step is exactly on-policy."""
    routing_replay: str = "none"
    """MoE: which routes the trainer passes replay (none, old, rollout: worker.actor.moe, actor/routes.py)."""
    videos: bool = False
    """The run allows videos (worker.rollout.limit_videos > 0): every forward runs the vision tower on video
    input, a dummy one where its micro-batch has no video. Features are then never reused, images' neither
    (`image_features` in_forward): transformers refuses precomputed features beside video pixels."""

    @classmethod
    def from_config(
        cls, cfg: Config, *, world_size: int, pad_token_id: int, family: Family | None = None
    ) -> UpdateSpec:
        """`family`: the built model's (`family_of(model.config)`); None reads it from the model path, and
        where that cannot be told offline image features are encoded in every forward (always exact)."""
        a, alg = cfg.worker.actor, cfg.algorithm
        family = family or family_of_model_path(a.model.model_path)
        image_features, ignored = _image_features(cfg, family)
        return cls(
            temperature=cfg.worker.rollout.temperature,
            pad_token_id=pad_token_id,
            max_response_length=cfg.data.max_response_length,
            mini_batch_size=a.global_batch_size // world_size,
            micro_batch_size=a.micro_batch_size_per_device_for_update,
            experience_micro_batch_size=a.micro_batch_size_per_device_for_experience,
            ppo_epochs=a.ppo_epochs,
            clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high,
            clip_ratio_dual=a.clip_ratio_dual if a.loss_mode == "vanilla" else None,
            loss_mode=a.loss_mode,
            loss_agg_mode=a.loss_agg_mode,
            entropy_coef=a.entropy_coef,
            use_kl_loss=alg.use_kl_loss,
            kl_penalty=alg.kl_penalty,
            kl_coef=alg.kl_coef,
            max_grad_norm=a.max_grad_norm,
            rollout_correction=CorrectionSpec(**dataclasses.asdict(alg.rollout_correction)),
            image_features=image_features,
            ignored=ignored,
            dynamic_batching=a.dynamic_batching,
            max_token_len_for_update=a.max_token_len_per_device_for_update,
            max_token_len_for_experience=a.max_token_len_per_device_for_experience,
            old_logprobs_from_update=a.old_logprobs_from_update
            is not False,  # auto and true: where on-policy
            videos=cfg.worker.rollout.limit_videos > 0,
            routing_replay=a.moe.routing_replay,
        )

    def tower_in_forward(self, *, for_update: bool) -> bool:
        """Whether the forwards of a pass run the vision tower themselves, or take image features encoded
        before the pass (`image_features`). Depends on the config alone, so every rank answers the same:
        the one decision of whether a micro-batch without pixels must run the tower on a dummy image
        (`PolicyModule`)."""
        if self.image_features == "per_step":
            return False
        return for_update or self.image_features == "in_forward"

    def old_logprobs_in_update(self, num_samples: int) -> bool:
        """True when the update takes the old logprobs from its own forward (the step is exactly on-policy:
        one epoch, one mini-batch holding this rank's `num_samples`, no rejection sampling), and routing
        replay `old` does not need the old pass's routes before the reference pass."""
        return (
            self.old_logprobs_from_update
            and self.routing_replay != "old"
            and self.ppo_epochs == 1
            and self.mini_batch_size >= num_samples
            and self.rollout_correction.rollout_rs is None
        )


def _image_features(cfg: Config, family: Family | None) -> tuple[ImageFeatures, tuple[str, ...]]:
    """`UpdateSpec.image_features` from `worker.actor.reuse_image_features`, and why it is ignored if it is.
    transformers takes precomputed features only for every modality of a forward or none: with videos
    possible, images are encoded in the forward too."""
    a = cfg.worker.actor
    if a.reuse_image_features is False or cfg.worker.rollout.limit_videos > 0:  # true with videos: refused
        return "in_forward", ()
    if family is None or not family.reusable_image_features:
        if a.reuse_image_features is not True or family is None:
            return "in_forward", ()
        return "in_forward", (
            f"worker.actor.reuse_image_features ignored: {family.name} takes no precomputed features",
        )
    return ("per_step" if a.model.freeze_vision_tower else "per_pass"), ()
