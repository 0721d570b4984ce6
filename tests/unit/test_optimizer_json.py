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
