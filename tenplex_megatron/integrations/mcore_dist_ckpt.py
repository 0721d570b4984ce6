"""megatron-core's own dist_checkpointing for a GPTJob, the way Megatron-LM calls it: the peer we measure against.

Save: the model's and the optimizer's sharded state dicts with the
``fully_reshardable`` distributed-optimizer format (the only one that can be
re-sharded along TP/PP; it gathers the optimizer buffers across DP at save),
``torch_dist`` strategy wrapped in ``FullyParallelSaveStrategyWrapper``. Load at
a new layout: read the content metadata, rebuild the sharded state dict with
``is_loading=True``, ``dist_checkpointing.load`` with the fully parallel load
wrapper, then ``load_state_dict`` on model and optimizer. Scripts that save must
have an ``if __name__ == "__main__":`` guard (megatron starts a spawn manager).
"""

from __future__ import annotations

import os
from typing import Any

from tenplex_megatron.integrations.describe import unwrap
from tenplex_megatron.integrations.optimizer_state import allocate_state

SHARDING_TYPE = "fully_reshardable"


def _metadata() -> dict[str, Any]:
    return {"distrib_optim_sharding_type": SHARDING_TYPE, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}


def save(job: Any, ckpt_dir: str) -> None:
    """Collective: megatron-core dist_checkpointing save of model and optimizer into ``ckpt_dir``."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    md = _metadata()
    model_sd = unwrap(job.model[0]).sharded_state_dict(metadata=md)
    state = {
        "model": model_sd,
        "optimizer": job.optimizer.sharded_state_dict(model_sd, metadata=md),
        "iteration": job.iteration,
        "scheduler": job.scheduler.state_dict(),
    }
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"), parallel_state.get_data_parallel_group(with_context_parallel=True)
    )
    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save(state, ckpt_dir, strategy, content_metadata=md)


def _tolerate_missing_step() -> None:
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


def _unshare_steps(optimizer: Any) -> None:
    """Work around megatron-core 0.16.1 on the CPU: DistributedOptimizer.load_state_dict gives every torch
    AdamW state the same ``step`` tensor, which torch then increments once per parameter each step (wrong
    bias correction from the first step after a load). Give each state its own copy."""
    from tenplex_megatron.integrations.describe import sub_optimizers

    for opt in sub_optimizers(optimizer):
        for st in opt.optimizer.state.values():
            if "step" in st:
                st["step"] = st["step"].clone()


def load(job: Any, ckpt_dir: str) -> None:
    """Collective: load a dist_checkpointing checkpoint into ``job`` (any layout), model and optimizer."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    md = dist_checkpointing.load_content_metadata(ckpt_dir) or _metadata()
    # torch's AdamW (no apex/TE on the CPU) keeps the step per state, and megatron's
    # DistributedOptimizer.state_dict() asserts one: allocate the state first, as a GPU run's
    # FusedAdam would not need. This only allocates; the load overwrites every value.
    allocate_state(job.optimizer)
    _tolerate_missing_step()
    model = unwrap(job.model[0])
    model_sd = model.sharded_state_dict(metadata=md)
    state = {
        "model": model_sd,
        "optimizer": job.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=md),
        "iteration": job.iteration,
        "scheduler": job.scheduler.state_dict(),
    }
    strategy = FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(ckpt_dir), parallel_state.get_data_parallel_group(with_context_parallel=True)
    )
    loaded = dist_checkpointing.load(state, ckpt_dir, strategy)
    model.load_state_dict(loaded["model"])
    job.optimizer.load_state_dict(loaded["optimizer"])
    _unshare_steps(job.optimizer)
    job.scheduler.load_state_dict(loaded["scheduler"])
    job.iteration = int(loaded["iteration"])
