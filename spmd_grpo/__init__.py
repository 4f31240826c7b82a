"""GRPO/DAPO post-training of Qwen-VL models as plain SPMD under torchrun: see the README's module map."""

__version__ = "0.1.0"
