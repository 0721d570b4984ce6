"""The DeepSpeed benchmark's engine (worker side): a seeded GPT-2 under ZeRO, one training step, and its state.

The state check hashes every parameter's full fp32 master and Adam moments with DeepSpeed's own accessors, so
the routes being compared are judged by DeepSpeed, not by the code under test.
"""

from __future__ import annotations

import hashlib
from typing import Any

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from transformers import GPT2Config, GPT2LMHeadModel

STATE_KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def init_distributed() -> None:
    """torch.distributed over gloo, as DeepSpeed sets it up (CPU: no shared-memory comm op to compile)."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")


def build(shape: dict[str, int], stage: int, global_batch: int, universal: bool = False) -> Any:
    """A DeepSpeed engine over a GPT-2 of ``shape`` (seeded: every engine starts from the same weights)."""
    torch.manual_seed(1234)
    cfg = GPT2Config(n_layer=shape["n_layer"], n_embd=shape["n_embd"], n_head=shape["n_head"],
                     vocab_size=shape["vocab_size"], n_positions=shape["n_positions"],
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    net = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    dp = dist.get_world_size()
    conf: dict[str, Any] = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": global_batch // dp,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}},
        "steps_per_print": 10**9,
    }
    if universal:
        conf["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=conf)
    return engine


def train_step(engine: Any, shape: dict[str, int], global_batch: int, step: int) -> float:
    """One global batch of random tokens, this rank's contiguous share; returns this rank's loss."""
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, shape["vocab_size"], (global_batch, shape["seq"]), generator=g)
    dp, r = dist.get_world_size(), dist.get_rank()
    x = tokens[r * global_batch // dp : (r + 1) * global_batch // dp]
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def state_digest(engine: Any) -> tuple[dict[str, str], dict[str, float]]:
    """Hash of every parameter's full fp32 master and Adam moments (collective; the result is rank 0's).

    Also the sum of absolute values per kind, so a state of zeros (nothing loaded, or nothing trained) shows.
    """
    digests: dict[str, str] = {}
    sums = dict.fromkeys(STATE_KINDS, 0.0)
    for name, p in engine.module.named_parameters():
        full = {"fp32": safe_get_full_fp32_param(p)}
        for k in ("exp_avg", "exp_avg_sq"):
            full[k] = safe_get_full_optimizer_state(p, k)
        if dist.get_rank() != 0:
            continue
        for k, t in full.items():
            if t is None:
                digests[f"{k}.{name}"] = "MISSING"
                continue
            t = t.detach().contiguous().cpu()
            h = hashlib.blake2b(t.numpy().tobytes(), digest_size=16).hexdigest()
            digests[f"{k}.{name}"] = f"{list(t.shape)}:{t.dtype}:{h}"
            sums[k] += float(t.double().abs().sum())
    return digests, sums


def zero_state(engine: Any) -> None:
    """Zero the fp32 master partitions and Adam moments, so the next load must fill them again."""
    inner = engine.optimizer.optimizer
    with torch.no_grad():
        for flat, st in inner.state.items():
            flat.zero_()
            for k in ("exp_avg", "exp_avg_sq"):
                if isinstance(st.get(k), torch.Tensor):
                    st[k].zero_()
