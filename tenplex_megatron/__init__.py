"""tenplex-megatron: resume megatron-core / DeepSpeed training at any new TP/PP/DP layout (Tenplex's PTC as a library).

Public API for your own megatron-core training loop::

    from tenplex_megatron import load_checkpoint, save_checkpoint

    save_checkpoint(save_dir, model, optimizer, scheduler, iteration=it, consumed_samples=n)
    res = load_checkpoint(load_dir, model, optimizer, scheduler)  # at any TP/PP/DP
    it, n = res.iteration, res.consumed_samples

Every error the package raises is a :class:`TenplexError` (``except TenplexError`` catches them all).

Packages, each depending only on those after it: ``training`` (the reference
trainer) and ``integrations`` (megatron-core, Megatron-LM, DeepSpeed adapters)
-> ``engine`` (framework-neutral collective save/load) -> ``execute`` (plans into
live tensors, collectives) -> ``storage`` (the on-disk format) -> ``plan``
(pure: layouts, the PTC, the planner; never imports torch).
"""

from __future__ import annotations

from typing import Any

from tenplex_megatron.errors import TenplexError

__version__ = "0.2.0"
__all__ = ["LoadResult", "SaveResult", "TenplexError", "__version__", "load_checkpoint", "open_checkpointer",
           "save_checkpoint"]


def __getattr__(name: str) -> Any:
    """The megatron-core API on first use (PEP 562): ``import tenplex_megatron.plan`` must not import torch."""
    if name in ("save_checkpoint", "load_checkpoint", "open_checkpointer", "LoadResult", "SaveResult"):
        from tenplex_megatron.frontdoor import api

        return getattr(api, name)
    raise AttributeError(f"module 'tenplex_megatron' has no attribute {name!r}")
