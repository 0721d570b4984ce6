"""megatron-core's optimizers for the engine: sub-optimizers, state allocation, hyper-parameters and step as JSON.

The same JSON (``engine.optimizer_json``, one entry per sub-optimizer) serves
megatron-core's DistributedOptimizer and its plain optimizers, so a job may
switch ``--use-distributed-optimizer`` on a restart. Param groups are matched
by megatron-core's own identifier keys.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import param_group_identifier_keys

from tenplex_megatron.engine.optimizer_json import (
    OptimizerStateError,
    fresh_step,
    jsonable,
    optimizer_json,
    restore_optimizer,
)


def sub_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed_optimizer(opt: Any) -> bool:
    return isinstance(opt, DistributedOptimizer)


def optimizer_state_json(optimizer: Any) -> dict[str, Any]:
    """Param groups (without params) and the common step of every sub-optimizer, plus any grad scaler."""
    subs = []
    for opt in sub_optimizers(optimizer):
        entry = optimizer_json(opt.optimizer)
        if getattr(opt, "grad_scaler", None) is not None:
            entry["grad_scaler"] = {k: jsonable(v) for k, v in opt.grad_scaler.state_dict().items()}
        subs.append(entry)
    return {"sub_optimizers": subs}


def _identifier(i: int, group: dict[str, Any]) -> tuple:
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys)


def allocate_state(optimizer: Any) -> None:
    """Make sure every optimizer state tensor exists (a fresh job has none) so it can be filled in place."""
    for opt in sub_optimizers(optimizer):
        inner = opt.optimizer
        if len(inner.state) > 0:
            continue
        if is_distributed_optimizer(opt):
            groups = [{k: v for k, v in g.items() if k != "params"} | {"step": 0} for g in inner.param_groups]
            opt.load_state_dict({"optimizer": {"param_groups": groups}})
        else:
            opt.init_state_fn(inner, opt.config)
            for group in inner.param_groups:
                for p in group["params"]:
                    step = fresh_step(inner, group, p)
                    if step is not None:  # torch's Adam counts per parameter; TE's and apex's FusedAdam per group
                        inner.state[p].setdefault("step", step)


def never_stepped(saved: dict[str, Any] | None) -> bool:
    """Whether an :func:`optimizer_state_json` record says no sub-optimizer has taken a step (no Adam state yet)."""
    subs = (saved or {}).get("sub_optimizers")
    return bool(subs) and all(int(entry.get("step", 0)) == 0 for entry in subs)


def _identifier_any_expert(i: int, group: dict[str, Any]) -> tuple:
    """A param group's identifier without ``is_expert_parallel``: at EP 1 the experts share the dense groups."""
    return tuple(v for k, v in zip(param_group_identifier_keys, _identifier(i, group)) if k != "is_expert_parallel")


def pooled_entry(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One sub-optimizer record from several: every param group, the common step, the first loss scaler.

    megatron-core gives expert parameters a sub-optimizer of their own only at EP > 1 (at EP 1 they are reduced
    over DP with the rest), so an EP change changes the number of sub-optimizers; they all step together."""
    steps = {int(e.get("step", 0)) for e in entries}
    if len(steps) > 1:
        raise OptimizerStateError(f"checkpoint's sub-optimizers are at different steps {sorted(steps)}: cannot merge "
                                  "them")
    out: dict[str, Any] = {"param_groups": [g for e in entries for g in e["param_groups"]], "step": steps.pop()}
    scaler = next((e["grad_scaler"] for e in entries if "grad_scaler" in e), None)
    if scaler is not None:
        out["grad_scaler"] = scaler
    return out


def restore_optimizer_state(optimizer: Any, saved: dict[str, Any]) -> None:
    """Set hyper-parameters and step from :func:`optimizer_state_json` output (tensors untouched).

    Same number of sub-optimizers: each from its own record; otherwise (an EP change moved the experts into or out
    of a sub-optimizer of their own) every sub-optimizer from all records pooled, groups matched ignoring
    ``is_expert_parallel``."""
    subs = sub_optimizers(optimizer)
    entries = saved["sub_optimizers"]
    if len(entries) == len(subs):
        pairs = [(opt, entry, _identifier) for opt, entry in zip(subs, entries)]
    else:
        pooled = pooled_entry(entries)
        pairs = [(opt, pooled, _identifier_any_expert) for opt in subs]
    for opt, entry, key in pairs:
        # the identifier keys stay the job's: pooled across an EP change, the experts' sub-optimizer would take the
        # dense groups' is_expert_parallel=False, which Megatron-LM's loader then cannot match
        restore_optimizer(opt.optimizer, entry, key=key, keep=tuple(param_group_identifier_keys))
        if "grad_scaler" in entry and getattr(opt, "grad_scaler", None) is not None:
            opt.grad_scaler.load_state_dict(grad_scaler_state(entry["grad_scaler"]))


def grad_scaler_state(saved: dict[str, Any]) -> dict[str, Any]:
    """A loss scaler's JSON state as megatron's ``load_state_dict`` takes it: ``DynamicGradScaler`` moves the scale
    with ``.cuda()``, so it is a one-element float32 tensor again (as the scaler made it), not a float."""
    state = dict(saved)
    if "scale" in state and not isinstance(state["scale"], torch.Tensor):
        state["scale"] = torch.tensor([float(state["scale"])], dtype=torch.float32)
    return state
