"""The re-sharding benchmark's megatron-core GPT job (worker side): build it, wipe it, and check it after a load.

The check: the model and optimizer are zeroed before the last load; afterwards one more training step and one
forward pass must reproduce the losses the job at the source layout got (only the reduction order differs).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from tenplex_megatron.integrations.megatron_core.optimizer import sub_optimizers
from tenplex_megatron.integrations.megatron_core.sharded import unwrap
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.training import gpt
from tenplex_megatron.training.synthetic_data import microbatches


def build(spec_json: str, layout: list[int], gbs: int, padded: int, ep: int = 1) -> gpt.GPTJob:
    """Initialise torch.distributed and build the job at ``layout`` (tp, pp, dp) and expert-parallel size ``ep``,
    distributed optimizer, mbs 1."""
    gpt.init_distributed()
    return gpt.build_job(gpt.GPTSpec.from_json(json.loads(spec_json)), ParallelLayout(*layout, ep=ep),
                         use_distributed_optimizer=True, micro_batch_size=1, global_batch_size=gbs,
                         padded_vocab=padded)


def data(job: gpt.GPTJob, start: int) -> Iterator[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of the synthetic global batch at global sample ``start``."""
    return microbatches(start, job.global_batch_size, job.micro_batch_size, job.layout.dp,
                        parallel_state.get_data_parallel_rank(), job.spec.seq_length, job.spec.vocab_size,
                        job.spec.seed)


def zero_state(job: gpt.GPTJob) -> None:
    """Wipe weights, optimizer state and position so that the check after a load sees only what it loaded."""
    with torch.no_grad():
        for p in unwrap(job.model[0]).parameters():
            p.zero_()
        for opt in sub_optimizers(job.optimizer):
            for group in opt.optimizer.param_groups:
                group["lr"] = 0.0
            for st in opt.optimizer.state.values():
                for t in st.values():
                    if torch.is_tensor(t):
                        t.zero_()
    job.scheduler.num_steps = 0
    job.iteration = job.consumed_samples = 0


def eval_loss(job: gpt.GPTJob, start: int) -> float:
    """Forward-only global-batch mean LM loss on the synthetic batch at global sample ``start``."""
    with torch.no_grad():
        losses = get_forward_backward_func()(
            forward_step_func=gpt.make_forward_step(), data_iterator=data(job, start), model=job.model,
            num_microbatches=job.num_microbatches, seq_length=job.spec.seq_length,
            micro_batch_size=job.micro_batch_size, forward_only=True,
        )
    return gpt.mean_lm_loss(losses)


def step2_losses(job: gpt.GPTJob) -> dict[str, float]:
    """The loss of training step 2, then of a forward pass after it (the step uses the Adam moments)."""
    g = job.global_batch_size
    return {"loss_step2": gpt.train_step(job, data(job, g)), "loss_after_step2": eval_loss(job, 2 * g)}


def check(job: gpt.GPTJob) -> dict[str, Any]:
    """Position after the load, then :func:`step2_losses`."""
    return {"iteration": job.iteration, "consumed_samples": job.consumed_samples, **step2_losses(job)}
