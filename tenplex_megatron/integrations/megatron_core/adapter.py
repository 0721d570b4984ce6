"""megatron-core as an engine :class:`~tenplex_megatron.engine.adapter.Adapter`, and the public save/load calls.

Tensors are described from megatron-core's own sharding metadata
(``sharded.py``); this module adds megatron's non-tensor state: iteration,
consumed samples, model spec, padded vocabulary, optimizer hyper-parameters
and step, LR schedule. Two ways in:

- :func:`live_job` sees a megatron-core model (or list of model chunks), its optimizer and scheduler as a job:
  the public API's (``frontdoor/api.py``: NeMo-style or custom training loops, exported at the package top level).
- :func:`save_job` / :func:`load_job` take a job object with those attributes
  (the reference trainer's ``GPTJob``, the Megatron-LM hook's :class:`LiveJob`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from megatron.core import parallel_state

from tenplex_megatron import mcore_versions
from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.load import LoadResult, load
from tenplex_megatron.engine.save import SaveResult, save
from tenplex_megatron.execute.collective import rank
from tenplex_megatron.integrations.megatron_core import extra_state
from tenplex_megatron.integrations.megatron_core.grouped import expert_module_kind
from tenplex_megatron.integrations.megatron_core.legacy import open_legacy
from tenplex_megatron.integrations.megatron_core.native import opener_for
from tenplex_megatron.integrations.megatron_core.optimizer import (
    allocate_state,
    is_distributed_optimizer,
    never_stepped,
    optimizer_state_json,
    restore_optimizer_state,
    sub_optimizers,
)
from tenplex_megatron.integrations.megatron_core.pipeline import check_chunks, config_split
from tenplex_megatron.integrations.megatron_core.record import MegatronCoreRecord
from tenplex_megatron.integrations.megatron_core.sharded import ModelArgumentError, describe_job, model_chunks, unwrap
from tenplex_megatron.plan.experts import check_expert_kind
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.megatron_ckpt_flags import LoadScope, Retention, SaveScope
from tenplex_megatron.plan.planner import PlanError
from tenplex_megatron.storage import lease
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.formats import is_legacy_megatron_checkpoint
from tenplex_megatron.storage.source import Metadata

__all__ = ["LiveJob", "LiveSpec", "LoadResult", "MegatronCoreAdapter", "MegatronCoreRecord", "SaveResult",
           "adopt_megatron_checkpoint", "live_job", "load_job", "save_job"]


@dataclass(frozen=True)
class LiveSpec:
    """What tenplex records about a model it did not build: real vocabulary rows, seed, and any other args."""

    vocab_size: int
    seed: int
    args: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "seed": self.seed, **self.args}


@dataclass
class LiveJob:
    """A megatron-core model, optimizer and scheduler seen through the attributes the adapter reads."""

    model: list[Any]
    optimizer: Any
    scheduler: Any
    layout: ParallelLayout
    spec: Any  # vocab_size, seed, to_json()
    padded_vocab_size: int
    use_distributed_optimizer: bool
    iteration: int = 0
    consumed_samples: int = 0
    trust_pickles: bool = False  # hand Transformer Engine's extra state over unchecked (``extra_state.py``)


class MegatronCoreAdapter:
    """A megatron-core job (model chunks, DDP, distributed or plain optimizer, scheduler) for the engine."""

    framework = "megatron-core"
    rng_tracker = True

    def __init__(self, job: Any, extra: dict[str, Any] | None = None, *, load_scope: LoadScope | None = None,
                 save_scope: SaveScope | None = None):
        self.job = job
        self.extra = extra or {}
        self.load_scope = load_scope or LoadScope()  # what a load takes back (the optimizer, a fine-tune's reset)
        self.save_scope = save_scope or SaveScope()  # what a save writes (the optimizer)

    @property
    def seed(self) -> int:
        return int(self.job.spec.seed)

    def layout(self) -> ParallelLayout:
        return self.job.layout

    def iteration(self) -> int:
        return int(self.job.iteration)

    def describe(self) -> list[LocalChunk]:
        return describe_job(self.job)[1] if self.save_scope.optimizer else model_chunks(self.job)

    def describe_for_load(self, metadata: Metadata) -> list[LocalChunk]:
        # before anything is allocated or loaded: a state layout this megatron-core does not reproduce is refused,
        # and so is another mixture of experts (expert count, router kind, grouped or sequential experts)
        mcore_versions.check_checkpoint(metadata.record("megatron_core"), "metadata.json")
        check_moe_record(metadata, self.job.spec.to_json())
        check_expert_kind("metadata.json", list(metadata.tensor_keys),
                          expert_module_kind([unwrap(m) for m in self.job.model]))
        if not self.load_scope.optimizer:  # the weights alone: the optimizer stays as built (no state yet)
            return model_chunks(self.job)
        if not never_stepped(metadata.record("optimizer")) or stores_moments(metadata):
            allocate_state(self.job.optimizer)
        # else: Adam makes its state at its first step taken, and had none when saved (a save at iteration 0, or
        # after fp16 steps that the loss scaler all skipped): the job's stays unmade too, as in an uninterrupted run
        return describe_job(self.job)[1]

    def rank_local(self) -> dict[str, Any]:
        """Transformer Engine's ``_extra_state`` of this rank's modules, kept per rank (``extra_state.py``)."""
        return extra_state.collect(self.job)

    def prepare_rank_local(self, metadata: Metadata, read: Any) -> Any:
        """The saved ``_extra_state`` back at the same layout, else left out with one warning."""
        return extra_state.prepare(self.job, metadata, read, rank())

    def metadata(self) -> MegatronCoreRecord:
        job = self.job
        full = self.save_scope.optimizer  # --no-save-optim: no optimizer, no schedule (a load knows it holds none)
        return MegatronCoreRecord(
            consumed_samples=int(job.consumed_samples),
            model=job.spec.to_json(),
            padded_vocab_size=int(job.padded_vocab_size),
            use_distributed_optimizer=bool(job.use_distributed_optimizer),
            optimizer=optimizer_state_json(job.optimizer) if full else None,
            scheduler=job.scheduler.state_dict() if job.scheduler is not None and full else None,
            extra=self.extra,
            megatron_core=mcore_versions.record(),
        )

    def restore(self, metadata: Metadata) -> None:
        job, scope = self.job, self.load_scope
        if scope.optimizer:
            restore_optimizer_state(job.optimizer, metadata.record("optimizer"))
            if job.scheduler is not None and metadata.record("scheduler") is not None:
                job.scheduler.load_state_dict(metadata.record("scheduler"))
        job.iteration = 0 if scope.finetune else metadata.require_iteration()
        job.consumed_samples = 0 if scope.finetune else metadata.data_position

    def after_load(self, metadata: Metadata) -> None:
        if not self.load_scope.optimizer:  # Megatron-LM's rule: main (fp32) weights from the loaded model weights
            for opt in sub_optimizers(self.job.optimizer):
                reload = getattr(opt, "reload_model_params", None)
                if reload is not None:
                    reload()


def save_job(job: Any, save_dir: str, extra: dict[str, Any] | None = None, keep: int | Retention | None = None, *,
             scope: SaveScope | None = None, fence: lease.Fence = lease.no_fence) -> SaveResult:
    """Collective: write the job's full state under ``save_dir/iter_NNNNNNN`` and commit it.

    ``keep``: after the commit, delete all but the newest ``keep`` complete checkpoints (or what a
    :class:`Retention` keeps). ``scope``: without the optimizer (a weights-only checkpoint) or the RNG state.
    ``fence``: the writer's lease (``storage/lease.py``).
    """
    scope = scope or SaveScope()
    return save(MegatronCoreAdapter(job, extra, save_scope=scope), save_dir, keep, rng_state=scope.rng, fence=fence)


def load_job(job: Any, load_dir: str, iteration: int | None = None, *, strict: bool = True,
             verify: bool = True, scope: LoadScope | None = None,
             metadata: CheckpointMetadata | None = None) -> LoadResult:
    """Collective: load the newest complete checkpoint under ``load_dir`` re-sharded to ``job``'s layout.

    ``verify``: check the CRC-32 of every stored block this rank reads from (only those blocks, not whole chunks).
    ``scope``: a given iteration, the weights alone, no RNG, a fine-tune (iteration 0, fresh data position).
    ``metadata``: ``load_dir`` is the checkpoint and this its record, read already.
    """
    return load(MegatronCoreAdapter(job, load_scope=scope), load_dir, iteration, strict=strict, verify=verify,
                scope=scope, metadata=metadata)


def adopt_megatron_checkpoint(job: Any, path: str, *, trust_pickles: bool = False,
                              scope: LoadScope | None = None) -> LoadResult:
    """Collective: load Megatron's own checkpoint directory ``path`` (``torch_dist`` with any optimizer format, or
    the legacy ``torch`` format; any saving layout) into ``job`` through tenplex's planner and executor, each rank
    reading only its part. ``trust_pickles``: unpickle Megatron's files fully (default: plain classes only).
    ``scope``: the weights alone, no RNG, a fine-tune (as :func:`load_job`)."""
    opener = (partial(open_legacy, path, job, trust_pickles=trust_pickles) if is_legacy_megatron_checkpoint(path)
              else opener_for(path, job, trust_pickles=trust_pickles))
    return load(MegatronCoreAdapter(job, load_scope=scope), path, strict=True, verify=False, opener=opener,
                source_format="megatron", scope=scope)


#: (model record field, what it is, its default): a checkpoint whose experts or router differ from the model's
MOE_FIELDS = (("num_experts", "routed experts per MoE layer", None),
              ("moe_router_enable_expert_bias", "router's expert bias (aux-loss-free balancing)", False),
              ("moe_router_score_function", "router's score function", "softmax"))


def check_moe_record(metadata: Metadata, model: dict[str, Any]) -> None:
    """Refuse a checkpoint whose experts or router are of another kind than the model's, naming the router tensor
    and both values (before any state is touched; a record without MoE fields is a dense model's)."""
    saved = metadata.model
    if saved is None:  # a Megatron checkpoint without saved args: its tensors are checked against the model's
        return
    if not (saved.get("num_experts") or model.get("num_experts")):
        return
    tensors = metadata.tensor_keys
    router = next((k for k in tensors if k.endswith("mlp.router.weight")), "decoder.layers.mlp.router.weight")
    for field_name, what, default in MOE_FIELDS:
        if field_name not in saved:  # a record written before the field existed
            continue
        a, b = saved.get(field_name, default), model.get(field_name, default)
        if (a or default) != (b or default):
            raise PlanError(f"tensor {router!r}: the checkpoint's {what} ({field_name}) is {a}, the model's is {b}: "
                            "a checkpoint of another mixture-of-experts model")


def stores_moments(metadata: Metadata) -> bool:
    """Whether a tenplex checkpoint's metadata lists Adam moments (a never-stepped optimizer's may, if saved by an
    older version that allocated them: then the job makes them too, to be filled)."""
    return any(k.startswith("optimizer.state.exp_avg") for k in metadata.tensor_keys)


def current_layout(chunks: list[Any]) -> ParallelLayout:
    """The running job's layout from megatron-core's parallel state: TP, PP, DP, VPP (one model chunk per virtual
    stage), sequence parallelism (from the model's config), EP and expert TP, and the pipeline split (the config's;
    each chunk's layers checked against it)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if len(chunks) != vpp:
        raise ModelArgumentError(f"tenplex: {len(chunks)} model chunks, but megatron-core's virtual pipeline size is "
                                 f"{vpp}: pass every model chunk (one per virtual stage), in order")
    config = getattr(unwrap(chunks[0]), "config", None)
    tp, pp = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size()
    layout = ParallelLayout(tp, pp, parallel_state.get_data_parallel_world_size(), vpp=vpp,
                            sp=bool(getattr(config, "sequence_parallel", False)) and tp > 1,
                            ep=parallel_state.get_expert_model_parallel_world_size() or 1,
                            etp=parallel_state.get_expert_tensor_parallel_world_size() or tp,
                            split=config_split(config, pp, vpp))
    check_chunks(chunks, layout, parallel_state.get_pipeline_model_parallel_rank())
    return layout


def live_job(model: Any, optimizer: Any, scheduler: Any, vocab_size: int | None = None, seed: int = 1234,
             args: dict[str, Any] | None = None) -> LiveJob:
    """A :class:`LiveJob` over a model built by anyone: the layout from megatron-core's parallel state, the padded
    vocabulary from the GPTModel, the real vocabulary rows from ``vocab_size`` (default: all rows are real)."""
    chunks = list(model) if isinstance(model, list | tuple) else [model]
    layout = current_layout(chunks)
    padded = int(getattr(unwrap(chunks[0]), "vocab_size", 0) or 0)
    if padded <= 0:
        raise ModelArgumentError("tenplex: the model has no vocab_size attribute (is it a megatron-core GPTModel?)")
    real = padded if vocab_size is None else int(vocab_size)
    if not 0 < real <= padded:
        raise ModelArgumentError(f"tenplex: vocab_size={real} must be between 1 and the model's padded vocabulary "
                                 f"{padded}")
    distopt = any(is_distributed_optimizer(o) for o in sub_optimizers(optimizer))
    return LiveJob(chunks, optimizer, scheduler, layout, LiveSpec(real, int(seed), dict(args or {})), padded, distopt)
