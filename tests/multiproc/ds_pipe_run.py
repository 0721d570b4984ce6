"""Under torchrun: a DeepSpeed PipelineModule (tied embedding, 4 blocks) trained, saved, resumed at another PP size.

``train``: N global batches at ``--pp`` stages (DP = world / PP); saves a
tenplex checkpoint after step K; records each step's loss. ``resume``: loads
it at this run's PP/DP and trains the remaining steps. Every rank dumps its
stage's full fp32 master weights and Adam moments (DeepSpeed's own
``safe_get_full_*``) into ``OUT.rank<r>.json`` right after the save or load;
with ``--universal``, also after DeepSpeed's own route (``ds_to_universal`` output, universal load).
"""

from __future__ import annotations

import argparse
import json
import os

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist
from torch import nn

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # CPU: skip compiling a shared-memory comm op

from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402

from tenplex_megatron.integrations import deepspeed as tds  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "resume"])
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-after", type=int, default=3)
    ap.add_argument("--tenplex-dir", required=True)
    ap.add_argument("--ds-dir", default=None, help="train: also save DeepSpeed's own checkpoint here")
    ap.add_argument("--universal", default=None, help="resume: also load this ds_to_universal output (dumped to OUT.univ)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    result: dict = {"losses": {}}
    if args.universal:  # DeepSpeed's own route, for comparison
        ref = build(args.pp, universal=True)
        ref.load_checkpoint(os.path.dirname(args.universal), tag=os.path.basename(args.universal))
        dump(ref, f"{args.out}.univ")
        result["universal_next_loss"] = step(ref, int(ref.global_steps) + 1)
        del ref
    engine = build(args.pp)
    first = 1
    if args.mode == "resume":
        lr = tds.load_checkpoint(engine, args.tenplex_dir)
        result["load"] = {"global_steps": lr.iteration, "source": lr.source_layout}
        dump(engine, args.out)
        first = lr.iteration + 1
    for i in range(first, args.steps + 1):
        result["losses"][i] = step(engine, i)
        if args.mode == "train" and i == args.save_after:
            tds.save_checkpoint(engine, args.tenplex_dir)
            if args.ds_dir:
                engine.save_checkpoint(args.ds_dir)
            dump(engine, args.out)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main()
