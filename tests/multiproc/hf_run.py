"""Hugging Face scenarios in one torchrun launch (one process group): save-and-logits jobs, imports, refusals.

``hf_run.py TASKS.json``: a JSON list of tasks, each run on every rank in turn:

- ``{"kind": "logits", "flags": [...], "save": DIR, "out": FILE}``: build the
  job of ``pretrain_gpt.py FLAGS`` (random weights), save it through tenplex
  to DIR, and write megatron-core's logits (TP-gathered, whole padded
  vocabulary) on fixed tokens to FILE (safetensors: ``tokens``, ``logits``).
- ``{"kind": "pretrain", "flags": [...]}``: ``pretrain_gpt.py FLAGS`` as is
  (``--tenplex-init-from-hf`` runs).
- ``{"kind": "refused", "flags": [...], "out": FILE}``: a run expected to
  refuse; every rank's message is written to FILE.rank<N> (JSON).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from safetensors.torch import save_file

from tenplex_megatron.integrations.megatron_core.adapter import save_job
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.training import gpt, pretrain


def logits_task(task: dict[str, Any]) -> None:
    args = pretrain.parse_args(task["flags"])
    world = torch.distributed.get_world_size()
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    spec = pretrain.spec_from_args(args)
    layout = ParallelLayout(tp, pp, world // (tp * pp), ep=args.expert_model_parallel_size or 1,
                            etp=args.expert_tensor_parallel_size or 0)
    job = gpt.build_job(spec, layout,
                        use_distributed_optimizer=args.use_distributed_optimizer,
                        micro_batch_size=2, global_batch_size=2 * (world // (tp * pp)))
    save_job(job, task["save"])
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_length), generator=g)
    positions = torch.arange(spec.seq_length).unsqueeze(0).expand(2, -1).contiguous()
    got: list[torch.Tensor] = []

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        out = model(batch[0], batch[1], None)

        def keep(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            got.append(output.detach().clone())
            return output.sum() * 0.0, {}

        return out, keep

    for m in job.model:
        m.eval()
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([(tokens, positions)]),
                                    model=job.model, num_microbatches=1, seq_length=spec.seq_length,
                                    micro_batch_size=2, forward_only=True)
    if parallel_state.is_pipeline_last_stage():
        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(got[0]) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, got[0].contiguous(), group=group)
        if parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0:
            save_file({"tokens": tokens, "logits": torch.cat(parts, dim=-1).contiguous()}, task["out"])


def refused_task(task: dict[str, Any]) -> None:
    message = None
    try:
        pretrain.run(pretrain.parse_args(task["flags"]))
    except SystemExit as e:
        message = str(e)
    with open(f"{task['out']}.rank{torch.distributed.get_rank()}", "w") as f:
        json.dump({"message": message}, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        tasks = json.load(f)
    gpt.init_distributed()
    for i, task in enumerate(tasks):
        if task["kind"] == "logits":
            logits_task(task)
        elif task["kind"] == "refused":
            refused_task(task)
        else:
            pretrain.run(pretrain.parse_args(task["flags"]))
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            print(f"> hf_run: task {i + 1}/{len(tasks)} ({task['kind']}) done", flush=True)
    torch.distributed.destroy_process_group()
