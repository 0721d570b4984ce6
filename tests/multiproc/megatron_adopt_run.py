"""Run several adoption tasks in one torchrun launch: ``pretrain_gpt.py`` jobs, and bad inputs that must fail.

``megatron_adopt_run.py TASKS.json``: a JSON list of ``{"flags": [...]}`` (run
as ``pretrain_gpt.py FLAGS``, as ``matrix_run.py`` does) or ``{"flags": [...],
"load": DIR, "legacy": bool, "error": TEXT}``: build the job the flags describe, adopt
``DIR`` with tenplex, and record, per rank, the error raised (or none) and whether the job's weights, optimizer
state and iteration are exactly as before the call, into ``TASKS.json.rank<R>.json``; the test asserts them.
``{"export": CKPT, "out": DIR, "to": LAYOUT, "optimizer_format": FORMAT}``: ``export-megatron``'s collective export
in this launch's process group; ``{"flags": [...], "refused": true}``: a ``pretrain_gpt.py`` job expected to stop
before it builds anything, its message recorded per rank.
"""

from __future__ import annotations

import json
import sys

import torch

from tenplex_megatron.integrations.megatron_core.adapter import adopt_megatron_checkpoint
from tenplex_megatron.plan.layout import ParallelLayout, padded_vocab_size
from tenplex_megatron.training import gpt, pretrain
from tenplex_megatron.training.export_megatron import export


def _snapshot(job: gpt.GPTJob) -> tuple[list[torch.Tensor], int, int]:
    params = [p.detach().clone() for p in job.model[0].parameters()]
    states = sum(len(o.optimizer.state) for o in getattr(job.optimizer, "chained_optimizers", [job.optimizer]))
    return params, states, job.iteration


def _bad(task: dict) -> dict:
    args = pretrain.parse_args(task["flags"])
    world = torch.distributed.get_world_size()
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    spec = pretrain.spec_from_args(args)
    job = gpt.build_job(spec, ParallelLayout(tp, pp, world // (tp * pp)),
                        use_distributed_optimizer=args.use_distributed_optimizer,
                        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                        padded_vocab=padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by, tp))
    before = _snapshot(job)
    msg = None
    try:
        adopt_megatron_checkpoint(job, task["load"], trust_pickles=bool(task.get("trust")))
    except Exception as e:  # noqa: BLE001 - every kind must carry the expected message
        msg = str(e)
    after = _snapshot(job)
    unchanged = after[1:] == before[1:] and all(torch.equal(a, b) for a, b in zip(after[0], before[0]))
    return {"error": msg, "unchanged": unchanged}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        tasks = json.load(f)
    gpt.init_distributed()
    results: dict[int, dict] = {}
    for i, task in enumerate(tasks):
        if "error" in task:
            results[i] = _bad(task)
        elif "export" in task:
            export(task["export"], task["out"], ParallelLayout.parse(task["to"]),
                   optimizer_format=task["optimizer_format"])
        elif task.get("refused"):
            try:
                pretrain.run(pretrain.parse_args(task["flags"]))
                results[i] = {"refused": None}
            except SystemExit as e:
                results[i] = {"refused": str(e)}
        else:
            pretrain.run(pretrain.parse_args(task["flags"]))
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            print(f"> adopt_run: task {i + 1}/{len(tasks)} done", flush=True)
    with open(f"{sys.argv[1]}.rank{torch.distributed.get_rank()}.json", "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()
