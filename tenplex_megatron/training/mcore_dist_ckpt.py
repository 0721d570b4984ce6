"""megatron-core's own dist_checkpointing for a GPTJob, the way Megatron-LM calls it: the peer we measure against.

Save: the model's and the optimizer's sharded state dicts with the
``fully_reshardable`` distributed-optimizer format (the only one megatron-core can
re-shard along TP/PP; it gathers the optimizer buffers across DP at save) or, as
Megatron-LM does by default, ``dp_reshardable`` (each DP rank's bucket shards as
they are: megatron-core re-shards them only along DP; tenplex reads them at any
layout, ``integrations/megatron_core/foreign.py``),
``torch_dist`` strategy wrapped in ``FullyParallelSaveStrategyWrapper``; iteration,
consumed samples and the LR scheduler go in as plain values. Load at a new
layout: read the content metadata, rebuild the sharded state dict with
``is_loading=True``, ``dist_checkpointing.load`` with the fully parallel load
wrapper, then ``load_state_dict`` on model and optimizer. :func:`save_checkpoint`
and :func:`load_checkpoint` add Megatron-LM's directory layout
(``<save>/iter_NNNNNNN/`` and ``latest_checkpointed_iteration.txt``).
Scripts that save must have an ``if __name__ == "__main__":`` guard (megatron
starts a spawn-method multiprocessing manager) and need psutil.

megatron-core 0.16.1 writes a wrong ``fully_reshardable`` optimizer state for
parameters after a grad buffer's first bucket (NVIDIA/Megatron-LM#5077): with
the distributed optimizer and tied embeddings at PP>1 that is the word
embedding. :func:`save` checks for it and refuses to write (``check=False``
writes anyway: the benchmark measures megatron-core as it is).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from tenplex_megatron import mcore_versions
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.execute.collective import check_all
from tenplex_megatron.integrations.megatron_core.optimizer import allocate_state, sub_optimizers
from tenplex_megatron.integrations.megatron_core.sharded import model_keys, unwrap
from tenplex_megatron.storage.directory import TRACKER_FILE, find_megatron_checkpoint, iter_dir_name
from tenplex_megatron.storage.files import CheckpointNotFoundError
from tenplex_megatron.training.gpt import GPTJob

SHARDING_TYPE = "fully_reshardable"
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable")


class DistCheckpointError(TenplexError, RuntimeError):
    """A megatron-core dist_checkpointing checkpoint whose optimizer state does not match its model."""


def dp_group() -> Any:
    """The data-parallel (with context-parallel) group: the fully parallel wrappers' and megatron's ``dp_cp_group``."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def sharded_sd_metadata(saved: dict[str, Any] | None = None, sharding_type: str = SHARDING_TYPE) -> dict[str, Any]:
    """Megatron-LM's sharded-state-dict metadata (the checkpoint's own, when loading) plus this job's DP group."""
    md: dict[str, Any] = {"distrib_optim_sharding_type": sharding_type, "singleton_local_shards": False,
                          "chained_optim_avoid_prefix": True}
    md.update(saved or {})
    md["dp_cp_group"] = dp_group()
    return md


def content_metadata(md: dict[str, Any]) -> dict[str, Any]:
    """What goes on disk: the metadata without the process group. megatron-core strips ``dp_cp_group`` itself
    only when it validates access integrity (``_clean_metadata_for_serialization`` in ``save_preprocess``);
    Megatron-LM strips it before calling ``save``, and so do we."""
    return {k: v for k, v in md.items() if k != "dp_cp_group"}


def saved_args(job: GPTJob) -> argparse.Namespace:
    """What Megatron-LM saves as ``args`` in the common state, as far as a re-shard of it needs: the saving layout
    and the DDP settings that cut the distributed optimizer's buffers into buckets; a mixture of experts' EP, expert
    TP and router kind."""
    return argparse.Namespace(
        tensor_model_parallel_size=job.layout.tp, pipeline_model_parallel_size=job.layout.pp,
        data_parallel_size=job.layout.dp, virtual_pipeline_model_parallel_size=job.layout.vpp if job.layout.vpp > 1
        else None, sequence_parallel=job.layout.sp, use_distributed_optimizer=job.use_distributed_optimizer,
        overlap_grad_reduce=job.ddp.overlap_grad_reduce, overlap_param_gather=job.ddp.overlap_param_gather,
        ddp_bucket_size=job.ddp.bucket_size, ddp_num_buckets=None, ddp_pad_buckets_for_high_nccl_busbw=False,
        consumed_train_samples=job.consumed_samples, padded_vocab_size=job.padded_vocab_size, seed=job.spec.seed,
        ckpt_format="torch_dist", expert_model_parallel_size=job.layout.ep,
        expert_tensor_parallel_size=job.layout.expert_tp, num_experts=job.spec.num_experts,
        moe_router_enable_expert_bias=job.spec.moe_router_enable_expert_bias,
        moe_router_score_function=job.spec.moe_router_score_function)


def _step_outside_dp_reshardable() -> None:
    """Work around megatron-core before 0.16 on the CPU: its dp_reshardable state dict asserts that every
    per-parameter optimizer state is a flat piece of the grad buffer, and torch's AdamW (no apex/TE) keeps a 0-dim
    ``step`` per parameter (AssertionError: (torch.Size([]), 0, 64)). 0.16 leaves ``step`` out of the buckets
    (restored from the param groups); do the same there. Not needed with apex/TE optimizers (GPU)."""
    from megatron.core.optimizer import distrib_optimizer as do

    found = mcore_versions.installed()
    if (getattr(do.DistributedOptimizer, "_tenplex_dp_step_patch", False) or do.HAVE_APEX_OR_TE
            or found is None or found.release[:2] >= (0, 16)):
        return
    sharded = do.DistributedOptimizer.sharded_param_state_dp_reshardable
    states = do.DistributedOptimizer._get_main_param_and_optimizer_states

    def without_step(self: Any, model_param: Any) -> dict[str, Any]:
        return {k: v for k, v in states(self, model_param).items() if k != "step"}

    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._get_main_param_and_optimizer_states = without_step.__get__(self)
        try:
            return sharded(self, *args, **kwargs)
        finally:
            del self._get_main_param_and_optimizer_states

    do.DistributedOptimizer.sharded_param_state_dp_reshardable = patched
    do.DistributedOptimizer._tenplex_dp_step_patch = True


def _state_dict(job: GPTJob, md: dict[str, Any], is_loading: bool) -> dict[str, Any]:
    _step_outside_dp_reshardable()
    models = {key: unwrap(m).sharded_state_dict(metadata=md) for key, m in zip(model_keys(len(job.model)), job.model)}
    return {
        **models,
        "optimizer": job.optimizer.sharded_state_dict(models, is_loading=is_loading, metadata=md),
        "iteration": job.iteration,
        "consumed_samples": job.consumed_samples,
        "scheduler": job.scheduler.state_dict(),
        "args": saved_args(job),
    }


def check_main_params(state: dict[str, Any]) -> None:
    """Raise if the optimizer's saved main weights are not the model's weights (they must be, up to dtype).

    megatron-core 0.16.1's ``fully_reshardable`` format reads every parameter after a grad buffer's first
    bucket from a shifted offset and zero-pads the overrun (its warning: "param range exceeds unpadded buffer
    ... can lead to data corruption"; fixed upstream in NVIDIA/Megatron-LM#5077). With the distributed
    optimizer and tied embeddings at PP>1 the word embedding has its own bucket on the first stage, so such a
    checkpoint loads a shifted word embedding (by one row, last row zero, in a 2-stage tiny GPT here). The fp32 main weights are the only state we can
    check against a reference; the Adam moments are sliced the same way."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def tensors(tree: Any) -> dict[tuple, torch.Tensor]:  # (key, global offset) -> data; factories built (views)
        out = {}
        for v in nested_values(tree):
            if isinstance(v, ShardedTensorFactory):
                built = v.build()
                parts = list(nested_values(built)) if isinstance(built, (dict, list)) else [built]
            else:
                parts = [v]
            for t in parts:
                if isinstance(t, ShardedTensor):
                    out[(t.key, tuple(t.global_offset))] = t.data
        return out

    prefix = "optimizer.state.param."
    weights = tensors(state["model"])
    bad = []
    for (key, offset), main in tensors(state["optimizer"]).items():
        w = weights.get((key[len(prefix):], offset)) if key.startswith(prefix) else None
        if w is not None and w.shape == main.shape and not torch.equal(main.to(w.dtype), w):
            bad.append(key[len(prefix):])
    bad = sorted(set(bad))
    if bad:
        raise DistCheckpointError(
            f"megatron-core's fully_reshardable optimizer state does not match the model for {len(bad)} "
            f"parameter(s) ({', '.join(bad[:4])}): megatron-core 0.16.1 reads parameters after a grad buffer's "
            "first bucket from the wrong offset (NVIDIA/Megatron-LM#5077); the checkpoint would be corrupt. "
            "Use tenplex (--tenplex) or a megatron-core release with that fix."
        )


def save(job: GPTJob, ckpt_dir: str, *, check: bool = True, sharding_type: str = SHARDING_TYPE) -> None:
    """Collective: megatron-core dist_checkpointing save of model, optimizer, scheduler and position into ``ckpt_dir``.

    ``check``: refuse to write when megatron-core's optimizer state is wrong (:func:`check_main_params`;
    only ``fully_reshardable`` has that defect). ``sharding_type``: the distributed optimizer's format.
    """
    md = sharded_sd_metadata(sharding_type=sharding_type)
    state = _state_dict(job, md, is_loading=False)
    if check and sharding_type == "fully_reshardable":
        error: BaseException | None = None
        try:
            check_main_params(state)
        except RuntimeError as e:
            error = e
        check_all(error, f"megatron-core save to {ckpt_dir}")
    save_state(state, ckpt_dir, md)


def save_state(state: dict[str, Any], ckpt_dir: str, md: dict[str, Any]) -> None:
    """Collective: megatron-core's ``dist_checkpointing.save`` of a sharded state dict into ``ckpt_dir``, as
    Megatron-LM calls it: the ``torch_dist`` strategy, fully parallel across DP, ``md`` as content metadata."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), dp_group())
    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save(state, ckpt_dir, strategy, content_metadata=content_metadata(md))


def save_async(job: GPTJob, ckpt_dir: str, queue: Any) -> None:
    """Collective: megatron-core's asynchronous save (``async_sharded_save``, as Megatron-LM's ``--async-save``):
    returns once the state is staged and the write is scheduled on ``queue`` (an ``AsyncCallsQueue``); the
    caller finalizes it (``queue.maybe_finalize_async_calls``). Used by the benchmark as the peer of tenplex's
    memory snapshots."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    md = sharded_sd_metadata()
    state = _state_dict(job, md, is_loading=False)
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), dp_group())
    os.makedirs(ckpt_dir, exist_ok=True)
    request = dist_checkpointing.save(state, ckpt_dir, strategy, async_sharded_save=True,
                                      content_metadata=content_metadata(md))
    queue.schedule_async_request(request)


def tolerate_missing_step() -> None:
    """Work around megatron-core 0.16.1 on the CPU: its fully_reshardable load copies every state key,
    'step' included, which torch's AdamW state has and the checkpoint does not (KeyError: 'step').
    The step itself is restored from the param groups. Not needed with apex/TE optimizers (GPU)."""
    from megatron.core.optimizer import distrib_optimizer as do

    if getattr(do.DistributedOptimizer, "_tenplex_step_patch", False) or do.HAVE_APEX_OR_TE:
        return
    original = do.DistributedOptimizer._set_main_param_and_optimizer_states

    def patched(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    do.DistributedOptimizer._set_main_param_and_optimizer_states = patched
    do.DistributedOptimizer._tenplex_step_patch = True


def unshare_steps(optimizer: Any) -> None:
    """Work around megatron-core 0.16.1 on the CPU: DistributedOptimizer.load_state_dict gives every torch
    AdamW state the same ``step`` tensor, which torch then increments once per parameter each step (wrong
    bias correction from the first step after a load). Give each state its own copy."""
    for opt in sub_optimizers(optimizer):
        for st in opt.optimizer.state.values():
            if "step" in st:
                st["step"] = st["step"].clone()


def load(job: GPTJob, ckpt_dir: str) -> None:
    """Collective: load a dist_checkpointing checkpoint (any source layout) into ``job``'s model, optimizer,
    scheduler, iteration and (when saved) consumed samples."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    # common.pt holds Megatron-LM's args Namespace (saved_args), which torch's weights-only unpickler refuses unless
    # it is registered: Megatron-LM registers it at start-up (megatron.core.safe_globals)
    torch.serialization.add_safe_globals([argparse.Namespace])
    md = sharded_sd_metadata(dist_checkpointing.load_content_metadata(ckpt_dir))
    # torch's AdamW (no apex/TE on the CPU) keeps the step per state, and megatron's
    # DistributedOptimizer.state_dict() asserts one: allocate the state first, as a GPU run's
    # FusedAdam would not need. This only allocates; the load overwrites every value.
    allocate_state(job.optimizer)
    tolerate_missing_step()
    state = _state_dict(job, md, is_loading=True)
    strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(ckpt_dir), dp_group())
    loaded = dist_checkpointing.load(state, ckpt_dir, strategy)
    for key, m in zip(model_keys(len(job.model)), job.model):
        unwrap(m).load_state_dict(loaded[key])
    job.optimizer.load_state_dict(loaded["optimizer"])
    unshare_steps(job.optimizer)
    # Megatron-LM's own checkpoints (and export-megatron's) name the scheduler's state ``opt_param_scheduler``
    job.scheduler.load_state_dict(loaded["scheduler"] if "scheduler" in loaded else loaded["opt_param_scheduler"])
    job.iteration = int(loaded["iteration"])
    if "consumed_samples" in loaded:  # absent from checkpoints written before it was saved
        job.consumed_samples = int(loaded["consumed_samples"])


def save_checkpoint(job: GPTJob, save_dir: str, *, check: bool = True, sharding_type: str = SHARDING_TYPE) -> str:
    """Collective: :func:`save` into ``save_dir/iter_NNNNNNN`` then (rank 0) update the tracker file, as
    Megatron-LM does; returns the iteration directory."""

    path = os.path.join(save_dir, iter_dir_name(job.iteration))
    save(job, path, check=check, sharding_type=sharding_type)
    write_tracker(save_dir, job.iteration)
    return path


def write_tracker(save_dir: str, iteration: int) -> None:
    """Collective: once every rank's shards are written, rank 0 names ``iteration`` in ``save_dir``'s tracker file
    (written aside, synced, renamed into place), as Megatron-LM does after a save."""
    torch.distributed.barrier()  # every rank's shards are written before the tracker names the iteration
    if torch.distributed.get_rank() == 0:
        tracker = os.path.join(save_dir, TRACKER_FILE)
        with open(tracker + ".tmp", "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker + ".tmp", tracker)
    torch.distributed.barrier()


def load_checkpoint(job: GPTJob, load_dir: str) -> str:
    """Collective: :func:`load` the checkpoint ``load_dir`` names (an ``iter_*`` directory, or a save directory:
    the tracker's iteration, else the newest); returns the directory loaded."""

    path = find_megatron_checkpoint(load_dir)
    if path is None:
        raise CheckpointNotFoundError(f"no megatron-core dist_checkpointing checkpoint under {load_dir}")
    load(job, path)
    return path
