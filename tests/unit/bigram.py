"""A bigram policy with the trainer's policy interface, for update tests that need a real gradient in
milliseconds: the logprob of token y after token x is log_softmax(table[x] / temperature)[y]."""

from types import SimpleNamespace

import torch
from torch import nn


class BigramPolicy(nn.Module):
    """Returns (response logprobs, entropy) [B, R] like `models.policy.PolicyModule`, zero on padding. Its
    `config` names a family, as a policy's does (the passes ask it whether image features are reusable)."""

    config = SimpleNamespace(model_type="qwen2_5_vl")

    def __init__(self, vocab: int, seed: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)))

    @property
    def compute_device(self) -> torch.device:
        return self.table.device

    def forward(self, batch, temperature: float = 1.0, with_entropy: bool = False):
        width = batch.response_mask.shape[1]
        pos = (batch.prompt_lengths[:, None] + torch.arange(width)[None]).clamp(
            max=batch.input_ids.shape[1] - 1
        )
        logp = (self.table[batch.input_ids.gather(1, pos - 1)] / temperature).log_softmax(-1)
        lp = logp.gather(-1, batch.input_ids.gather(1, pos)[..., None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return lp * batch.response_mask, entropy * batch.response_mask
