"""The megatron-core engine of the resume sequence and the save (``frontdoor/resume.py``'s ``Engine``): the
reference trainer's ``GPTJob`` and the Megatron-LM hook's ``LiveJob`` alike, through megatron-core's adapter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.engine.save import SaveResult
from tenplex_megatron.integrations.hf.load import init_from_hf
from tenplex_megatron.integrations.megatron_core.adapter import (
    MegatronCoreAdapter,
    adopt_megatron_checkpoint,
    load_job,
    save_job,
)
from tenplex_megatron.plan.hf_map import ModelFacts
from tenplex_megatron.plan.megatron_ckpt_flags import LoadScope, Retention, SaveScope
from tenplex_megatron.storage import lease
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata


@dataclass(frozen=True)
class MegatronCoreEngine:
    """A megatron-core job (``job``: model chunks, optimizer, scheduler, layout, spec) seen by the Checkpointer;
    ``extra``: JSON a save records beside the state (Megatron-LM's FLOP count), ``verify`` and ``trust_pickles`` as
    the job's configuration says."""

    job: Any
    verify: bool = True
    trust_pickles: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    strict: bool = True  # every tensor of the checkpoint must have a place in the job

    def adapter(self, scope: SaveScope | None = None) -> MegatronCoreAdapter:
        """A fresh adapter over the job (a host-memory load, or a snapshot of what ``scope`` keeps)."""
        return MegatronCoreAdapter(self.job, dict(self.extra), save_scope=scope)

    def load(self, path: str, scope: LoadScope | None = None,
             metadata: CheckpointMetadata | None = None) -> LoadResult:
        """Collective: tenplex's checkpoint ``path`` into the job, re-sharded, ``scope`` taken back (``metadata``:
        its record, read already)."""
        return load_job(self.job, path, strict=self.strict, verify=self.verify, scope=scope, metadata=metadata)

    def adopt(self, path: str, scope: LoadScope | None = None) -> LoadResult:
        """Collective: Megatron's own checkpoint ``path`` into the job, re-sharded."""
        return adopt_megatron_checkpoint(self.job, path, trust_pickles=self.trust_pickles, scope=scope)

    def init_hf(self, hf_dir: str) -> Any:
        """Collective: the model's weights from the Hugging Face checkpoint ``hf_dir`` (checked against the job's
        model)."""
        return init_from_hf(self.job, hf_dir, ModelFacts.from_model_json(self.job.spec.to_json()))

    def save(self, save_dir: str, keep: int | Retention | None, scope: SaveScope,
             fence: lease.Fence = lease.no_fence) -> SaveResult:
        """Collective: a durable tenplex checkpoint of the job under ``save_dir``, ``extra`` recorded, under the
        writer's ``fence``."""
        return save_job(self.job, save_dir, dict(self.extra) or None, keep, scope=scope, fence=fence)

