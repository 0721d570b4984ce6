"""Read Megatron-LM's legacy ``--ckpt-format torch`` checkpoints at any layout, in place, as a PTC.

``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holds one (TP, PP) rank's
model state dict (layers numbered locally), the optimizer's param groups, the
scheduler and ``args``; ``distrib_optim.pt`` holds the distributed
optimizer's state gathered over DP: per grad buffer one flat ``param`` /
``exp_avg`` / ``exp_avg_sq`` tensor, the buckets' unpadded contents end to end
(``get_parameter_state_dp_zero``). Each parameter's place in it follows
megatron-core 0.16.1's buffer layout at the saving (TP, PP)
(``plan/megatron_buffer.py``), checked against the file (sizes, every element
of the buffer). Files are memory-mapped and read with
``torch.load(weights_only=True)`` allowing only :data:`native.SAFE_GLOBALS`.
Without the distributed optimizer the state is ``model_optim_rng.pt``'s
``optimizer`` (megatron-core's plain, FP32 or Float16 optimizer's
``state_dict()``): the inner torch optimizer's per-parameter Adam state,
numbered through its param groups, and for bf16/fp16 the fp32 main params
(``fp32_from_fp16_params``, per group). The numbering follows megatron-core
0.16.1's ``_get_param_groups``: the rank's parameters in the model's order,
weight-decayed ones (group ``wd_mult`` 1) before bias and 1-D ones
(``wd_mult`` 0); every state's shape is checked against its parameter's.
The description itself is torch-free (``storage/megatron_legacy.py``, shared
with ``python -m tenplex_megatron plan``); this module reads the files with torch.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tenplex_megatron.engine.optimizer_json import jsonable
from tenplex_megatron.integrations.megatron_core.native import load_pickle
from tenplex_megatron.integrations.megatron_core.sharded import describe_model
from tenplex_megatron.plan.ptc import StoredChunk
from tenplex_megatron.plan.unsupported import check_saved_args
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.megatron_legacy import (
    MODEL_FILE,
    describe_legacy,
    inner_optimizer,
    legacy_layout,
    rank_dir,
)
from tenplex_megatron.storage.megatron_torch_dist import PRE_KEYS, MegatronCheckpointError
from tenplex_megatron.storage.source import ForeignMetadata, Opened, UncheckedSource


class LegacySource(UncheckedSource):
    """Flat ranges of the tensors in the legacy files, each file memory-mapped and unpickled once."""

    def __init__(self, path: str, *, trust: bool):
        self.path, self.trust = path, trust
        self.readers: dict[str, Any] = {}

    def load(self, name: str) -> Any:
        got = self.readers.get(name)
        if got is None:
            f = confine(self.path, name, "the legacy layout")
            if not os.path.isfile(f):
                raise MegatronCheckpointError(f"{f}: missing (every model-parallel rank's file must be there)")
            got = self.readers[name] = load_pickle(f, trust_pickles=self.trust, mmap=True)
        return got

    def tensor(self, name: str, entry: str) -> torch.Tensor:
        sd = self.load(name)
        if entry.startswith("model/"):
            return sd["model"][entry[len("model/"):]]
        if entry.startswith("plain/"):  # plain/<param index>/<state>: the inner optimizer's per-parameter state
            _, idx, state = entry.split("/")
            return inner_optimizer(sd["optimizer"])["state"][int(idx)][state]
        if entry.startswith("fp32/"):  # fp32/<group>/<i>: the Float16 optimizer's fp32 main param
            _, g, i = entry.split("/")
            return sd["optimizer"]["fp32_from_fp16_params"][int(g)][int(i)]
        state = entry.split("/")[1]
        (per_dtype,) = sd[0].values()
        return per_dtype[state]

    def flat(self, sc: StoredChunk) -> torch.Tensor:
        entry, start = sc.location.name.rsplit(":", 1)
        return self.tensor(sc.location.file, entry).reshape(-1).narrow(0, int(start), sc.chunk.numel)

    def close(self) -> None:
        self.readers.clear()


def open_legacy(path: str, job: Any, *, trust_pickles: bool = False) -> Opened:
    """Describe a legacy iteration directory for ``job`` (checked against it) and open it; the job is untouched."""
    src = LegacySource(path, trust=trust_pickles)
    model, layer_keys, module_names = describe_model(job)
    ptc, first, args = describe_legacy(path, src.load, model, layer_keys, module_names)
    check_saved_args(path, args)
    opt = first.get("optimizer") or {}
    inner = opt.get("optimizer", opt)
    groups = inner.get("param_groups", [])
    steps = {int(g["step"]) for g in groups if "step" in g}
    iteration = int(first.get("iteration", 0))
    consumed = getattr(args, "consumed_train_samples", None)
    meta = {
        "layout": ptc.layout,
        "iteration": iteration,
        "consumed_samples": int(consumed if consumed is not None else iteration * job.global_batch_size),
        "optimizer": {"sub_optimizers": [{"param_groups": [_plain(g) for g in groups],
                                          "step": max(steps) if steps else iteration}]},
        "scheduler": first.get("opt_param_scheduler"),
        "padded_vocab_size": int(ptc.tensors[PRE_KEYS[0]].global_shape[0]) if PRE_KEYS[0] in ptc.tensors else None,
        "extra": {"num_floating_point_operations_so_far": float(first.get("num_floating_point_operations_so_far", 0.0) or 0.0)},
        "source_format": "megatron legacy torch",
    }
    return Opened(path, ForeignMetadata.of("megatron legacy torch", meta, meta["consumed_samples"]), ptc, src)


def _plain(group: dict[str, Any]) -> dict[str, Any]:
    return {k: jsonable(v) for k, v in group.items() if k != "params"}


def legacy_padded_vocab(path: str, *, trust_pickles: bool = False) -> int | None:
    """The padded vocabulary of a legacy checkpoint: its first rank's word-embedding rows times the saving TP."""
    layout = legacy_layout(path)
    first = LegacySource(path, trust=trust_pickles).load(os.path.join(rank_dir(0, 0, layout.pp), MODEL_FILE))
    emb = (first.get("model") or {}).get(PRE_KEYS[0])
    return None if emb is None else int(emb.shape[0]) * layout.tp
