"""Export a tenplex checkpoint as Megatron-LM's own ``torch_dist`` checkpoint at a chosen layout: the way back.

Collective, in a world of exactly the target layout's size (``tenplex-megatron export-megatron`` starts it under
torchrun over gloo on CPUs; a test may call :func:`export` in its own process group). Each rank builds the model at
the target layout with the reference trainer's builder (``training/gpt.py``, from the checkpoint's model record),
loads its part of the tenplex checkpoint through tenplex's own load path (re-sharded, checksums verified), then
calls megatron-core's ``dist_checkpointing.save`` with the state dict Megatron-LM's ``save_checkpoint`` writes
(``generate_state_dict``: ``model`` or ``model0``.., ``optimizer``, ``opt_param_scheduler``, ``iteration``,
``checkpoint_version``, ``args``, ``num_floating_point_operations_so_far``) and the content metadata of its
``_build_sharded_state_dict_metadata``; rank 0 writes ``latest_checkpointed_iteration.txt`` last. Each process holds
one rank's model and optimizer state, as a training rank does: nothing is gathered.

The RNG streams are not written: the saved args say ``no_save_rng``, so Megatron-LM keeps the streams its
``--seed`` gives (as it does itself at a TP or PP change). The distributed optimizer's state is written
``fully_reshardable`` (model space: independent of the DDP buckets the loading job cuts) or ``dp_reshardable``
(Megatron-LM's default format, stored as the exporting job's own buckets).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch

from tenplex_megatron import __version__
from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.execute.collective import RankFailure, check_all
from tenplex_megatron.frontdoor.checkpointer import Checkpointer
from tenplex_megatron.frontdoor.engines import MegatronCoreEngine
from tenplex_megatron.integrations.megatron_core.sharded import model_keys, unwrap
from tenplex_megatron.plan.layout import ParallelLayout, padded_vocab_size
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.directory import iter_dir_name, read_checkpoint_metadata
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.training import gpt, mcore_dist_ckpt

#: the distributed optimizer's formats an export writes (megatron-core's names; the first is the default)
OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")
#: Megatron-LM's ``checkpoint_version`` of the torch_dist checkpoints it writes (``generate_state_dict``)
CHECKPOINT_VERSION = 3.0


class ExportError(TenplexError, ValueError):
    """A checkpoint or layout an export cannot write: the message names the file, flag or constraint."""


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What an export wrote: the iteration directory, its iteration and layout, and the seconds it took."""

    path: str
    iteration: int
    layout: ParallelLayout
    optimizer_format: str | None  # None: the plain optimizer
    seconds: float


def megatron_metadata(distributed_optimizer: bool, optimizer_format: str) -> dict[str, Any]:
    """The content metadata Megatron-LM writes and reads back (``_build_sharded_state_dict_metadata``), this job's
    DP group added for the sharded state dicts (stripped before it goes on disk)."""
    md: dict[str, Any] = {}
    if distributed_optimizer:
        md["distrib_optim_sharding_type"] = optimizer_format
        if optimizer_format == "fully_reshardable":
            md["distrib_optim_fully_reshardable_mem_efficient"] = False
    md.update(singleton_local_shards=False, chained_optim_avoid_prefix=True)
    md["dp_cp_group"] = mcore_dist_ckpt.dp_group()
    return md


def megatron_args(job: gpt.GPTJob, record: Mapping[str, Any], source: str, optimizer_format: str) -> argparse.Namespace:
    """Megatron-LM's saved ``args``: the model record's flags (Megatron-LM's names), the exported layout, the data
    position, and what the checkpoint holds (``no_save_rng``: no RNG streams; the optimizer state is there)."""
    lay = job.layout
    args = dict(record)
    args.update(
        tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp, data_parallel_size=lay.dp,
        world_size=lay.world_size, context_parallel_size=1,
        virtual_pipeline_model_parallel_size=lay.vpp if lay.vpp > 1 else None, sequence_parallel=lay.sp,
        expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=lay.expert_tp,
        use_distributed_optimizer=job.use_distributed_optimizer, ckpt_format="torch_dist",
        dist_ckpt_optim_fully_reshardable=job.use_distributed_optimizer and optimizer_format == "fully_reshardable",
        padded_vocab_size=job.padded_vocab_size, iteration=job.iteration,
        consumed_train_samples=job.consumed_samples, skipped_train_samples=0, consumed_valid_samples=0,
        add_position_embedding=record.get("position_embedding_type", "learned_absolute") == "learned_absolute",
        no_save_optim=False, no_save_rng=True,
        tenplex_exported_from=source, tenplex_exported_by=f"tenplex-megatron {__version__}")
    return argparse.Namespace(**args)


def megatron_state_dict(job: gpt.GPTJob, md: dict[str, Any], args: argparse.Namespace, flops: float) -> dict[str, Any]:
    """What Megatron-LM's ``generate_state_dict`` returns for a torch_dist save, for ``job``."""
    models = {key: unwrap(m).sharded_state_dict(metadata=md) for key, m in zip(model_keys(len(job.model)), job.model)}
    return {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": job.iteration,
        **models,
        "optimizer": job.optimizer.sharded_state_dict(models, is_loading=False, metadata=md),
        "opt_param_scheduler": job.scheduler.state_dict(),
        "num_floating_point_operations_so_far": flops,
    }


def model_record(meta: CheckpointMetadata) -> Mapping[str, Any]:
    """The checkpoint's model record; a checkpoint of another framework, or without one, is refused."""
    if meta.framework not in (None, "megatron-core") or meta.model is None:
        raise ExportError(f"{meta.path}: not a megatron-core checkpoint with a model record (framework "
                          f"{meta.framework!r}): export-megatron reads megatron-core checkpoints")
    return meta.model


def build_target(meta: CheckpointMetadata, layout: ParallelLayout) -> gpt.GPTJob:
    """Collective: the job the checkpoint's model record describes, built at ``layout`` with Megatron's vocabulary
    padding at that TP (what a stock Megatron-LM run pads to); one micro-batch per DP rank (no batch is run)."""
    spec = gpt.GPTSpec.from_json(dict(model_record(meta)))
    padded = padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by, layout.tp)
    return gpt.build_job(spec, layout, use_distributed_optimizer=bool(meta.use_distributed_optimizer),
                         micro_batch_size=1, global_batch_size=layout.dp, padded_vocab=padded)


def export(ckpt: str, out: str, layout: ParallelLayout, *, optimizer_format: str = OPTIMIZER_FORMATS[0],
           verify: bool = True) -> ExportResult:
    """Collective: write the tenplex checkpoint ``ckpt`` (an iteration directory, or a save directory: its newest)
    to ``out/iter_NNNNNNN`` as Megatron-LM's torch_dist checkpoint at ``layout``, then ``out``'s tracker file."""
    t0 = time.perf_counter()
    world = torch.distributed.get_world_size()
    if world != layout.world_size:
        raise ExportError(f"export to {layout} needs {layout.world_size} processes, not {world}")
    if optimizer_format not in OPTIMIZER_FORMATS:
        raise ExportError(f"optimizer format {optimizer_format!r}: expected one of {', '.join(OPTIMIZER_FORMATS)}")
    job, meta, res = _load(ckpt, layout, verify)
    path = res.path
    flops = float(res.extra.get("num_floating_point_operations_so_far", 0.0))
    md = megatron_metadata(job.use_distributed_optimizer, optimizer_format)
    state = megatron_state_dict(job, md, megatron_args(job, model_record(meta), path, optimizer_format), flops)
    if job.use_distributed_optimizer and optimizer_format == "fully_reshardable":
        error: BaseException | None = None
        try:
            mcore_dist_ckpt.check_main_params(state)
        except RuntimeError as e:
            error = ExportError(f"{e} (export at PP 1, or a model with untied embeddings, or with "
                                "--optimizer-format dp_reshardable)")
        check_all(error, f"export to {out}")
    target = os.path.join(out, iter_dir_name(job.iteration))
    mcore_dist_ckpt.save_state(state, target, md)
    mcore_dist_ckpt.write_tracker(out, job.iteration)
    return ExportResult(target, job.iteration, layout, optimizer_format if job.use_distributed_optimizer else None,
                        time.perf_counter() - t0)


def _load(ckpt: str, layout: ParallelLayout, verify: bool) -> tuple[gpt.GPTJob, CheckpointMetadata, LoadResult]:
    """Collective: the job at ``layout`` for the model ``ckpt`` holds, loaded through a Checkpointer's resume
    sequence (the newest complete copy; a damaged one falls back to the previous, naming it)."""
    checkpointer = Checkpointer.for_api("tenplex-megatron export-megatron")
    try:
        try:
            found = checkpointer.sources(ckpt, memory=False).tenplex
        except CheckpointFileError as e:  # every copy damaged
            raise ExportError(f"{ckpt}: {e}") from None
        if found is None:
            raise ExportError(f"{ckpt}: no complete tenplex checkpoint here")
        meta = read_checkpoint_metadata(found)
        job = build_target(meta, layout)
        res = checkpointer.resume(MegatronCoreEngine(job, verify), ckpt, own=False).result
    finally:
        checkpointer.close()
    assert res is not None  # the query found a tenplex copy: the sequence loads it or raises
    return job, meta, res


def main(argv: list[str] | None = None) -> int:
    """The worker ``export-megatron`` starts on every rank: ``CKPT OUT LAYOUT OPTIMIZER_FORMAT``."""
    ckpt, out, to, optimizer_format = sys.argv[1:] if argv is None else argv
    gpt.init_distributed("gloo")
    try:
        res = export(ckpt, out, ParallelLayout.parse(to), optimizer_format=optimizer_format)
    except (ExportError, RankFailure, OSError) as e:  # the same error on every rank: said once, no traceback
        if torch.distributed.get_rank() == 0:
            print(f"export-megatron: error: {e}", file=sys.stderr, flush=True)
        return 2
    if torch.distributed.get_rank() == 0:
        fmt = f"distributed optimizer {res.optimizer_format}" if res.optimizer_format else "plain optimizer"
        print(f"export-megatron: iteration {res.iteration} written to {res.path} as Megatron torch_dist at "
              f"{res.layout} ({fmt}) in {res.seconds:.2f} s", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":  # megatron's save starts a spawn-method multiprocessing manager: the guard is needed
    sys.exit(main())
