"""Your own megatron-core training loop with tenplex checkpoints: resume at any TP/DP from the same directory.

    torchrun --nproc_per_node 2 examples/own_loop.py --tp 2 --iters 6 --save-interval 3 --dir ckpt
    torchrun --nproc_per_node 2 examples/own_loop.py --tp 1 --iters 6 --dir ckpt   # resumes at DP=2

Everything below is plain megatron-core (GPTModel, DDP, DistributedOptimizer,
scheduler, forward_backward_func); tenplex adds two calls:
``tenplex_megatron.save_checkpoint`` and ``tenplex_megatron.load_checkpoint``.
The data is a function of the global sample index, so each global batch holds
the same samples at any DP size.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

import tenplex_megatron
from tenplex_megatron.training import cpu_shim  # test support for CPU-only machines

VOCAB, SEQ, GLOBAL_BATCH = 128, 16, 4


def build(tp: int):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, tensor_model_parallel_size=tp,
                               use_cpu_initialization=True, pipeline_dtype=torch.float32)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    if torch.cuda.is_available():
        model.cuda()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4,
                                                       use_distributed_optimizer=True),
                                       [ddp])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=8,
                                        lr_decay_steps=64, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=64, wd_incr_style="constant")
    return ddp, optimizer, scheduler


def batch(first_sample: int, n: int) -> dict[str, torch.Tensor]:
    """Samples ``first_sample .. first_sample + n - 1``: each a pure function of its global index."""
    toks = torch.stack([torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(i))
                        for i in range(first_sample, first_sample + n)])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return {"tokens": toks[:, :-1].to(dev), "labels": toks[:, 1:].to(dev),
            "position_ids": torch.arange(SEQ, device=dev).expand(n, SEQ)}


def step(ddp, optimizer, scheduler, consumed: int) -> float:
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    share = GLOBAL_BATCH // dp
    data = batch(consumed + dp_rank * share, share)

    def forward(_it, model):
        out = model(data["tokens"], data["position_ids"], None, labels=data["labels"])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(forward_step_func=forward, data_iterator=iter([None]), model=[ddp],
                                         num_microbatches=1, seq_length=SEQ, micro_batch_size=share)
    optimizer.step()
    scheduler.step(increment=GLOBAL_BATCH)
    loss = losses[0]["loss"].clone().double()
    torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return float(loss) / dp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--save-interval", type=int, default=0)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--metrics", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():  # CPU-only machines (CI, this example's test): redirect megatron-core's CUDA
        cpu_shim.install()
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    ddp, optimizer, scheduler = build(a.tp)
    iteration = consumed = 0
    if os.path.exists(os.path.join(a.dir, "latest_checkpointed_iteration.txt")):
        res = tenplex_megatron.load_checkpoint(a.dir, ddp, optimizer, scheduler)  # re-sharded to this TP/DP
        iteration, consumed = res.iteration, res.consumed_samples
        if torch.distributed.get_rank() == 0:  # res.extra: what the save was given as ``extra``; res.layout: its layout
            print(f"resumed at iteration {iteration} from {res.layout} (loss then: {res.extra.get('loss')})", flush=True)
    while iteration < a.iters:
        loss = step(ddp, optimizer, scheduler, consumed)
        iteration, consumed = iteration + 1, consumed + GLOBAL_BATCH
        if a.metrics and torch.distributed.get_rank() == 0:
            with open(a.metrics, "a") as f:
                f.write(json.dumps({"iteration": iteration, "loss": loss}) + "\n")
        if a.save_interval and iteration % a.save_interval == 0:
            tenplex_megatron.save_checkpoint(a.dir, ddp, optimizer, scheduler, iteration=iteration,
                                             consumed_samples=consumed, extra={"loss": loss})
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
