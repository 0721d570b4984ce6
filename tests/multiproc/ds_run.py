"""Under torchrun: train a tiny GPT-2 with a real DeepSpeed engine, save, or resume at another DP size and compare.

``train``: N steps; saves a tenplex checkpoint and DeepSpeed's own checkpoint
after step K; writes every step's loss (the uninterrupted reference).
``resume``: at this DP size, loads (1) the tenplex checkpoint, (2) DeepSpeed's
own checkpoint directly through tenplex (no conversion) and, when ``--universal`` names the
output of ``ds_to_universal``, (3) DeepSpeed's universal route; dumps each
engine's full fp32 master weights and Adam moments (DeepSpeed's own
``safe_get_full_*`` accessors) and the losses of the remaining steps.
The global batch is fixed; DP ranks take contiguous shares and the number of
micro-batches is recomputed, so losses are comparable across DP sizes.
"""

from __future__ import annotations

import argparse
import json
import os

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # CPU: skip compiling a shared-memory comm op

from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from tenplex_megatron.integrations import deepspeed as tds  # noqa: E402

GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 96


def build(args: argparse.Namespace, universal: bool = False, n_embd: int = 32) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(1234)  # same initial weights everywhere (a load overwrites them anyway)
    cfg = GPT2Config(n_layer=2, n_embd=n_embd, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
    dp = dist.get_world_size()
    micro = max(1, min(2, GLOBAL_BATCH // dp))
    conf: dict = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": GLOBAL_BATCH // (dp * micro),
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": args.bf16},
        "gradient_clipping": 1.0,
        "scheduler": {"type": "WarmupLR",  # the LR schedule must continue across the restart too
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 5}},
        "steps_per_print": 10**9,
    }
    if universal:
        conf["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
    return engine


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def train_step(engine: deepspeed.DeepSpeedEngine, step: int) -> float:
    """One global batch: this rank's contiguous share, in micro-batches; returns the global mean loss."""
    dp, r = dist.get_world_size(), dist.get_rank()
    share = batch(step)[r * GLOBAL_BATCH // dp:(r + 1) * GLOBAL_BATCH // dp]
    micro = engine.train_micro_batch_size_per_gpu()
    total = torch.zeros(())
    for i in range(0, share.shape[0], micro):
        x = share[i:i + micro]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        total += loss.detach().float() * x.shape[0]
    dist.all_reduce(total)
    return float(total) / GLOBAL_BATCH


def full_state(engine: deepspeed.DeepSpeedEngine) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 master and Adam moments, by DeepSpeed's own accessors."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        out[f"fp32.{name}"] = safe_get_full_fp32_param(p).detach().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}.{name}"] = safe_get_full_optimizer_state(p, k).detach().clone()
    return out


class NotDeepSpeed:
    """Stands for any class a hostile or foreign pickle may name."""


def bad_inputs(args: argparse.Namespace) -> dict[str, str]:
    """Loads that must fail with an error naming the file or tensor, leaving the engine untouched."""
    import shutil

    out: dict[str, str] = {}
    work = os.path.join(os.path.dirname(args.out), "bad")
    engine = build(args)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    def attempt(name: str, eng: deepspeed.DeepSpeedEngine, path: str) -> None:
        try:
            tds.load_checkpoint(eng, path)
            out[name] = "NO ERROR"
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            out[name] = f"{type(e).__name__}: {e}"

    missing = os.path.join(work, "missing")
    shutil.copytree(args.ds_dir, missing)
    os.remove(os.path.join(missing, "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    attempt("missing_rank_file", engine, missing)
    hostile = os.path.join(work, "hostile")
    shutil.copytree(args.ds_dir, hostile)
    torch.save({"optimizer_state_dict": NotDeepSpeed()},
               os.path.join(hostile, "global_step3", "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    attempt("foreign_pickle", engine, hostile)
    other = build(args, n_embd=16)
    attempt("other_model_native", other, args.ds_dir)
    attempt("other_model_tenplex", other, args.tenplex_dir)
    out["untouched"] = str(all(torch.equal(before[n], p) for n, p in engine.module.named_parameters()))
    out["step_file"] = os.path.join(missing, "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    out["hostile_file"] = os.path.join(hostile, "global_step3", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "resume", "bad"])
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-after", type=int, default=3)
    ap.add_argument("--tenplex-dir", required=True)
    ap.add_argument("--ds-dir", required=True)
    ap.add_argument("--universal", default=None, help="ds_to_universal output folder to load as DeepSpeed's route")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    r = dist.get_rank()
    result: dict = {"losses": {}}
    if args.mode == "bad":
        result = bad_inputs(args)
    elif args.mode == "train":
        engine = build(args)
        for step in range(1, args.steps + 1):
            result["losses"][step] = train_step(engine, step)
            if step == args.save_after:
                res = tds.save_checkpoint(engine, args.tenplex_dir)
                engine.save_checkpoint(args.ds_dir)
                result["saved"] = res.path
                result["state"] = {k: v.tolist() for k, v in full_state(engine).items()}
    else:
        states = {}
        engine = build(args)
        lr = tds.load_checkpoint(engine, args.tenplex_dir)
        result["tenplex_load"] = {"global_steps": lr.iteration, "source": lr.source_layout, "bytes_read": lr.bytes_read}
        states["tenplex"] = full_state(engine)
        nat = build(args)
        nl = tds.load_checkpoint(nat, args.ds_dir)  # DeepSpeed's own files, read directly at this DP size
        result["native_load"] = {"global_steps": nl.iteration, "source": nl.source_layout, "native": nl.source_format == "deepspeed",
                                 "bytes_read": nl.bytes_read}
        states["native"] = full_state(nat)
        result["native_next_loss"] = train_step(nat, nl.iteration + 1)
        del nat
        if args.universal:
            ref = build(args, universal=True)
            ref.load_checkpoint(os.path.dirname(args.universal), tag=os.path.basename(args.universal))
            states["universal"] = full_state(ref)
            result["universal_next_loss"] = train_step(ref, lr.iteration + 1)
            result["universal_global_steps"] = int(ref.global_steps)
            del ref
        for step in range(lr.iteration + 1, args.steps + 1):
            result["losses"][step] = train_step(engine, step)
        result["state"] = {src: {k: v.tolist() for k, v in s.items()} for src, s in states.items()}
    if r == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main()
