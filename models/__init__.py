"""Reference models built on manifoldlib: the GPT of the hidden-state connection study."""

from .gpt import GPT, Block, CausalSelfAttention, GPTConfig, MLP

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP"]
