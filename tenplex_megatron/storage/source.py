"""The protocol the executor reads stored chunks through, whatever wrote them.

A source hands out each stored chunk as a flat tensor and, where its format
records checksums, queues and checks the blocks a load will read. tenplex's
own safetensors shards (``storage.source_files.SourceFiles``) verify; another
framework's files (DeepSpeed's ``global_stepN``, a Hugging Face directory)
carry no checksums and inherit :class:`UncheckedSource`'s no-ops, so the
executor never asks what kind of source it has.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tenplex_megatron.plan.ptc import PTC, StoredChunk
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata, RankLocalSection
from tenplex_megatron.storage.files import CheckpointFileError

if TYPE_CHECKING:  # types only: torch and the planner's Piece are not needed to define the protocol
    import torch

    from tenplex_megatron.plan.planner import Piece
    from tenplex_megatron.storage.parallel_read import Extent, ReadPlan


class Source(Protocol):
    """Stored chunks as flat tensors, plus the checksum hooks of formats that have them."""

    readers: dict[str, Any]  # files opened so far (reported as ExecStats.files)

    @property
    def verifying(self) -> bool:
        """Whether :meth:`queue` / :meth:`check` do anything (False: every byte read counts as unverified)."""
        ...

    @property
    def bytes_verified(self) -> int: ...

    def flat(self, sc: StoredChunk) -> torch.Tensor: ...

    def queue(self, sc: StoredChunk, flat: torch.Tensor, piece: Piece, todo: list, source: int) -> None:
        """Queue the checksum blocks ``piece`` reads of ``flat`` (``sc``'s data) into ``todo``."""
        ...

    def check(self, sc: StoredChunk, flat: torch.Tensor, piece: Piece) -> bool:
        """Verify what ``piece`` reads (if not already done); True if a checksum covers it."""
        ...

    def run(self, todo: list) -> None:
        """Check the queued blocks."""
        ...

    def extent(self, sc: StoredChunk) -> Extent | None:
        """Where ``sc``'s bytes lie in a file, for the parallel reader (None: hand them out through :meth:`flat`)."""
        ...

    def read_done(self, plan: ReadPlan) -> None:
        """The parallel reader carried out ``plan``: its checked blocks count as verified."""
        ...

    def close(self) -> None: ...


class UncheckedSource:
    """Base for sources whose format records no checksums: the verification hooks do nothing."""

    readers: dict[str, Any]
    verifying = False
    bytes_verified = 0

    def queue(self, sc: StoredChunk, flat: Any, piece: Any, todo: list, source: int) -> None:
        return None

    def check(self, sc: StoredChunk, flat: Any, piece: Any) -> bool:
        return False

    def run(self, todo: list) -> None:
        return None

    def extent(self, sc: StoredChunk) -> Any:
        return None

    def read_done(self, plan: Any) -> None:
        return None


@dataclass(frozen=True)
class ForeignMetadata:
    """What a checkpoint of another format (Megatron's own, DeepSpeed's, Hugging Face's) says beside its tensors:
    the record its opener builds from that format's files. The engine reads its ``layout`` and ``consumed_samples``;
    ``raw`` holds the rest in that format's adapter's keys (optimizer, scheduler, iteration, config)."""

    format: str
    layout: Mapping[str, Any]
    consumed_samples: int
    raw: Mapping[str, Any]

    @property
    def data_position(self) -> int:
        """The samples consumed when it was saved."""
        return self.consumed_samples

    @property
    def iteration(self) -> int | None:
        """The iteration the format records (its opener's ``iteration``), None where it records none."""
        it = self.raw.get("iteration")
        return None if it is None else int(it)

    def require_iteration(self) -> int:
        if self.iteration is None:
            raise CheckpointFileError(f"{self.format} checkpoint: iteration: missing")
        return self.iteration

    @property
    def model(self) -> Mapping[str, Any] | None:
        """The model's settings as the format saved them (Megatron's args), None where it saved none."""
        return self.raw.get("model")

    @property
    def framework(self) -> None:
        """No tenplex framework record: the opener's format names what wrote it."""
        return None

    @property
    def tensor_keys(self) -> tuple[str, ...]:
        """None listed: a foreign checkpoint's tensors are the opener's PTC, checked against the model's."""
        return ()

    def record(self, name: str) -> Any:
        """The opener's record ``name`` in its adapter's keys (optimizer, scheduler, counters), None where absent."""
        return self.raw.get(name)

    @property
    def rank_local(self) -> Mapping[int, RankLocalSection]:
        """No rank-local state: only tenplex's saves keep it."""
        return {}

    @property
    def rng(self) -> Mapping[int, Mapping[str, Any]]:
        """No RNG streams: a foreign format's load re-seeds."""
        return {}

    @classmethod
    def of(cls, fmt: str, raw: dict[str, Any], consumed_samples: int = 0) -> ForeignMetadata:
        """The record of ``raw`` (an opener's own dict, with its ``layout``)."""
        return cls(fmt, dict(raw["layout"]), consumed_samples, raw)


#: what a load reads beside the tensors: tenplex's own metadata.json, checked, or a foreign format's record
Metadata = CheckpointMetadata | ForeignMetadata


@dataclass(frozen=True)
class Opened:
    """A checkpoint found and opened for reading: its directory, metadata, PTC and chunk source."""

    path: str
    metadata: Metadata
    ptc: PTC
    files: Source
