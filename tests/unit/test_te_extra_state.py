"""Transformer Engine's ``_extra_state`` (FP8 scaling state) is not saved by tenplex: said once, not dropped silently.

megatron-core describes each TE module's ``_extra_state`` as a ``ShardedObject`` in the model's sharded state dict
(``make_sharded_object_for_checkpoint``); TE does not run on this machine, so the dict is built from megatron-core's
own ``ShardedObject`` as a TE layer's ``sharded_state_dict`` yields it, beside a plain ``ShardedTensor``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from tenplex_megatron import log
from tenplex_megatron.integrations.megatron_core import sharded


def _model_sd() -> dict:
    weight = ShardedTensor.from_rank_offsets("decoder.layers.self_attention.linear_qkv.weight", torch.zeros(4, 4))
    extra = ShardedObject("decoder.layers.self_attention.linear_qkv._extra_state", b"fp8 meta", (2,), (0,))
    return {"decoder.layers.self_attention.linear_qkv.weight": weight,
            "decoder.layers.self_attention.linear_qkv._extra_state": extra,
            "other": ShardedObject("decoder.layers.something_else", b"", (1,), (0,)),
            # megatron-core's own linear layers (SequentialMLP's experts) describe an empty one: nothing to warn of
            "local": ShardedObject("decoder.layers.mlp.experts.experts.linear_fc1._extra_state", None, (2,), (0,))}


def test_extra_state_keys_found() -> None:
    assert sharded.extra_state_keys(_model_sd()) == ["decoder.layers.self_attention.linear_qkv._extra_state"]
    assert sharded.extra_state_keys({"w": _model_sd()["decoder.layers.self_attention.linear_qkv.weight"]}) == []


def test_warned_once(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    monkeypatch.setattr(sharded, "_WARNED", set())
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger(log.ROOT).addHandler(handler)
    request.addfinalizer(lambda: logging.getLogger(log.ROOT).removeHandler(handler))
    sharded.warn_extra_state_dropped(_model_sd())
    sharded.warn_extra_state_dropped(_model_sd())
    lines = [r.getMessage() for r in records]
    assert len(lines) == 1 and "_extra_state of 1 module(s)" in lines[0] and "re-warm" in lines[0]
