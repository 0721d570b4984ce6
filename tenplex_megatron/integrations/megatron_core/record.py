"""megatron-core's own fields of a tenplex checkpoint's metadata.json, as the adapter hands them to a save."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MegatronCoreRecord:
    """What a megatron-core job adds to metadata.json: its data position, model spec and padded vocabulary, its
    optimizer's hyper-parameters and step, its LR schedule, the caller's ``extra``, the writing megatron-core."""

    consumed_samples: int
    model: Mapping[str, Any]  # the model spec (vocabulary, seed, shape): what a load and ``plan`` check
    padded_vocab_size: int
    use_distributed_optimizer: bool
    optimizer: Mapping[str, Any] | None  # param groups and step; None: saved without it (--no-save-optim)
    scheduler: Mapping[str, Any] | None
    extra: Mapping[str, Any]  # the caller's JSON, handed back as ``LoadResult.extra``
    megatron_core: Mapping[str, str]  # its version and state layout (a load checks them)

    @property
    def weights_only(self) -> bool:
        """Saved without the optimizer: a load knows it holds none."""
        return self.optimizer is None

    def to_json(self) -> dict[str, Any]:
        """The fields as metadata.json holds them (``weights_only`` only when true)."""
        return {
            "consumed_samples": self.consumed_samples,
            "model": dict(self.model),
            "padded_vocab_size": self.padded_vocab_size,
            "use_distributed_optimizer": self.use_distributed_optimizer,
            **({"weights_only": True} if self.weights_only else {}),
            "optimizer": None if self.optimizer is None else dict(self.optimizer),
            "scheduler": None if self.scheduler is None else dict(self.scheduler),
            "extra": dict(self.extra),
            "megatron_core": dict(self.megatron_core),
        }
