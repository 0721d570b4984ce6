"""The optimizer's non-tensor state (param-group hyper-parameters, step) as JSON, and its restore.

The same JSON serves megatron-core's DistributedOptimizer and its plain
(non-distributed) optimizers, so a job may switch ``--use-distributed-optimizer``
on a restart. Param groups are matched by megatron-core's own identifier keys.
"""

from __future__ import annotations

from typing import Any

import torch

from tenplex_megatron.integrations.describe import is_distributed_optimizer, sub_optimizers


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


def _step_of(inner: torch.optim.Optimizer) -> int:
    """torch's Adam keeps the step per parameter state; fused Adams keep it per param group.

    Per-state steps win: megatron's DistributedOptimizer leaves a stale ``step``
    key in torch Adam's param groups after a load.
    """
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    if not steps:
        steps = {float(g["step"]) for g in inner.param_groups if "step" in g and g["params"]}
    if len(steps) > 1:
        raise ValueError(f"optimizer steps differ across parameters: {sorted(steps)}")
    return int(steps.pop()) if steps else 0


def optimizer_state_json(optimizer: Any) -> dict[str, Any]:
    """Param groups (without params) and the common step of every sub-optimizer."""
    subs = []
    for opt in sub_optimizers(optimizer):
        inner = opt.optimizer
        groups = [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in inner.param_groups]
        entry: dict[str, Any] = {"param_groups": groups, "step": _step_of(inner)}
        if getattr(opt, "grad_scaler", None) is not None:
            entry["grad_scaler"] = {k: _jsonable(v) for k, v in opt.grad_scaler.state_dict().items()}
        subs.append(entry)
    return {"sub_optimizers": subs}


def _identifier(group: dict[str, Any]) -> tuple:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys)


def _restore_groups(inner: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    by_id = {_identifier(g): g for g in saved}
    for group in inner.param_groups:
        src = by_id.get(_identifier(group))
        if src is None:
            raise ValueError(f"checkpoint has no optimizer param group matching {_identifier(group)}")
        for k, v in src.items():
            if k in group and k not in ("params", "step"):
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


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
                    inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def restore_optimizer_state(optimizer: Any, saved: dict[str, Any]) -> None:
    """Set hyper-parameters and step from :func:`optimizer_state_json` output (tensors untouched)."""
    subs = sub_optimizers(optimizer)
    entries = saved["sub_optimizers"]
    if len(entries) != len(subs):
        raise ValueError(f"checkpoint has {len(entries)} sub-optimizers, the job has {len(subs)}")
    for opt, entry in zip(subs, entries):
        inner = opt.optimizer
        _restore_groups(inner, entry["param_groups"])
        step = int(entry["step"])
        for group in inner.param_groups:
            if "step" in group:
                group["step"] = step
            for p in group["params"]:
                st = inner.state.get(p)
                if st is not None and "step" in st:
                    st["step"] = torch.tensor(float(step), dtype=st["step"].dtype, device=st["step"].device)
        if "grad_scaler" in entry and getattr(opt, "grad_scaler", None) is not None:
            opt.grad_scaler.load_state_dict(entry["grad_scaler"])
