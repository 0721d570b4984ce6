"""A DeepSpeed engine as an engine :class:`~tenplex_megatron.engine.adapter.Adapter`.

The tensors (model weights, fp32 master, Adam moments) are described from DeepSpeed's own
bookkeeping (``zero.py``) and re-sharded by the engine; this module adds
DeepSpeed's non-tensor state: global steps and samples, the optimizer's
hyper-parameters and step, the LR scheduler. With ``source`` set, the adapter loads
DeepSpeed's own ``global_stepN`` checkpoints written at any DP size, in place
(``native.py`` describes them as a PTC). The calls users make (``save_checkpoint``, ``load_checkpoint``, the
host-memory ones) are the front door's: ``frontdoor/deepspeed.py``, imported as ``tenplex_megatron.deepspeed``.
"""

from __future__ import annotations

import json
from typing import Any

from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.optimizer_json import jsonable, optimizer_json, restore_optimizer
from tenplex_megatron.integrations.deepspeed import native
from tenplex_megatron.integrations.deepspeed.record import DeepSpeedLayout, DeepSpeedRecord
from tenplex_megatron.integrations.deepspeed.zero import (
    DeepSpeedStateError,
    allocate_state,
    check_param_shapes,
    describe_engine,
    engine_layout,
    inner_optimizer,
    tied_copies,
)
from tenplex_megatron.storage.source import Metadata

FRAMEWORK = "deepspeed"


def _scheduler_json(engine: Any) -> dict[str, Any] | None:
    sched = getattr(engine, "lr_scheduler", None)
    if sched is None:
        return None
    sd = jsonable(sched.state_dict())
    json.dumps(sd)  # a scheduler whose state is not plain data is refused here, before anything is written
    return sd


class DeepSpeedAdapter:
    """A ZeRO-1/2/3 engine (or a PipelineModule stage) for the engine. ``source``: a DeepSpeed checkpoint read
    in place (its own ``global_stepN`` files: optimizer state only, model weights refreshed from the fp32 master)."""

    framework = FRAMEWORK
    rng_tracker = False

    def __init__(self, engine: Any, seed: int = 1234, client_state: dict[str, Any] | None = None, where: str = ""):
        self.engine = engine
        self.seed = seed
        self.client_state = client_state or {}
        self.where = where  # the load directory, for error messages
        self.source: native.NativeCheckpoint | None = None  # set by the opener of DeepSpeed's own files

    def layout(self) -> DeepSpeedLayout:
        lay = engine_layout(self.engine)
        return DeepSpeedLayout(dp=lay.dp, zero_stage=lay.zero_stage, pp=lay.pp)

    def iteration(self) -> int:
        return int(self.engine.global_steps)

    def describe(self) -> list[LocalChunk]:
        lay, chunks = describe_engine(self.engine)
        skip = tied_copies(self.engine, lay)  # a pipeline's tied modules: only the lowest stage's copy is written
        return [lc for lc in chunks if (lc.meta.param or lc.meta.key.removeprefix("model.")) not in skip]

    def describe_for_load(self, metadata: Metadata) -> list[LocalChunk]:
        if self.source is not None:
            if engine_layout(self.engine).pp != 1:
                raise DeepSpeedStateError("loading DeepSpeed's own checkpoint into a pipeline engine is not supported")
            allocate_state(self.engine)
            chunks = [lc for lc in describe_engine(self.engine)[1] if not lc.meta.key.startswith("model.")]
            native.check_model(self.source, chunks, self.source.path)
            return chunks
        if metadata.framework != FRAMEWORK:
            raise DeepSpeedStateError(f"checkpoint was written by {metadata.framework or 'megatron-core'!r}, "
                                      "not by a DeepSpeed engine")
        allocate_state(self.engine)
        chunks = describe_engine(self.engine)[1]
        check_param_shapes({lc.meta.key: lc.meta for lc in chunks}, metadata.require_ptc().tensors,
                           self.where)
        return chunks

    def metadata(self) -> DeepSpeedRecord:
        engine = self.engine
        return DeepSpeedRecord(
            global_steps=int(engine.global_steps),
            global_samples=int(engine.global_samples),
            skipped_steps=int(getattr(engine, "skipped_steps", 0)),
            train_batch_size=int(engine.train_batch_size()),
            zero_stage=engine_layout(engine).zero_stage,
            optimizer=optimizer_json(inner_optimizer(engine)),
            scheduler=_scheduler_json(engine),
            extra=self.client_state,
        )

    def restore(self, metadata: Metadata) -> None:
        engine = self.engine
        restore_optimizer(inner_optimizer(engine), metadata.record("optimizer"))
        engine.global_steps = int(metadata.record("global_steps"))
        engine.global_samples = metadata.data_position
        engine.skipped_steps = int(metadata.record("skipped_steps") or 0)
        sched = getattr(engine, "lr_scheduler", None)
        if sched is not None and metadata.record("scheduler") is not None:
            sched.load_state_dict(metadata.record("scheduler"))

    def after_load(self, metadata: Metadata) -> None:
        if self.source is not None:  # DeepSpeed's files hold no model weights: DeepSpeed rebuilds them (all-gather)
            native.refresh_model_weights(self.engine)

