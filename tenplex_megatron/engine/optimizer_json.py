"""One JSON form of an optimizer's non-tensor state (param-group hyper-parameters and step), for every adapter.

Tensors (moments, fp32 main weights) travel as chunks; this is the rest. A
``torch.optim.Optimizer``'s groups are written without their ``params``; on
restore, groups are matched by a key the adapter chooses (megatron-core's
param-group identifiers, or the group's index) and the step is set in every
per-parameter state and every group that keeps one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tenplex_megatron.errors import TenplexError


class OptimizerStateError(TenplexError, ValueError):
    """Optimizer state that does not fit the job's optimizer (param groups, steps); the message names what differs."""


def jsonable(v: Any) -> Any:
    """Plain JSON data from hyper-parameter values (tuples, tensors, nested dicts)."""
    if isinstance(v, tuple | list):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


def step_in_groups(inner: torch.optim.Optimizer) -> bool:
    """Whether the optimizer counts its step per param group rather than per parameter state.

    Decided by the class, not by which keys exist (a load can leave stale ones): torch's Adam and AdamW (single
    tensor, foreach or ``fused=True``) count per parameter state, and so does DeepSpeed's FusedAdam (its group
    ``step`` stays 0: ZeRO-3 steps sub-groups apart); Transformer Engine's and apex's FusedAdam count per group
    (their state holds only ``exp_avg``, ``exp_avg_sq`` and ``master_param``)."""
    if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
        return False
    return not type(inner).__module__.startswith("deepspeed.")


def fresh_step(inner: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor) -> Any:
    """The per-parameter ``step`` a new state starts with, as the optimizer itself makes it; None where the step
    lives in the param groups (TE's FusedAdam's ``state_dict()`` fails on any other state key)."""
    if step_in_groups(inner):
        return None
    if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
        return 0  # DeepSpeed's FusedAdam: a Python int
    on_device = group.get("fused") or group.get("capturable")
    return torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")


def step_of(inner: torch.optim.Optimizer) -> int:
    """The optimizer's common step, read where the optimizer counts it (:func:`step_in_groups`), else elsewhere.

    megatron's DistributedOptimizer leaves a stale ``step`` key in torch Adam's param groups after a load, and a
    per-parameter one added to a group-counting optimizer would stay 0: the class decides which is read."""
    per_state = {float(s["step"]) for s in inner.state.values() if "step" in s}
    per_group = {float(g["step"]) for g in inner.param_groups if "step" in g and g["params"]}
    first, second = (per_group, per_state) if step_in_groups(inner) else (per_state, per_group)
    steps = first or second
    if len(steps) > 1:
        raise OptimizerStateError(f"optimizer steps differ across parameters: {sorted(steps)}")
    return int(steps.pop()) if steps else 0


def optimizer_json(inner: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"param_groups": [hyper-parameters without params], "step": n}``."""
    groups = [{k: jsonable(v) for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return {"param_groups": groups, "step": step_of(inner)}


GroupKey = Callable[[int, dict[str, Any]], Any]


def by_index(i: int, group: dict[str, Any]) -> Any:
    """Match param groups by position (DeepSpeed keeps its groups in a fixed order)."""
    return i


def restore_optimizer(inner: torch.optim.Optimizer, saved: dict[str, Any], key: GroupKey = by_index,
                      keep: tuple[str, ...] = ()) -> None:
    """Set hyper-parameters (groups matched by ``key``) and the step from :func:`optimizer_json` output; the keys in
    ``keep`` say what a group is, not how it steps (megatron-core's ``is_expert_parallel``): the job's stay."""
    groups = saved["param_groups"]
    by_key = {key(i, g): g for i, g in enumerate(groups)}
    if key is by_index and len(groups) != len(inner.param_groups):
        raise OptimizerStateError(f"checkpoint has {len(groups)} optimizer param groups, the job "
                                  f"{len(inner.param_groups)}")
    for i, group in enumerate(inner.param_groups):
        src = by_key.get(key(i, group))
        if src is None:
            raise OptimizerStateError(f"checkpoint has no optimizer param group matching {key(i, group)}")
        for k, v in src.items():
            if k in group and k not in ("params", "step") and k not in keep:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
    step = int(saved["step"])
    in_groups = step_in_groups(inner)
    for group in inner.param_groups:
        if in_groups or "step" in group:  # a fused Adam makes the key at its first step: a fresh one lacks it
            group["step"] = step
    for st in inner.state.values():  # every state, as step_of reads: ZeRO-3 keys it by partitions not in the groups
        if "step" not in st:
            continue
        old = st["step"]
        st["step"] = torch.tensor(float(step), dtype=old.dtype, device=old.device) if isinstance(
            old, torch.Tensor) else type(old)(step)
