"""The public megatron-core API (``tenplex_megatron.save_checkpoint`` / ``load_checkpoint``): a front door like the
others, through a :class:`~tenplex_megatron.frontdoor.checkpointer.Checkpointer`.

A save claims its directory's lease (another live job's directory is refused on every rank, naming it and its
holder, before anything is written) and commits under the lease's fence; a load takes the newest complete
checkpoint under its directory and falls back past a damaged one to the previous, naming it (Megatron's own
checkpoint there is adopted). A training loop that saves again and again passes one ``checkpointer``
(:func:`open_checkpointer`) and closes it at the end; without one each call builds its own and closes it after
(the lease released at once, taken again by the next save).
"""

from __future__ import annotations

from typing import Any

from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.engine.save import SaveResult
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.frontdoor.checkpointer import Checkpointer, load_for_api, save_for_api
from tenplex_megatron.frontdoor.engines import MegatronCoreEngine
from tenplex_megatron.integrations.megatron_core.adapter import live_job

PROG = "tenplex_megatron"
__all__ = ["LoadResult", "SaveResult", "load_checkpoint", "open_checkpointer", "save_checkpoint"]


class NoCheckpointError(TenplexError, FileNotFoundError):
    """``load_checkpoint``: the directory holds no complete checkpoint to load."""


def open_checkpointer() -> Checkpointer:
    """A Checkpointer for a training loop's calls (``checkpointer=``): each save directory claimed at its first save
    and held until :meth:`~Checkpointer.close` (or the end of a ``with`` block)."""
    return Checkpointer.for_api(PROG)


def save_checkpoint(save_dir: str, model: Any, optimizer: Any, scheduler: Any, *, iteration: int,
                    consumed_samples: int = 0, vocab_size: int | None = None, seed: int = 1234,
                    extra: dict[str, Any] | None = None, keep: int | None = None, job_id: str | None = None,
                    take_over: bool = False, checkpointer: Checkpointer | None = None) -> SaveResult:
    """Collective: save a megatron-core model, optimizer and scheduler as a tenplex checkpoint.

    ``model``: the (DDP-wrapped) GPTModel, or the list of its model chunks (one per virtual pipeline stage). ``iteration``
    names the checkpoint (``iter_NNNNNNN``); ``consumed_samples`` is the data
    position a restart resumes from; ``vocab_size``: the tokenizer's real rows
    (the rest of the embedding is padding). ``extra``: JSON your loop wants back. ``keep``: the newest complete
    checkpoints kept. ``job_id`` (default: the launch's identity) and ``take_over`` (a lease whose holder may still
    live): the directory's lease (module docstring).
    """
    job = live_job(model, optimizer, scheduler, vocab_size, seed)
    job.iteration, job.consumed_samples = int(iteration), int(consumed_samples)
    return save_for_api(MegatronCoreEngine(job, extra=dict(extra or {})), save_dir, keep, PROG, checkpointer,
                        job_id=job_id, take_over=take_over)


def load_checkpoint(load_dir: str, model: Any, optimizer: Any, scheduler: Any, *, vocab_size: int | None = None,
                    seed: int = 1234, iteration: int | None = None, strict: bool = True,
                    verify: bool = True, trust_pickles: bool = False,
                    checkpointer: Checkpointer | None = None) -> LoadResult:
    """Collective: load the newest complete checkpoint under ``load_dir`` into a model built at any layout; a
    damaged one falls back to the previous, naming it (``iteration``: that one, no fallback).

    Returns a :class:`LoadResult`: ``.iteration`` and ``.consumed_samples`` say where to resume,
    ``.extra`` holds what was passed as ``extra`` at save (read-only), ``.layout`` the saving layout. ``trust_pickles``: hand Transformer Engine's
    extra state to its modules without checking its pickles (only for a checkpoint you trust).
    """
    job = live_job(model, optimizer, scheduler, vocab_size, seed)
    job.trust_pickles = bool(trust_pickles)
    res = load_for_api(MegatronCoreEngine(job, verify, trust_pickles, strict=strict), load_dir, iteration, PROG,
                       checkpointer)
    if res is None:
        raise NoCheckpointError(f"no complete tenplex checkpoint under {load_dir}")
    return res
