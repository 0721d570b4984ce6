"""Under torchrun: real DeepSpeed engines (tiny GPT-2, gloo) checkpointed in host memory, one node lost.

A node is a memory directory ``DIR/mem_<n>``; each ZeRO stage given runs in sequence in its own ``DIR``.
``train``: DP2, rank r on node r; steps 1-6 with snapshots after steps 2 and 4 (the second persisted to
``DIR/ckpt`` in the background), then ``finish_memory`` (the last snapshot replicated to both nodes).
Writes every step's loss and the full state after step 4 (the uninterrupted reference).
``resume``: node 1 was lost (the test deleted its directory and emptied the durable rank files); DP4 on node 0
(ranks 0-1) and node 2 (ranks 2-3, joined with empty memory); ``load_latest`` then steps 5-6, a snapshot
after step 6 and ``finish_memory(over=True)``; then every node's memory is lost (new empty directories) and a
fresh engine loads the durable checkpoint that persisted. Each rank records what it opened in a memory directory
(``TENPLEX_OPEN_LOG``) and writes ``DIR/<mode>.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from tenplex_megatron import deepspeed as tds
from tenplex_megatron.memory import node_dir
from tenplex_megatron.memory.restart import MemoryLoadResult
from tenplex_megatron.storage.faults import OPEN_LOG_ENV
from tests.multiproc.ds_run import Job, build, free, full_state, train_step

STEPS = 6


def node_of(mode: str, rank: int) -> int:
    """The node (memory directory number) of ``rank``: one each at DP2; at DP4 node 0 and the new node 2."""
    return rank if mode == "train" else (0 if rank < 2 else 2)


def run(mode: str, job: Job) -> dict:
    r = dist.get_rank()
    mem = os.path.join(job.dir, f"mem_{node_of(mode, r)}")
    os.environ[OPEN_LOG_ENV] = os.path.join(job.dir, f"open_{mode}.rank{r}.log")  # helpers inherit it
    ckpt = os.path.join(job.dir, "ckpt")
    out: dict = {"mem": os.path.abspath(mem), "losses": {}}
    engine = build(job)
    tier = tds.open_memory(mem, ckpt, persist_interval=2, replicas=2, replication_rate="auto")  # 4: paced
    mem_dir = tier.tier.mem  # the tier's directory, as it names it (the Checkpointer lets the tier go when closed)
    first = 1
    if mode == "train":
        out["fresh"] = tds.load_latest(engine, tier, ckpt) is None  # neither a snapshot nor a durable checkpoint
    if mode == "resume":
        res = tds.load_latest(engine, tier, ckpt)
        assert isinstance(res, MemoryLoadResult), res
        out["load"] = {"iteration": res.result.iteration, "source": res.result.source_layout,
                       "received": res.bytes_received, "from_durable": res.bytes_from_durable}
        out["state"] = {k: v.tolist() for k, v in full_state(engine).items()}
        first = res.result.iteration + 1
    for step in range(first, STEPS + 1):
        out["losses"][step] = train_step(engine, step)
        if mode == "train" and step in (2, 4):
            snap = tds.save_snapshot(engine, tier)
            out.setdefault("snapshots", []).append([step, snap.bytes_written, snap.persisting])
            if step == 4:
                out["state"] = {k: v.tolist() for k, v in full_state(engine).items()}
    if mode == "resume":
        tds.save_snapshot(engine, tier)
    out["persisted"] = list(tds.finish_memory(tier, over=mode == "resume"))
    out["files"] = {it: sorted(os.listdir(node_dir.snapshot_dir(mem_dir, it)))
                    for it in (4, 6) if os.path.isdir(node_dir.snapshot_dir(mem_dir, it))}
    if mode == "resume":  # every node's memory lost (a reboot): the durable checkpoint persisted at the end
        final = full_state(engine)
        rebooted = build(job)
        os.environ[OPEN_LOG_ENV] = os.path.join(job.dir, f"open_rebooted.rank{r}.log")
        again = tds.open_memory(mem + "_rebooted", ckpt)
        res = tds.load_latest(rebooted, again, ckpt)
        out["rebooted"] = [type(res).__name__, getattr(res, "iteration", None),
                           all(torch.equal(final[k], v) for k, v in full_state(rebooted).items())]
        tds.finish_memory(again, over=False)
        free(rebooted)
    free(engine)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "resume"])
    ap.add_argument("--job", action="append", type=Job.parse, required=True)
    args = ap.parse_args()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    for job in args.job:
        got = run(args.mode, job)
        with open(os.path.join(job.dir, f"{args.mode}.rank{dist.get_rank()}.json"), "w") as f:
            json.dump(got, f)
        dist.barrier()


if __name__ == "__main__":
    main()
