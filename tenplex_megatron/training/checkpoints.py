"""The reference trainer's checkpoints: the padded vocabulary a restart keeps, the one resume sequence (the job's
Checkpointer, ``frontdoor/resume.py``) with the lines it says, and the save (tenplex's through the Checkpointer,
else megatron-core's dist_checkpointing or Megatron-LM's legacy format, as Megatron-LM does without ``--tenplex``)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from tenplex_megatron.frontdoor import ckpt_flags, memory_flags, restart_sources
from tenplex_megatron.frontdoor.checkpointer import Checkpointer
from tenplex_megatron.frontdoor.engines import MegatronCoreEngine
from tenplex_megatron.frontdoor.resume import MissingCheckpointError, Resumed
from tenplex_megatron.integrations.hf.source import check_hf_dir
from tenplex_megatron.integrations.megatron_core.legacy import legacy_padded_vocab
from tenplex_megatron.integrations.megatron_core.native import saved_padded_vocab
from tenplex_megatron.plan.hf_map import ModelFacts
from tenplex_megatron.plan.layout import ParallelLayout, padded_vocab_size, restart_padded_vocab_size
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.formats import is_legacy_megatron_checkpoint
from tenplex_megatron.training import gpt, legacy_ckpt, mcore_dist_ckpt
from tenplex_megatron.training.console import print0 as _print0
from tenplex_megatron.training.console import print_tenplex
from tenplex_megatron.training.gpt import GPTSpec


def engine(job: Any, ckpt: Checkpointer) -> MegatronCoreEngine:
    """The job seen by its Checkpointer (``verify`` and ``trust_pickles`` as its configuration says)."""
    return MegatronCoreEngine(job, ckpt.config.verify, ckpt.config.trust_pickles)


def sources(ckpt: Checkpointer) -> restart_sources.Sources:
    """Where the job would restart from (the Checkpointer's query, the tier opened first); a directory whose every
    copy is damaged, or a tenplex checkpoint without ``--tenplex``, stops the job naming it."""
    try:
        return ckpt.sources()
    except CheckpointFileError as e:  # every copy under --load damaged: never a fresh start over them
        raise SystemExit(f"pretrain_gpt.py: error: --load {e}") from None
    except restart_sources.TenplexCheckpointWithoutFlag as e:
        raise SystemExit(f"pretrain_gpt.py: error: {e}") from None


def padded_vocab(args: argparse.Namespace, spec: GPTSpec, layout: ParallelLayout,
                 found: restart_sources.Sources) -> int:
    """The padded vocabulary: the restart source's (``--tenplex-vocab-padding keep``) where this TP allows it, else
    Megatron's rule. A legacy Megatron-LM checkpoint without ``--tenplex`` is refused here, before anything is built."""
    from_memory, ckpt, mck = found.memory, found.tenplex, found.megatron
    saved_meta = from_memory.metadata if from_memory else found.tenplex_meta if ckpt else None
    saved_padded = saved_meta.padded_vocab_size if saved_meta is not None else None
    legacy = mck is not None and is_legacy_megatron_checkpoint(mck)
    if legacy and not args.tenplex:
        raise SystemExit(f"pretrain_gpt.py: error: {mck} is a legacy --ckpt-format torch checkpoint: load it with "
                         "--tenplex")
    if mck is not None and args.tenplex:
        saved_padded = (legacy_padded_vocab if legacy else saved_padded_vocab)(mck, trust_pickles=args.tenplex_trust_pickles)
    if args.tenplex_vocab_padding == "keep":
        return restart_padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by, layout.tp, saved_padded)
    return padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by, layout.tp)


def check_hf_start(args: argparse.Namespace, spec: GPTSpec, found: restart_sources.Sources) -> None:
    """``--tenplex-init-from-hf``'s directory, when there is no checkpoint to restart from, checked against the
    model flags before anything is built."""
    if found.tenplex is not None or found.megatron is not None or found.memory is not None:
        return
    if args.tenplex_init_from_hf:
        try:
            check_hf_dir(args.tenplex_init_from_hf, ModelFacts.from_model_json(spec.to_json()))
        except (ValueError, CheckpointFileError) as e:
            raise SystemExit(f"pretrain_gpt.py: error: --tenplex-init-from-hf {e}") from None


def restore(args: argparse.Namespace, job: gpt.GPTJob, ckpt: Checkpointer) -> Resumed:
    """Collective: the job's state through the one resume sequence (``frontdoor/resume.py``); Megatron's own
    checkpoint without ``--tenplex`` through megatron-core's dist_checkpointing. Says what it loaded."""
    try:
        got = ckpt.resume(engine(job, ckpt))
    except MissingCheckpointError as e:
        raise SystemExit(f"pretrain_gpt.py: error: {e}") from None
    layout = job.layout
    if got.kind == "native":
        t0 = time.perf_counter()
        mcore_dist_ckpt.load(job, got.native)
        job.consumed_samples = job.iteration * job.global_batch_size
        _print0(f"> megatron-core dist_checkpointing: loaded iteration {job.iteration} from {got.native} at layout "
                f"{layout} in {time.perf_counter() - t0:.2f} s")
    elif got.kind == "hf":
        hf = got.hf
        _print0(f"> tenplex: initialised from Hugging Face checkpoint {args.tenplex_init_from_hf} at layout {layout}: "
                f"{hf.tensors} tensors, {hf.stats.bytes_read / 1e6:.2f} MB read on rank 0 in {hf.stats.seconds:.2f} s")
    elif got.kind == "scratch" and args.load:
        _print0(f"> no checkpoint under {args.load}; starting from scratch")
    elif got.result is not None:
        _note_loaded(args, got.result.seconds)
        print_tenplex(loaded_line(got, layout))
    return got


def loaded_line(got: Resumed, layout: ParallelLayout) -> str:
    """The line said for a load of the job's own or Megatron's state (without the ``> tenplex:`` prefix)."""
    res = got.result
    assert res is not None
    if got.kind == "memory":
        assert got.memory is not None
        return memory_flags.describe_memory_load(got.memory, layout) + _rng_note(res)
    if got.kind == "scoped":
        return (restart_sources.loaded_line(res, layout) + ckpt_flags.describe_scope(got.scope)
                + (_rng_note(res) if got.scope.rng else ""))
    return (restart_sources.loaded_line(res, layout) + _rng_note(res)
            + (" (adopted Megatron's checkpoint: later saves are tenplex checkpoints)"
               if res.source_format == "megatron" else ""))


def _rng_note(res: Any) -> str:
    """How a load treated the RNG states, for its line."""
    return f" (rng {'restored exactly' if res.rng_exact else 're-seeded: layout changed'})"


def _note_loaded(args: argparse.Namespace, seconds: float) -> None:
    """Record when the load finished and how long it took in the restart's timeline (when one is kept)."""
    if getattr(args, "tenplex_timeline", None) is not None:
        args.tenplex_timeline.update(loaded=time.time(), load_seconds=seconds)


def save(job: Any, args: argparse.Namespace, ckpt: Checkpointer) -> None:
    """Collective: the job's state saved and said: through the Checkpointer with ``--tenplex`` (a host-memory
    snapshot, else a durable save), else in Megatron-LM's own formats."""
    gpt.sync_params(job)
    if not args.tenplex:
        _save_megatron(job, args)
        return
    res = ckpt.save(engine(job, ckpt))
    if ckpt.tier is not None:
        for line in memory_flags.describe_snapshot(res, job.iteration):
            print_tenplex(line)
        return
    _print0(f"> tenplex: saved iteration {job.iteration} to {res.path} in {res.seconds:.2f} s")
    for path in res.removed:
        _print0(f"> tenplex: removed {path}")


def _save_megatron(job: Any, args: argparse.Namespace) -> None:
    """Without ``--tenplex``: Megatron-LM's legacy format (``--ckpt-format torch``), else megatron-core's
    dist_checkpointing."""
    t0 = time.perf_counter()
    if args.ckpt_format == "torch":
        path = legacy_ckpt.save_checkpoint(job, args.save)
        _print0(f"> Megatron-LM legacy checkpoint (--ckpt-format torch): saved iteration {job.iteration} to {path} "
                f"in {time.perf_counter() - t0:.2f} s")
        return
    sharding = "fully_reshardable" if args.dist_ckpt_optim_fully_reshardable else "dp_reshardable"
    path = mcore_dist_ckpt.save_checkpoint(job, args.save, sharding_type=sharding)
    _print0(f"> megatron-core dist_checkpointing: saved iteration {job.iteration} to {path} "
            f"in {time.perf_counter() - t0:.2f} s")
