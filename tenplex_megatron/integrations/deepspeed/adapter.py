"""A DeepSpeed engine as an engine :class:`~tenplex_megatron.engine.adapter.Adapter`, and the calls beside DeepSpeed's.

``save_checkpoint(engine, save_dir)`` / ``load_checkpoint(engine, load_dir)`` sit
next to ``engine.save_checkpoint`` / ``engine.load_checkpoint``. The tensors
(model weights, fp32 master, Adam moments) are described from DeepSpeed's own
bookkeeping (``zero.py``) and re-sharded by the engine; this module adds
DeepSpeed's non-tensor state: global steps and samples, the optimizer's
hyper-parameters and step, the LR scheduler. ``load_checkpoint`` also reads
DeepSpeed's own ``global_stepN`` checkpoints written at any DP size, in place
(``native.py`` describes them as a PTC).

Safety at cluster scale, as behind the other front doors: the first save into a directory takes its lease (one
writer per directory, ``storage/lease.py``: another live job's directory is refused on every rank before anything
is written); a load of the newest checkpoint falls back past a damaged copy (``memory/fallback.py``); and under
torchrun a worker dies with its agent (``engine/orphan.py``). The lease claim and the load order run through the
engine's one :class:`~tenplex_megatron.frontdoor.checkpointer.Checkpointer` (:func:`checkpointer`), as behind the
other front doors.
"""

from __future__ import annotations

import json
from typing import Any

from tenplex_megatron.engine import orphan
from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.load import LoadResult, load
from tenplex_megatron.engine.optimizer_json import jsonable, optimizer_json, restore_optimizer
from tenplex_megatron.engine.save import SaveResult, save
from tenplex_megatron.frontdoor.checkpointer import Checkpointer
from tenplex_megatron.integrations.deepspeed import native
from tenplex_megatron.integrations.deepspeed.zero import (
    DeepSpeedStateError,
    allocate_state,
    check_param_shapes,
    describe_engine,
    engine_layout,
    inner_optimizer,
    tied_copies,
)
from tenplex_megatron.storage import lease
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

    def layout(self) -> dict[str, Any]:
        return engine_layout(self.engine).to_json()

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

    def metadata(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "global_steps": int(engine.global_steps),
            "global_samples": int(engine.global_samples),
            "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
            "train_batch_size": int(engine.train_batch_size()),
            "zero_stage": engine_layout(engine).zero_stage,
            "optimizer": optimizer_json(inner_optimizer(engine)),
            "scheduler": _scheduler_json(engine),
            "extra": self.client_state,
        }

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


#: the engine's attribute holding its job's :class:`~tenplex_megatron.frontdoor.checkpointer.Checkpointer` (the
#: save directories claimed, their leases): it lives with the engine, so that a new engine in the same process (a job
#: built again) claims afresh
CHECKPOINTER_ATTRIBUTE = "_tenplex_checkpointer"

PROG = "tenplex_megatron.integrations.deepspeed"


def checkpointer(engine: Any) -> Checkpointer:
    """The engine's :class:`Checkpointer` (built at its first use, kept on the engine; a closed one is replaced);
    without ``engine``, a new one for this call."""
    ckpt: Checkpointer | None = getattr(engine, CHECKPOINTER_ATTRIBUTE, None)
    if ckpt is None or ckpt.closed:
        ckpt = Checkpointer.for_api(PROG)
        if engine is not None:
            setattr(engine, CHECKPOINTER_ATTRIBUTE, ckpt)
    return ckpt


def claim_save_dir(save_dir: str, job_id: str | None = None, take_over: bool = False,
                   ttl: float = lease.DEFAULT_TTL, *, engine: Any = None) -> None:
    """Collective, once per directory and ``engine``: rank 0 takes ``save_dir``'s lease for ``job_id`` (default:
    the launch's id, as the trainers derive it), the other ranks check it; another live job's lease is refused on
    every rank, naming the directory and its holder, before anything is written (``Checkpointer.claim_dir``).
    Without ``engine``: every call claims."""
    checkpointer(engine).claim_dir(save_dir, job_id, take_over, ttl)


def save_checkpoint(engine: Any, save_dir: str, client_state: dict[str, Any] | None = None,
                    keep: int | None = None, *, job_id: str | None = None, take_over: bool = False) -> SaveResult:
    """Collective: write the engine's full state under ``save_dir/iter_NNNNNNN`` (N = global steps) and commit it.

    The first save into ``save_dir`` claims its lease (:func:`claim_save_dir`): ``job_id`` names this job
    (``--tenplex-job-id``), ``take_over`` takes a lease whose holder may still live (``--tenplex-take-over``)."""
    orphan.die_with_agent()
    claim_save_dir(save_dir, job_id, take_over, engine=engine)
    return save(DeepSpeedAdapter(engine, client_state=client_state), save_dir, keep)


def load_checkpoint(engine: Any, load_dir: str, iteration: int | None = None, *, verify: bool = True,
                    seed: int = 1234, trust_pickles: bool = False) -> LoadResult:
    """Collective: load the newest complete checkpoint under ``load_dir`` into ``engine``, re-sharded.

    ``load_dir`` may hold tenplex checkpoints or DeepSpeed's own (``latest`` and
    ``global_stepN/``, read with ``weights_only=True`` unless ``trust_pickles``),
    written at any DP size. ``verify``: check tenplex checksums. ``seed``: for
    the RNG re-seed when the layout changed (always, for DeepSpeed's own files: they carry no RNG state).
    """
    orphan.die_with_agent()
    adapter = DeepSpeedAdapter(engine, seed, where=load_dir)
    if not native.is_deepspeed_checkpoint_dir(load_dir):
        ckpt = checkpointer(engine)
        sources = ckpt.sources(load_dir, memory=False) if iteration is None else None
        if sources is None or sources.tenplex is None:  # a given iteration (or nothing to load: the engine's error)
            return load(adapter, load_dir, iteration, strict=True, verify=verify)
        return ckpt.restart(lambda: adapter, lambda path: load(adapter, path, None, strict=True, verify=verify),
                            sources, load_dir, memory=False, verify=verify).result

    def opener() -> Any:  # runs before the adapter describes the engine for the load
        opened, adapter.source = native.open_native(native.step_dir(load_dir, iteration),
                                                           trust_pickles=trust_pickles)
        return opened

    return load(adapter, load_dir, None, strict=True, verify=False, opener=opener, source_format="deepspeed")
