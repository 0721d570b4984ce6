"""The optimizer's step survives a JSON round trip also when its state is keyed by tensors outside the param groups.

DeepSpeed ZeRO-3 puts its flat fp32 partition into the inner optimizer's param
group only for the duration of ``step()`` and empties the group afterwards, so
between steps (when a checkpoint is loaded) Adam's state is keyed by a tensor
no group lists. The restored step must reach that state too: with step 0,
Adam's bias correction makes the next update a first step's.
"""

from __future__ import annotations

import json

import torch

from tenplex_megatron.engine.optimizer_json import optimizer_json, restore_optimizer, step_of


def _adam_after(steps: int, flat: torch.Tensor) -> torch.optim.AdamW:
    """torch's AdamW driven as ZeRO-3 drives it: the partition joins the group for each step only."""
    opt = torch.optim.AdamW([flat], lr=1e-2)
    for i in range(steps):
        flat.grad = torch.full_like(flat, 0.1 * (i + 1))
        opt.param_groups[0]["params"] = [flat]
        opt.step()
        opt.param_groups[0]["params"] = []
    return opt


def test_step_restored_into_state_outside_the_param_groups() -> None:
    saved = json.loads(json.dumps(optimizer_json(_adam_after(3, torch.zeros(4)))))
    assert saved["step"] == 3
    fresh_flat = torch.zeros(4)
    fresh = _adam_after(0, fresh_flat)
    fresh.param_groups[0]["params"] = []  # a fresh ZeRO-3 engine between steps
    fresh.state[fresh_flat] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    restore_optimizer(fresh, saved)
    assert step_of(fresh) == 3
    assert float(fresh.state[fresh_flat]["step"]) == 3.0


def test_an_ep_change_keeps_each_sub_optimizers_own_group_identity() -> None:
    """A checkpoint saved at EP 1 (the experts in the dense groups of one sub-optimizer) restored at EP 2 (the experts'
    own sub-optimizer): the hyper-parameters and step come from the pooled record, but every group keeps what it is
    (``is_expert_parallel``), which Megatron-LM's own loader matches groups by after an ``export-megatron``."""
    from types import SimpleNamespace

    from tenplex_megatron.integrations.megatron_core.optimizer import optimizer_state_json, restore_optimizer_state

    def adam(expert: bool, lr: float) -> torch.optim.AdamW:
        groups = [{"params": [torch.zeros(2)], "wd_mult": wd, "lr_mult": 1.0, "is_expert_parallel": expert,
                   "is_decoupled_lr": False, "max_lr": lr} for wd in (1.0, 0.0)]
        return torch.optim.AdamW(groups, lr=lr)

    saved = json.loads(json.dumps(optimizer_state_json(SimpleNamespace(optimizer=adam(False, 0.5)))))
    dense, experts = adam(False, 0.1), adam(True, 0.1)
    restore_optimizer_state(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=dense),
                                                                SimpleNamespace(optimizer=experts)]), saved)
    assert [g["is_expert_parallel"] for g in dense.param_groups + experts.param_groups] == [False] * 2 + [True] * 2
    assert [g["max_lr"] for g in dense.param_groups + experts.param_groups] == [0.5] * 4  # from the checkpoint
    assert [g["wd_mult"] for g in experts.param_groups] == [1.0, 0.0]
