"""Save a live DeepSpeed engine as a tenplex checkpoint and load it at another DP (and PP) size.

Calls that sit next to ``engine.save_checkpoint`` / ``engine.load_checkpoint``:
``save_checkpoint(engine, save_dir)`` and ``load_checkpoint(engine, load_dir)``.
The tensors (model weights, fp32 master, Adam moments) are re-sharded by the
PTC planner; this module adds DeepSpeed's non-tensor state: global steps and
samples, the optimizer's hyper-parameters and step, the LR scheduler, and RNG
(exact on the same layout, re-seeded from ``(seed, global_steps)`` otherwise).
``load_checkpoint`` also reads DeepSpeed's own ``global_stepN`` checkpoints
written at any DP size, with no conversion on disk (``native.py``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from tenplex_megatron.integrations import rng
from tenplex_megatron.integrations.deepspeed.describe import (
    EngineLayout,
    allocate_state,
    check_param_shapes,
    describe_engine,
    inner_optimizer,
    tied_copies,
)
from tenplex_megatron.integrations.ptc_checkpoint import LocalChunk, SaveResult, load_chunks, rank, save_chunks
from tenplex_megatron.plan.ptc import PTC

FRAMEWORK = "deepspeed"


@dataclass(frozen=True)
class LoadResult:
    path: str
    global_steps: int
    source: dict[str, Any]  # the saved layout: tp, pp, dp, zero_stage
    bytes_read: int  # by this rank
    bytes_filled: int
    tensors: int
    seconds: float
    rng_exact: bool
    native: bool = False  # read from DeepSpeed's own global_stepN files


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple | list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


def _step_of(inner: torch.optim.Optimizer) -> int:
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"optimizer steps differ across parameter groups: {sorted(steps)}")
    return int(steps.pop()) if steps else 0


def optimizer_json(engine: Any) -> dict[str, Any]:
    """The optimizer's hyper-parameters per param group and its step."""
    inner = inner_optimizer(engine)
    groups = [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return {"param_groups": groups, "step": _step_of(inner)}


def restore_optimizer(engine: Any, saved: dict[str, Any]) -> None:
    """Hyper-parameters by group index and the step into every state (tensors are already filled)."""
    inner = inner_optimizer(engine)
    groups = saved["param_groups"]
    if len(groups) != len(inner.param_groups):
        raise ValueError(f"checkpoint has {len(groups)} optimizer param groups, the engine {len(inner.param_groups)}")
    for group, src in zip(inner.param_groups, groups):
        for k, v in src.items():
            if k in group and k != "params":
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
    step = float(saved["step"])
    for st in inner.state.values():
        if "step" in st:
            st["step"] = torch.tensor(step, dtype=st["step"].dtype, device=st["step"].device)


def _scheduler_json(engine: Any) -> dict[str, Any] | None:
    sched = getattr(engine, "lr_scheduler", None)
    if sched is None:
        return None
    sd = _jsonable(sched.state_dict())
    json.dumps(sd)  # a scheduler whose state is not plain data is refused here, before anything is written
    return sd


def engine_metadata(engine: Any, lay: EngineLayout, infos: list[dict[str, Any]],
                    client_state: dict[str, Any] | None) -> dict[str, Any]:
    """DeepSpeed's part of metadata.json."""
    return {
        "framework": FRAMEWORK,
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
        "train_batch_size": int(engine.train_batch_size()),
        "zero_stage": lay.zero_stage,
        "optimizer": optimizer_json(engine),
        "scheduler": _scheduler_json(engine),
        "rng": {str(r): i["rng"] for r, i in enumerate(infos)},
        "extra": client_state or {},
    }


def save_checkpoint(engine: Any, save_dir: str, client_state: dict[str, Any] | None = None,
                    keep: int | None = None) -> SaveResult:
    """Collective: write the engine's full state under ``save_dir/iter_NNNNNNN`` (N = global steps) and commit it."""
    lay, chunks = describe_engine(engine)
    skip = tied_copies(engine, lay)  # a pipeline's tied modules: only the lowest stage's copy is written
    chunks = [lc for lc in chunks if (lc.meta.param or lc.meta.key.removeprefix("model.")) not in skip]

    def metadata(infos: list[dict[str, Any]]) -> dict[str, Any]:
        return engine_metadata(engine, lay, infos, client_state)

    return save_chunks(chunks, save_dir, int(engine.global_steps), lay.to_json(), {"rng": rng.capture(tracker=False)},
                       metadata, keep)


def _restore_counters(engine: Any, meta: dict[str, Any]) -> None:
    engine.global_steps = int(meta["global_steps"])
    engine.global_samples = int(meta["global_samples"])
    engine.skipped_steps = int(meta.get("skipped_steps", 0))
    sched = getattr(engine, "lr_scheduler", None)
    if sched is not None and meta.get("scheduler") is not None:
        sched.load_state_dict(meta["scheduler"])


def load_checkpoint(engine: Any, load_dir: str, iteration: int | None = None, verify: bool = True,
                    seed: int = 1234, trust_pickles: bool = False) -> LoadResult:
    """Collective: load the newest complete checkpoint under ``load_dir`` into ``engine``, re-sharded.

    ``load_dir`` may hold tenplex checkpoints or DeepSpeed's own (``latest`` and
    ``global_stepN/``, read with ``weights_only=True`` unless ``trust_pickles``),
    written at any DP size. ``verify``: check tenplex checksums. ``seed``: for
    the RNG re-seed when the layout changed.
    """
    from tenplex_megatron.integrations.deepspeed import native

    if native.is_deepspeed_checkpoint_dir(load_dir):
        return native.load_native(engine, load_dir, iteration, seed, trust_pickles)
    t0 = time.perf_counter()
    lay_box: list[EngineLayout] = []

    def describe(meta: dict[str, Any]) -> list[LocalChunk]:
        if meta.get("framework") != FRAMEWORK:
            raise ValueError(f"{load_dir}: checkpoint was written by {meta.get('framework', 'megatron-core')!r}, "
                             "not by a DeepSpeed engine")
        allocate_state(engine)
        lay, chunks = describe_engine(engine)
        lay_box.append(lay)
        check_param_shapes({lc.meta.key: lc.meta for lc in chunks}, PTC.from_json(meta["ptc"]).tensors, load_dir)
        return chunks

    def restore(meta: dict[str, Any]) -> None:
        restore_optimizer(engine, meta["optimizer"])
        _restore_counters(engine, meta)

    loaded = load_chunks(load_dir, iteration, describe, restore, strict=True, verify=verify)
    meta = loaded.metadata
    exact = _restore_rng(meta, lay_box[0], engine, seed)
    return LoadResult(loaded.path, engine.global_steps, meta["layout"], loaded.stats.bytes_read,
                      loaded.stats.bytes_filled, loaded.tensors, time.perf_counter() - t0, exact)


def _restore_rng(meta: dict[str, Any], lay: EngineLayout, engine: Any, seed: int) -> bool:
    """Exact RNG on the same layout; deterministic re-seed from (seed, global steps) otherwise."""
    saved = meta.get("layout", {})
    me = str(rank())
    exact = saved == lay.to_json() and me in (meta.get("rng") or {})
    if exact:
        rng.restore(meta["rng"][me])
    else:
        rng.reseed(seed, int(engine.global_steps), tracker=False)
    return exact
