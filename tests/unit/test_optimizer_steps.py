"""Where each Adam counts its step, and a restore that puts it back there (engine/optimizer_json.py).

torch's Adam and AdamW (single tensor, foreach, ``fused=True``) count per parameter state; DeepSpeed's FusedAdam
too (its group ``step`` stays 0); Transformer Engine's and apex's FusedAdam per param group, and TE's
``state_dict()`` maps every per-parameter state name to a dtype (a ``step`` there fails it). The torch optimizers
run here for real: the oracle is an uninterrupted run, and a restored optimizer's next step must equal it bit for bit.
TE's and apex's FusedAdam and DeepSpeed's FusedAdam need CUDA kernels: TE's contract is reproduced by
``GroupStepAdam`` below (the step in the group, the dtype-mapped ``state_dict``), DeepSpeed's real class is built
without its kernel and its state laid out as its ``step()`` lays it out.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from tenplex_megatron.engine.optimizer_json import (
    fresh_step,
    optimizer_json,
    restore_optimizer,
    step_in_groups,
    step_of,
)


class GroupStepAdam(torch.optim.Optimizer):
    """Adam as Transformer Engine's FusedAdam keeps it: ``group["step"]`` made at the first step and incremented
    once per step; per-parameter state only ``exp_avg`` and ``exp_avg_sq``; ``state_dict()`` reads each state name
    through a name -> dtype table, as TE's does (KeyError on anything else)."""

    DTYPES = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "master_param": torch.float32}

    def __init__(self, params, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            b1, b2 = group["betas"]
            t = group["step"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2**t)).sqrt().add_(group["eps"])
                p.addcdiv_(st["exp_avg"], denom, value=-group["lr"] / (1 - b1**t))

    def state_dict(self):  # noqa: D102
        sd = super().state_dict()
        for v in sd["state"].values():
            for name in v:
                assert self.DTYPES[name] == torch.float32  # KeyError for a per-parameter "step"
        return sd


def _grad(i: int, p: torch.Tensor) -> torch.Tensor:
    return torch.sin(torch.arange(p.numel(), dtype=torch.float32) * (i + 1)).reshape(p.shape)


def _train(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    for i in steps:
        for p in params:
            p.grad = _grad(i, p)
        opt.step()


def _restored(make, params: list[torch.Tensor], trained: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A fresh optimizer over copies of ``params``: state allocated as tenplex allocates it, the moments copied in
    (what the chunks carry), hyper-parameters and step from the JSON record (what the metadata carries)."""
    opt = make(params)
    for group in opt.param_groups:
        for p, q in zip(group["params"], trained.param_groups[0]["params"]):
            st = opt.state[p]
            step = fresh_step(opt, group, p)
            if step is not None:
                st["step"] = step
            for k in ("exp_avg", "exp_avg_sq"):
                st[k] = trained.state[q][k].clone()
    restore_optimizer(opt, json.loads(json.dumps(optimizer_json(trained))))
    return opt


MAKERS = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "AdamW-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "TE-FusedAdam-contract": lambda ps: GroupStepAdam(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", list(MAKERS))
def test_restored_optimizer_steps_as_the_uninterrupted_one(name: str) -> None:
    make = MAKERS[name]
    params = [torch.linspace(-1, 1, 12).reshape(3, 4).clone(), torch.ones(5)]
    ref = [p.clone() for p in params]
    opt = make(ref)
    _train(opt, ref, range(3))
    assert step_of(opt) == 3
    assert step_in_groups(opt) == (name == "TE-FusedAdam-contract")
    resumed = [p.clone() for p in ref]
    again = _restored(make, resumed, opt)
    assert step_of(again) == 3
    again.state_dict()  # a group-counting optimizer's state holds no per-parameter step
    _train(opt, ref, range(3, 5))
    _train(again, resumed, range(3, 5))
    for a, b in zip(ref, resumed):
        assert torch.equal(a, b), name
    assert step_of(again) == 5


def test_group_step_wins_over_a_stale_per_parameter_one() -> None:
    """apex's FusedAdam after an older tenplex load: a per-parameter step 0 beside the group's real count."""
    p = torch.ones(3)
    opt = GroupStepAdam([p])
    _train(opt, [p], range(4))
    opt.state[p]["step"] = torch.tensor(0.0)
    assert step_of(opt) == 4


def test_fresh_step_as_each_optimizer_makes_it() -> None:
    p = torch.ones(2)
    adam = torch.optim.AdamW([p])
    step = fresh_step(adam, adam.param_groups[0], p)
    assert isinstance(step, torch.Tensor) and step.dtype == torch.float32 and float(step) == 0.0
    assert fresh_step(GroupStepAdam([p]), {}, p) is None


def test_deepspeed_fused_adam_counts_per_parameter_with_int_steps() -> None:
    """DeepSpeed's FusedAdam (the real class, built without its CUDA kernel): per-parameter ``int`` steps, a group
    ``step`` that stays 0; a restore sets the int where the kernel reads it."""
    from deepspeed.ops.adam.fused_adam import FusedAdam

    p = torch.ones(3)
    opt = FusedAdam.__new__(FusedAdam)
    torch.optim.Optimizer.__init__(opt, [p], {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999),
                                              "eps": 1e-8, "weight_decay": 0.0})
    assert not step_in_groups(opt)
    step = fresh_step(opt, opt.param_groups[0], p)
    assert step == 0 and type(step) is int
    opt.param_groups[0]["step"] = 0  # as its step() leaves the group
    opt.state[p] = {"step": 7, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    saved = json.loads(json.dumps(optimizer_json(opt)))
    assert saved["step"] == 7
    fresh = copy.deepcopy(opt)
    fresh.state[fresh.param_groups[0]["params"][0]]["step"] = 0
    restore_optimizer(fresh, saved)
    st = fresh.state[fresh.param_groups[0]["params"][0]]
    assert st["step"] == 7 and type(st["step"]) is int and not math.isnan(float(st["step"]))
