"""Reference models built on manifoldlib: the GPT of the hidden-state connection study.

The names below are loaded from :mod:`models.gpt` on first use, so that ``python -m
models.train`` reaches its own Ctrl-C handling before torch is imported.
"""

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "GPTConfig"]


def __getattr__(name: str):
    if name in __all__:
        from . import gpt

        return getattr(gpt, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
