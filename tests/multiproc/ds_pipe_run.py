"""Under torchrun: a DeepSpeed PipelineModule (tied embedding, 4 blocks) trained, saved, resumed at another PP size.

One launch runs several jobs in sequence, each on fresh engines (destroyed before the next), given as
``--job '{"mode": "train", "pp": P, "dir": D, "ds": B}'`` or
``--job '{"mode": "resume", "pp": P, "dir": D, "src": S, "universal": B}'`` (DP = world / PP).
``train``: N global batches; saves a tenplex checkpoint (``D/ck``) after step K and, with ``ds``, DeepSpeed's
own (``D/ds``); records each step's loss in ``D/a.json``. ``resume``: loads ``S/ck`` at this PP/DP and
trains the remaining steps (``D/b.json``). Every rank dumps its
stage's full fp32 master weights and Adam moments (DeepSpeed's own
``safe_get_full_*``) into ``<out>.rank<r>.json`` right after the save or load;
with ``universal``, also after DeepSpeed's own route (``S/ds/global_stepK_universal``, the
``ds_to_universal`` output; universal load) into ``<out>.univ.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from dataclasses import dataclass

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist
from torch import nn

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # CPU: skip compiling a shared-memory comm op

from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402

from tenplex_megatron import deepspeed as tds  # noqa: E402

VOCAB, HIDDEN, SEQ, GLOBAL_BATCH, MICRO = 64, 32, 16, 8, 2


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))


def _head(module: Embed, x: torch.Tensor) -> torch.Tensor:
    return x @ module.wte.weight.t()  # output layer tied to the word embedding


class Block(nn.TransformerEncoderLayer):
    def __init__(self) -> None:
        super().__init__(HIDDEN, 4, 64, dropout=0.0, batch_first=True)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def build(pp: int, universal: bool = False) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(1234)
    layers = [TiedLayerSpec("embed", Embed, tied_weight_attr="wte.weight"), *[LayerSpec(Block) for _ in range(4)],
              LayerSpec(nn.LayerNorm, HIDDEN), TiedLayerSpec("embed", Embed, forward_fn=_head,
                                                            tied_weight_attr="wte.weight")]
    module = PipelineModule(layers, num_stages=pp, loss_fn=_loss, partition_method="uniform")
    dp = dist.get_world_size() // pp
    opt = torch.optim.AdamW(module.parameters(), lr=2e-3, weight_decay=0.01)
    conf = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": GLOBAL_BATCH // (dp * MICRO), "zero_optimization": {"stage": 1},
            "steps_per_print": 10**9}
    if universal:
        conf["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=conf)
    return engine


def batches(step: int, engine: deepspeed.DeepSpeedEngine):
    """This DP rank's contiguous share of global batch ``step``, as (input, label) micro-batches."""
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    dp, r = engine.dp_world_size, engine.grid.get_data_parallel_rank()
    share = tokens[r * GLOBAL_BATCH // dp:(r + 1) * GLOBAL_BATCH // dp]
    for i in range(0, share.shape[0], MICRO):
        yield share[i:i + MICRO, :-1], share[i:i + MICRO, 1:]


def step(engine: deepspeed.DeepSpeedEngine, i: int) -> float:
    loss = engine.train_batch(data_iter=batches(i, engine))  # mean over micro-batches, on every stage
    t = torch.tensor([float(loss)]) / engine.dp_world_size
    dist.all_reduce(t, group=engine.data_parallel_group)
    return float(t)


def dump(engine: deepspeed.DeepSpeedEngine, path: str) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {"stage": engine.stage_id}
    for name, p in engine.module.named_parameters():
        out[f"fp32.{name}"] = safe_get_full_fp32_param(p).tolist()
        out[f"lp.{name}"] = p.detach().tolist()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}.{name}"] = safe_get_full_optimizer_state(p, k).tolist()
    with open(f"{path}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)


@dataclass(frozen=True)
class Job:
    """One train or resume run at ``pp`` stages; its files under ``dir`` (a resume reads ``src``)."""

    mode: str
    pp: int
    dir: str
    src: str = ""
    ds: bool = False
    universal: bool = False

    @staticmethod
    def parse(text: str) -> Job:
        d = json.loads(text)
        allowed = {"train": {"mode", "pp", "dir", "ds"}, "resume": {"mode", "pp", "dir", "src", "universal"}}
        if d.get("mode") not in allowed or not {"pp", "dir"} <= set(d) <= allowed[d["mode"]]:
            raise SystemExit(f"--job {text}: expected the keys {allowed}")
        if d["mode"] == "resume" and "src" not in d:
            raise SystemExit(f"--job {text}: a resume needs src")
        return Job(**d)


def run(job: Job, args: argparse.Namespace) -> None:
    """One job on fresh engines; rank 0 writes its losses (and the load's report) to ``a.json`` / ``b.json``."""
    result: dict = {"losses": {}}
    out = os.path.join(job.dir, "a.json" if job.mode == "train" else "b.json")
    if job.universal:  # DeepSpeed's own route, for comparison
        ref = build(job.pp, universal=True)
        ref.load_checkpoint(os.path.join(job.src, "ds"), tag=f"global_step{args.save_after}_universal")
        dump(ref, f"{out}.univ")
        result["universal_next_loss"] = step(ref, int(ref.global_steps) + 1)
        ref.destroy()
        del ref
        gc.collect()
    engine = build(job.pp)
    first = 1
    if job.mode == "resume":
        lr = tds.load_checkpoint(engine, os.path.join(job.src, "ck"))
        result["load"] = {"global_steps": lr.iteration, "source": lr.source_layout}
        dump(engine, out)
        first = lr.iteration + 1
    for i in range(first, args.steps + 1):
        result["losses"][i] = step(engine, i)
        if job.mode == "train" and i == args.save_after:
            tds.save_checkpoint(engine, os.path.join(job.dir, "ck"))
            if job.ds:
                engine.save_checkpoint(os.path.join(job.dir, "ds"))
            dump(engine, out)
    engine.destroy()
    del engine
    gc.collect()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", action="append", type=Job.parse, required=True, help="JSON (see the docstring); repeat")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-after", type=int, default=3)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    for job in args.job:
        os.makedirs(job.dir, exist_ok=True)
        run(job, args)


if __name__ == "__main__":
    main()
