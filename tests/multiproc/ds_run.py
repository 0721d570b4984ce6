"""Under torchrun: train tiny GPT-2s with real DeepSpeed engines, save, or resume at another DP size and compare.

One launch runs several jobs in sequence, each on fresh engines (destroyed before the next), so one
torchrun start-up serves every ZeRO stage and dtype at this DP size. A job is ``--job '{"stage": S,
"bf16": B, "dir": D}'``; its files live under ``D``: ``t/`` (tenplex), ``d/`` (DeepSpeed's own
checkpoint), ``d/global_stepK_universal`` (``ds_to_universal``'s output), ``a.json`` (train) and
``b<DP>.json`` (resume at DP ranks); ``--bad`` names a job whose checkpoints bad loads are tried on.
``train``: N steps; saves a tenplex checkpoint and DeepSpeed's own checkpoint
after step K; writes every step's loss (the uninterrupted reference).
``resume``: at this DP size, loads (1) the tenplex checkpoint, (2) DeepSpeed's
own checkpoint directly through tenplex (no conversion) and, with ``--universal``,
(3) DeepSpeed's universal route; dumps each
engine's full fp32 master weights and Adam moments (DeepSpeed's own
``safe_get_full_*`` accessors) and the losses of the remaining steps.
The global batch is fixed; DP ranks take contiguous shares and the number of
micro-batches is recomputed, so losses are comparable across DP sizes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # CPU: skip compiling a shared-memory comm op

from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from tenplex_megatron import deepspeed as tds  # noqa: E402
from tenplex_megatron.storage import directory, job_identity, lease  # noqa: E402
from tests.harness import flip  # noqa: E402
from tests.logs import logged  # noqa: E402

GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 96


@dataclass(frozen=True)
class Job:
    """One (ZeRO stage, dtype) variant and the directory holding its checkpoints and results."""

    stage: int
    bf16: bool
    dir: str

    @staticmethod
    def parse(text: str) -> Job:
        d = json.loads(text)
        if set(d) != {"stage", "bf16", "dir"}:
            raise SystemExit(f"--job {text}: expected the keys stage, bf16, dir")
        return Job(int(d["stage"]), bool(d["bf16"]), str(d["dir"]))

    @property
    def tenplex_dir(self) -> str:
        return os.path.join(self.dir, "t")

    @property
    def ds_dir(self) -> str:
        return os.path.join(self.dir, "d")


def build(job: Job, universal: bool = False, n_embd: int = 32) -> deepspeed.DeepSpeedEngine:
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
        "zero_optimization": {"stage": job.stage},
        "bf16": {"enabled": job.bf16},
        "gradient_clipping": 1.0,
        "scheduler": {"type": "WarmupLR",  # the LR schedule must continue across the restart too
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 5}},
        "steps_per_print": 10**9,
    }
    if universal:
        conf["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
    return engine


def free(*engines: deepspeed.DeepSpeedEngine) -> None:
    """Release engines before the next job builds its own (ZeRO-3 hooks, optimizer buffers)."""
    for engine in engines:
        engine.destroy()
    gc.collect()


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


def train(job: Job, args: argparse.Namespace) -> dict:
    """The uninterrupted run: every step's loss; both checkpoints and the full state after step K."""
    result: dict = {"losses": {}}
    engine = build(job)
    for step in range(1, args.steps + 1):
        result["losses"][step] = train_step(engine, step)
        if step == args.save_after:
            res = tds.save_checkpoint(engine, job.tenplex_dir, client_state={"note": "ds"})
            engine.save_checkpoint(job.ds_dir)
            result["saved"] = res.path
            result["state"] = {k: v.tolist() for k, v in full_state(engine).items()}
    free(engine)
    return result


def resume(job: Job, args: argparse.Namespace) -> dict:
    """Three loads at this DP size (tenplex's, DeepSpeed's files read directly, the universal route) and the rest."""
    result: dict = {"losses": {}}
    states = {}
    engine = build(job)
    lr = tds.load_checkpoint(engine, job.tenplex_dir)
    result["tenplex_load"] = {"global_steps": lr.iteration, "source": lr.source_layout, "bytes_read": lr.bytes_read,
                              "layout": str(lr.layout), "extra": dict(lr.extra)}
    states["tenplex"] = full_state(engine)
    nat = build(job)
    nl = tds.load_checkpoint(nat, job.ds_dir)  # DeepSpeed's own files, read directly at this DP size
    result["native_load"] = {"global_steps": nl.iteration, "source": nl.source_layout, "layout": str(nl.layout),
                             "native": nl.source_format == "deepspeed", "bytes_read": nl.bytes_read}
    states["native"] = full_state(nat)
    result["native_next_loss"] = train_step(nat, nl.iteration + 1)
    free(nat)
    if args.universal:
        ref = build(job, universal=True)
        ref.load_checkpoint(job.ds_dir, tag=f"global_step{args.save_after}_universal")
        states["universal"] = full_state(ref)
        result["universal_next_loss"] = train_step(ref, lr.iteration + 1)
        result["universal_global_steps"] = int(ref.global_steps)
        free(ref)
    for step in range(lr.iteration + 1, args.steps + 1):
        result["losses"][step] = train_step(engine, step)
    free(engine)
    result["state"] = {src: {k: v.tolist() for k, v in s.items()} for src, s in states.items()}
    return result


class NotDeepSpeed:
    """Stands for any class a hostile or foreign pickle may name."""


def bad_inputs(job: Job, args: argparse.Namespace) -> dict[str, str]:
    """Loads that must fail with an error naming the file or tensor, leaving the engine untouched."""
    out: dict[str, str] = {}
    work = os.path.join(job.dir, f"bad{dist.get_world_size()}")
    engine = build(job)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    def attempt(name: str, eng: deepspeed.DeepSpeedEngine, path: str) -> None:
        try:
            tds.load_checkpoint(eng, path)
            out[name] = "NO ERROR"
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            out[name] = f"{type(e).__name__}: {e}"

    step_dir = f"global_step{args.save_after}"
    missing = os.path.join(work, "missing")
    hostile = os.path.join(work, "hostile")
    if dist.get_rank() == 0:
        shutil.copytree(job.ds_dir, missing)
        os.remove(os.path.join(missing, step_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
        shutil.copytree(job.ds_dir, hostile)
        torch.save({"optimizer_state_dict": NotDeepSpeed()},
                   os.path.join(hostile, step_dir, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    dist.barrier()
    attempt("missing_rank_file", engine, missing)
    attempt("foreign_pickle", engine, hostile)
    other = build(job, n_embd=16)
    attempt("other_model_native", other, job.ds_dir)
    attempt("other_model_tenplex", other, job.tenplex_dir)
    out["untouched"] = str(all(torch.equal(before[n], p) for n, p in engine.module.named_parameters()))
    out["step_file"] = os.path.join(missing, step_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    out["hostile_file"] = os.path.join(hostile, step_dir, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    free(engine, other)
    out.update(cluster_safety(job, work))
    return out


def cluster_safety(job: Job, work: str) -> dict[str, str]:
    """The DeepSpeed front door's safety: a save into a directory another live job holds is refused naming the
    holder before anything is written; one a round of this same launch holds is taken at once (next generation);
    a damaged newest checkpoint falls back to the previous complete one (a damaged metadata.json too)."""
    out: dict[str, str] = {}
    leased, fb = os.path.join(work, "leased"), os.path.join(work, "fallback")
    holder = None
    if dist.get_rank() == 0:
        os.makedirs(leased)
        shutil.copytree(job.tenplex_dir, fb)
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LEASE, leased], stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    dist.barrier()
    engine = build(job)
    try:
        tds.save_checkpoint(engine, leased)
        out["other_job"] = "NO ERROR"
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        out["other_job"] = f"{type(e).__name__}: {e}"
    out["leased_entries"] = json.dumps(sorted(os.listdir(leased)))
    if holder is not None:
        holder.kill()
        holder.wait()
    tds.load_checkpoint(engine, fb)
    train_step(engine, int(engine.global_steps) + 1)
    # a round of this same launch holds a directory (its holder alive): the save (of a trained engine) takes the
    # next generation at once
    same, launch_job = os.path.join(work, "same"), job_identity.job_id()
    if dist.get_rank() == 0:
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LEASE, same, launch_job], stdout=subprocess.PIPE,
                                  text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    dist.barrier()
    before = lease.current(same)
    tds.save_checkpoint(engine, same)
    after = lease.current(same)
    out["launch_job"] = launch_job
    out["same_job"] = json.dumps({"before": [before.job, before.generation], "after": [after.job, after.generation]})
    if holder is not None:
        holder.kill()
        holder.wait()
    newest = tds.save_checkpoint(engine, fb).path
    if dist.get_rank() == 0:
        flip(os.path.join(newest, directory.rank_file_name(0)))
    dist.barrier()
    fresh = build(job)
    got = tds.load_checkpoint(fresh, fb)
    out.update(newest=newest, loaded=got.path, loaded_iteration=str(got.iteration))
    # the newest saved again (replacing the damaged one), its metadata.json truncated: the previous one loads again
    train_step(fresh, int(fresh.global_steps) + 1)
    newer = tds.save_checkpoint(fresh, fb).path
    if dist.get_rank() == 0:
        meta = os.path.join(newer, "metadata.json")
        os.truncate(meta, os.path.getsize(meta) // 2)
    dist.barrier()
    again = build(job)
    with logged() as records:
        got = tds.load_checkpoint(again, fb)
    skipped = [r.getMessage() for r in records if "skipping a damaged copy" in r.getMessage()]
    out.update(metadata_newest=newer, metadata_loaded=got.path, metadata_skipped=json.dumps(skipped))
    free(engine, fresh, again)
    return out


HOLD_LEASE = """
import sys, time
from tenplex_megatron.storage import lease
held = lease.LeaseSet()
held.acquire(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "another-job")
print("held", flush=True)
time.sleep(120)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "resume"])
    ap.add_argument("--job", action="append", type=Job.parse, required=True,
                    help='JSON {"stage": S, "bf16": B, "dir": D}; repeat to run several jobs in this launch')
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-after", type=int, default=3)
    ap.add_argument("--universal", action="store_true", help="resume: also run DeepSpeed's universal route")
    ap.add_argument("--bad", type=Job.parse, default=None,
                    help="resume: then try bad loads on this job's checkpoints (writes its bad<DP>.json)")
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    dp = dist.get_world_size()
    for job in args.job:
        result = train(job, args) if args.mode == "train" else resume(job, args)
        out = os.path.join(job.dir, "a.json" if args.mode == "train" else f"b{dp}.json")
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(result, f)
        dist.barrier()
    if args.bad:
        result = bad_inputs(args.bad, args)
        if dist.get_rank() == 0:
            with open(os.path.join(args.bad.dir, f"bad{dp}.json"), "w") as f:
                json.dump(result, f)
        dist.barrier()


if __name__ == "__main__":
    main()
