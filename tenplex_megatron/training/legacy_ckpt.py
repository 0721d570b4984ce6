"""Megatron-LM's legacy ``--ckpt-format torch`` checkpoint, written from megatron-core's own objects.

megatron-core 0.16.1 has no legacy save (Megatron-LM's ``training/checkpointing.py``
writes it); this writes the same structure, so the reference trainer's runs
can be continued the way older Megatron-LM runs are: per (TP, PP) rank
``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` (written by DP rank 0:
``args``, ``checkpoint_version`` 3.0, ``iteration``, the model's
``state_dict_for_save_checkpoint()``, ``optimizer.state_dict()``,
``opt_param_scheduler``, ``rng_state``) and, with the distributed optimizer,
``distrib_optim.pt`` from megatron-core's own ``save_parameter_state``
(``get_parameter_state_dp_zero``: each grad buffer's unpadded flat state
gathered on DP rank 0), then ``latest_checkpointed_iteration.txt``. tenplex
reads it with ``--tenplex`` (``integrations/megatron_core/legacy.py``).
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from tenplex_megatron.integrations.megatron_core.optimizer import sub_optimizers
from tenplex_megatron.integrations.megatron_core.sharded import unwrap
from tenplex_megatron.storage.directory import TRACKER_FILE, iter_dir_name
from tenplex_megatron.training.gpt import GPTJob

CHECKPOINT_VERSION = 3.0


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """Megatron-LM's per model-parallel-rank directory: ``mp_rank_TT`` (PP = 1) or ``mp_rank_TT_PPP``."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def save_checkpoint(job: GPTJob, save_dir: str) -> str:
    """Collective: write ``job`` as Megatron-LM's legacy checkpoint under ``save_dir``; returns the iteration dir."""
    path = os.path.join(save_dir, iter_dir_name(job.iteration))
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    rank_dir = os.path.join(path, rank_dir_name(tp_rank, pp_rank, job.layout.pp))
    os.makedirs(rank_dir, exist_ok=True)
    if job.use_distributed_optimizer:
        (opt,) = sub_optimizers(job.optimizer)
        opt.save_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))  # collective over DP
    if dp_rank == 0:
        args = argparse.Namespace(
            tensor_model_parallel_size=job.layout.tp, pipeline_model_parallel_size=job.layout.pp,
            data_parallel_size=job.layout.dp, use_distributed_optimizer=job.use_distributed_optimizer,
            consumed_train_samples=job.consumed_samples, iteration=job.iteration, ckpt_format="torch",
            padded_vocab_size=job.padded_vocab_size, seed=job.spec.seed)
        rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
               "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": get_cuda_rng_tracker().get_states()}
        state = {
            "args": args,
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": job.iteration,
            "model": unwrap(job.model[0]).state_dict_for_save_checkpoint(),
            "optimizer": job.optimizer.state_dict(),
            "opt_param_scheduler": job.scheduler.state_dict(),
            "rng_state": [rng],
        }
        torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        tracker = os.path.join(save_dir, TRACKER_FILE)
        with open(tracker + ".tmp", "w") as f:
            f.write(str(job.iteration))
        os.replace(tracker + ".tmp", tracker)
    torch.distributed.barrier()
    return path
