"""DeepSpeed's layout and own fields of a tenplex checkpoint's metadata.json, as its adapter hands them to a save."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tenplex_megatron.integrations.deepspeed.zero import DeepSpeedStateError


@dataclass(frozen=True)
class DeepSpeedLayout:
    """A DeepSpeed job's layout: its DP and PP sizes and ZeRO stage (no tensor parallelism: ``tp`` is always 1)."""

    dp: int
    zero_stage: int
    pp: int = 1

    def to_json(self) -> dict[str, int]:
        """The layout as metadata.json holds it (``tp`` 1, as DeepSpeed's own checkpoints opened in place)."""
        return {"tp": 1, "pp": self.pp, "dp": self.dp, "zero_stage": self.zero_stage}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DeepSpeedLayout:
        """The layout a DeepSpeed checkpoint recorded."""
        try:
            return cls(dp=int(d["dp"]), zero_stage=int(d["zero_stage"]), pp=int(d.get("pp") or 1))
        except (KeyError, TypeError, ValueError) as e:
            raise DeepSpeedStateError(f"not a DeepSpeed layout: {dict(d)} ({type(e).__name__}: {e})") from None

    def __str__(self) -> str:
        return f"dp={self.dp},zero={self.zero_stage}" + (f",pp={self.pp}" if self.pp > 1 else "")


@dataclass(frozen=True)
class DeepSpeedRecord:
    """What a DeepSpeed engine adds to metadata.json: its step and sample counters, batch size and ZeRO stage, its
    optimizer's hyper-parameters and step, its LR scheduler, and the caller's ``client_state``."""

    global_steps: int
    global_samples: int
    skipped_steps: int
    train_batch_size: int
    zero_stage: int
    optimizer: Mapping[str, Any]
    scheduler: Mapping[str, Any] | None
    extra: Mapping[str, Any]  # the caller's client_state, handed back as ``LoadResult.extra``

    def to_json(self) -> dict[str, Any]:
        """The fields as metadata.json holds them."""
        return {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
            "train_batch_size": self.train_batch_size,
            "zero_stage": self.zero_stage,
            "optimizer": dict(self.optimizer),
            "scheduler": None if self.scheduler is None else dict(self.scheduler),
            "extra": dict(self.extra),
        }
