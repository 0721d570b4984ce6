"""Run several ``scripts/pretrain_gpt.py`` jobs in turn inside one torchrun launch (one process group).

``matrix_run.py TASKS.json``: a JSON list of flag lists; each is parsed and run
exactly as ``pretrain_gpt.py FLAGS`` would run it (``training.pretrain.run``:
megatron-core's parallel state is rebuilt for every job, so layouts with the
same world size share a launch). Saves ~8 s of process start-up per job.
"""

from __future__ import annotations

import json
import sys

import torch

from tenplex_megatron.training import gpt, pretrain

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        tasks = json.load(f)
    gpt.init_distributed()
    for i, flags in enumerate(tasks):
        pretrain.run(pretrain.parse_args(flags))
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            print(f"> matrix_run: task {i + 1}/{len(tasks)} done", flush=True)
    torch.distributed.destroy_process_group()
