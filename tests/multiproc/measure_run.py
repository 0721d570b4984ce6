"""``--tenplex-layout measure`` in one torchrun launch (one process group, jobs in turn as ``pretrain_gpt.py``).

``measure_run.py OUT_DIR FLAGS...``: a job trains iterations 1-2 at the auto layout and saves; a start with
``measure`` times the best candidates (each loading that checkpoint re-sharded), keeps the times in the
checkpoint directory, chooses the fastest and trains 3-4; a second start with ``measure`` at the same world
size runs no trial and trains 5-6; then an uninterrupted run of 1-6 at the auto layout (where the job
started: the initial weights depend on the layout) is the reference. Rank 0 writes OUT_DIR/chosen.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tenplex_megatron.training import gpt, pretrain

if __name__ == "__main__":
    out, flags = sys.argv[1], sys.argv[2:]
    ckpt, log = os.path.join(out, "ckpt"), os.path.join(out, "m.jsonl")
    common = [*flags, "--save", ckpt, "--load", ckpt, "--save-interval", "2", "--tenplex-metrics", log]
    gpt.init_distributed()
    pretrain.run(pretrain.parse_args([*common, "--tenplex-layout", "auto", "--exit-interval", "2"]))
    first = pretrain.parse_args([*common, "--tenplex-layout", "measure", "--exit-interval", "4"])
    pretrain.run(first)
    chosen = [first.tensor_model_parallel_size, first.pipeline_model_parallel_size, first.micro_batch_size]
    pretrain.run(pretrain.parse_args([*common, "--tenplex-layout", "measure"]))
    pretrain.run(pretrain.parse_args([*flags, "--tenplex-layout", "auto",
                                      "--tenplex-metrics", os.path.join(out, "ref.jsonl")]))
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "chosen.json"), "w") as f:
            json.dump(chosen, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
