"""Reference models built on manifoldlib: the GPT of the hidden-state connection study."""

from .gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "GPTConfig"]
