"""`UpdateSpec`: everything the forward passes and the update need, derived once from the config, so the actor
functions take one small frozen object instead of the whole config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from spmd_grpo.algorithm.correction import CorrectionSpec
from spmd_grpo.config.schema import Config


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
    reuse_image_features: bool = False
    """Encode each prompt's images once per step (`encode_images`); only with a frozen vision tower."""
    encode_once_per_pass: bool = False
    """A trained tower: each forward-only pass (`compute_logprobs`: old logprobs, reference) encodes each
    prompt's images once with its own model and drops the features after the pass."""
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
    (`reuse_image_features` off): transformers refuses precomputed features beside video pixels."""

    @classmethod
    def from_config(cls, cfg: Config, *, world_size: int, pad_token_id: int) -> UpdateSpec:
        a, alg = cfg.worker.actor, cfg.algorithm
        reuse = (
            a.reuse_image_features is not False and cfg.worker.rollout.limit_videos == 0
        )  # auto: validated
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
            # transformers takes precomputed features only for every modality of a forward or none:
            # with videos possible, images are encoded in the forward too.
            reuse_image_features=reuse and a.model.freeze_vision_tower,
            encode_once_per_pass=reuse and not a.model.freeze_vision_tower,
            dynamic_batching=a.dynamic_batching,
            max_token_len_for_update=a.max_token_len_per_device_for_update,
            max_token_len_for_experience=a.max_token_len_per_device_for_experience,
            old_logprobs_from_update=a.old_logprobs_from_update
            is not False,  # auto and true: where on-policy
            videos=cfg.worker.rollout.limit_videos > 0,
            routing_replay=a.moe.routing_replay,
        )

    def tower_in_forward(self, reusable_features: bool, *, for_update: bool) -> bool:
        """Whether the forwards of a pass run the vision tower themselves, or take image features encoded
        before the pass (`encode_images` once per step with a frozen tower, once per forward-only pass with
        a trained one). `reusable_features`: the model's family can take features (`Family`). Depends on
        the config alone, so every rank answers the same: the one decision of whether a micro-batch
        without pixels must run the tower on a dummy image (`PolicyModule`)."""
        if not reusable_features:
            return True
        if self.reuse_image_features:
            return False
        return for_update or not self.encode_once_per_pass

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
