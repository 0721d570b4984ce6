"""The one interface between the engine and a framework (megatron-core, DeepSpeed, ...).

An adapter turns the framework's live state into :class:`LocalChunk`s and back
and owns the framework's non-tensor state; the engine does everything
collective (gathering, writing, committing, planning, verifying, copying) and
the policies that are the same for every framework (RNG, optimizer JSON).
``describe``, ``describe_for_load``, ``metadata`` and ``restore`` run inside the
engine's phases and must not call collectives (a rank that failed earlier would
leave its peers in a mismatched one); collective work goes in ``after_load``.

Two optional methods carry rank-local state (``engine/rank_local.py``: opaque bytes only the same rank can take
back, such as Transformer Engine's ``_extra_state``): ``rank_local() -> {entry name: (flat uint8 tensor, JSON
record)}`` at save, and ``prepare_rank_local(metadata, read) -> (callable applied after restore) | None`` at load
(``metadata``: the checked record, ``storage/source.py``'s ``Metadata``, as every load method gets it: tenplex's
own fields typed, a framework's own records through ``metadata.record(name)``).

What an adapter hands the engine for metadata.json is typed: its layout (a :class:`LayoutRecord`: megatron-core's
``ParallelLayout``, DeepSpeed's ``DeepSpeedLayout``) and its own fields (a :class:`JsonRecord`), each a frozen
record whose ``to_json`` is what the checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.storage.source import Metadata


class JsonRecord(Protocol):
    """A frozen record metadata.json holds as JSON (an adapter's own fields)."""

    def to_json(self) -> dict[str, Any]:
        """The record as metadata.json holds it."""
        ...


class LayoutRecord(Protocol):
    """A framework's parallel layout: recorded at save, compared at load, handed back as ``LoadResult.layout``."""

    def to_json(self) -> dict[str, Any]:
        """The layout as metadata.json holds it (what a load compares for the RNG policy)."""
        ...

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LayoutRecord:
        """The layout a checkpoint recorded, of this type."""
        ...


class Adapter(Protocol):
    """What a framework supplies to :func:`engine.save.save` and :func:`engine.load.load`."""

    framework: str  # recorded in metadata.json; a load refuses another framework's checkpoint
    seed: int  # for the RNG re-seed when the layout changed
    rng_tracker: bool  # capture megatron-core's model-parallel RNG tracker too

    def layout(self) -> LayoutRecord:
        """The job's parallel layout: recorded at save, compared at load (the RNG policy)."""
        ...

    def iteration(self) -> int:
        """The step a save is named after; after :meth:`restore`, the step the load resumed."""
        ...

    def describe(self) -> list[LocalChunk]:
        """Every chunk of state this rank holds, for a save."""
        ...

    def describe_for_load(self, metadata: Metadata) -> list[LocalChunk]:
        """Check the checkpoint fits this job (naming what does not), allocate missing state, describe it."""
        ...

    def metadata(self) -> JsonRecord:
        """The framework's non-tensor state for metadata.json (called on rank 0 during the commit)."""
        ...

    def restore(self, metadata: Metadata) -> None:
        """Restore the non-tensor state after the tensors were copied in (local work: no collective)."""
        ...

    def after_load(self, metadata: Metadata) -> None:
        """Collective work once every rank has restored (DeepSpeed re-gathers its model weights); often nothing."""
        ...
