"""The one resume sequence of every front door, in its one order (``docs/design.md``, "The resume sequence"):

1. **scoped**: with ``--tenplex``, a load Megatron-LM's checkpoint flags narrow (``--ckpt-step``, ``--finetune``,
   ``--no-load-optim``, ``--no-load-rng``, ``--pretrained-checkpoint``): the copy they name, no fallback;
2. **memory**: the newest snapshot complete in the live nodes' host memory (``--tenplex-memory``);
3. **durable**: tenplex's newest complete checkpoint under the load directory, then the previous ones past damage
   (``memory/fallback.py``: a damaged copy falls back to the next, each named);
4. **adopted**: with ``--tenplex``, Megatron's own checkpoint there (``torch_dist`` or legacy ``torch``);
5. **hf**: ``--tenplex-init-from-hf``'s weights when there is no checkpoint at all;
6. **native**: without ``--tenplex``, Megatron's own checkpoint, left to the front door's own loader;
7. **scratch**: nothing to load (refused with ``--exit-on-missing-checkpoint``).

The engine comes in as an :class:`Engine` (``frontdoor/engines.py``), so that every front door shares the order.
Host-memory snapshots newer than where the job restarted (a timeline it left) are discarded once the sequence
has decided, never by a query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tenplex_megatron.engine.adapter import Adapter
from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.engine.save import SaveResult
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.frontdoor import ckpt_flags, restart_sources
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.memory.restart import MemoryLoadResult, discard_after
from tenplex_megatron.memory.state import MemoryTier
from tenplex_megatron.plan.megatron_ckpt_flags import LoadScope, Retention, SaveScope
from tenplex_megatron.storage import lease
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata

KINDS = ("scoped", "memory", "durable", "adopted", "hf", "native", "scratch")


class Engine(Protocol):
    """What a front door supplies for its framework: a fresh adapter over the live job, and its loads."""

    def adapter(self, scope: SaveScope | None = None) -> Adapter:
        """A fresh adapter over the live job (a host-memory load; a snapshot of what ``scope`` keeps: without the
        optimizer, the adapter describes and records none)."""
        ...

    def load(self, path: str, scope: LoadScope | None = None,
             metadata: CheckpointMetadata | None = None) -> LoadResult:
        """Collective: tenplex's durable checkpoint ``path`` into the job, re-sharded, ``scope`` taken back
        (``metadata``: its record, where the restart's query read it already)."""
        ...

    def adopt(self, path: str, scope: LoadScope | None = None) -> LoadResult:
        """Collective: Megatron's own checkpoint ``path`` into the job, re-sharded (refused where it cannot)."""
        ...

    def init_hf(self, hf_dir: str) -> Any:
        """Collective: the model's weights from a Hugging Face checkpoint (returns what it read)."""
        ...

    def save(self, save_dir: str, keep: int | Retention | None, scope: SaveScope, fence: lease.Fence) -> SaveResult:
        """Collective: a durable tenplex checkpoint of the job under ``save_dir``, retention applied after, every
        destructive step under the writer's ``fence``."""
        ...


class MissingCheckpointError(TenplexError, FileNotFoundError):
    """``--exit-on-missing-checkpoint``: the load directory holds no checkpoint."""


@dataclass(frozen=True)
class Resumed:
    """Where the resume sequence took the job's state from: its ``kind`` (:data:`KINDS`), the engine's result
    (None for hf, native and scratch), the memory load's, the path of Megatron's own checkpoint left to a native
    loader, the scope of a scoped load, what Hugging Face weights were read, and every damaged copy skipped."""

    kind: str
    result: LoadResult | None = None
    memory: MemoryLoadResult | None = None
    native: str | None = None
    scope: LoadScope = LoadScope()
    hf: Any = None
    skipped: tuple[str, ...] = ()

    @property
    def loaded(self) -> bool:
        """Whether the sequence loaded a checkpoint into the job (the native kind is the front door's to load)."""
        return self.result is not None


def scoped(config: JobConfig, engine: Engine, load_dir: str | None) -> Resumed | None:
    """Collective: step 1, a load the checkpoint flags narrow; None when they do not, or nothing is there."""
    if not config.tenplex:
        return None
    source, scope = ckpt_flags.pretrained(load_dir, config.load_scope, config.pretrained, config.finetune_scope)
    if not source or scope == LoadScope():
        return None
    res = ckpt_flags.load_scoped(engine, source, scope)
    return None if res is None else Resumed("scoped", res, scope=scope)


def from_sources(config: JobConfig, engine: Engine, tier: MemoryTier | None, sources: restart_sources.Sources,
                 load_dir: str | None) -> Resumed:
    """Collective: steps 2 to 7 over the sources a query found (``restart_sources.find_sources``)."""
    if sources.ours:
        got = restart_sources.restart(engine.adapter, engine.load, tier, sources, load_dir, verify=config.verify)
        kind = "memory" if got.memory is not None else "durable"
        return Resumed(kind, got.result, got.memory, skipped=got.skipped)
    if sources.megatron is not None and config.tenplex:
        return Resumed("adopted", engine.adopt(sources.megatron))
    if sources.megatron is not None:
        return Resumed("native", native=sources.megatron)
    if config.init_from_hf:
        return Resumed("hf", hf=engine.init_hf(config.init_from_hf))
    if load_dir and config.exit_on_missing:
        raise MissingCheckpointError(f"--exit-on-missing-checkpoint: no checkpoint under {load_dir}")
    return Resumed("scratch")


def forget_other_timelines(tier: MemoryTier | None, resumed: Resumed) -> None:
    """Collective: the snapshots newer than the restart point discarded (all of them where the job started from
    anything but its own state), so that the job never jumps back to a timeline it left."""
    if tier is None:
        return
    ours = resumed.kind in ("memory", "durable") and resumed.result is not None
    discard_after(tier, resumed.result.iteration if ours else None)
