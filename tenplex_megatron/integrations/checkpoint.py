"""Save a megatron-core job as a tenplex checkpoint, and load one at any new TP/PP/DP layout.

The job is described as live chunks (``describe.py``, from megatron-core's own
sharding metadata); ``ptc_checkpoint`` writes and re-shards them. This module
adds megatron's non-tensor state: consumed samples, model spec, optimizer
hyper-parameters and step, LR schedule, RNG (exact on the same layout,
re-seeded otherwise).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tenplex_megatron.integrations import rng
from tenplex_megatron.integrations.describe import describe_job
from tenplex_megatron.integrations.optimizer_state import allocate_state, optimizer_state_json, restore_optimizer_state
from tenplex_megatron.integrations.ptc_checkpoint import LocalChunk, SaveResult, load_chunks, rank, save_chunks
from tenplex_megatron.plan.layout import ParallelLayout

__all__ = ["LoadResult", "SaveResult", "load_checkpoint", "save_checkpoint"]


@dataclass(frozen=True)
class LoadResult:
    path: str
    iteration: int
    source_layout: ParallelLayout
    bytes_read: int  # by this rank: copied into its tensors
    bytes_filled: int
    tensors: int
    seconds: float
    rng_exact: bool
    bytes_verified: int = 0  # stored bytes whose block checksums this rank checked (read for that)
    bytes_unverified: int = 0  # bytes copied that no checksum covered (``verify=False``)


def save_checkpoint(job: Any, save_dir: str, extra: dict[str, Any] | None = None, keep: int | None = None) -> SaveResult:
    """Collective: write the job's full state under ``save_dir/iter_NNNNNNN`` and commit it.

    ``keep``: after the commit, delete all but the newest ``keep`` complete checkpoints.
    """
    _, chunks = describe_job(job)

    def metadata(infos: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "consumed_samples": job.consumed_samples,
            "model": job.spec.to_json(),
            "padded_vocab_size": job.padded_vocab_size,
            "use_distributed_optimizer": job.use_distributed_optimizer,
            "optimizer": optimizer_state_json(job.optimizer),
            "scheduler": job.scheduler.state_dict(),
            "rng": {str(r): i["rng"] for r, i in enumerate(infos)},
            "extra": extra or {},
        }

    return save_chunks(chunks, save_dir, job.iteration, job.layout.to_json(), {"rng": rng.capture()}, metadata, keep)


def load_checkpoint(
    job: Any, load_dir: str, iteration: int | None = None, strict: bool = True, verify: bool = True
) -> LoadResult:
    """Collective: load the newest complete checkpoint under ``load_dir`` re-sharded to ``job``'s layout.

    ``verify``: check the CRC-32 of every stored block this rank reads from (only those blocks, not whole chunks).
    """
    t0 = time.perf_counter()

    def describe(meta: dict[str, Any]) -> list[LocalChunk]:
        allocate_state(job.optimizer)
        return describe_job(job)[1]

    def restore(meta: dict[str, Any]) -> None:
        restore_optimizer_state(job.optimizer, meta["optimizer"])
        job.scheduler.load_state_dict(meta["scheduler"])
        job.iteration = int(meta["iteration"])
        job.consumed_samples = int(meta["consumed_samples"])

    loaded = load_chunks(load_dir, iteration, describe, restore, strict, verify)
    meta = loaded.metadata
    src_layout = ParallelLayout.from_json(meta["layout"])
    me = str(rank())
    exact = src_layout == job.layout and me in meta["rng"]
    if exact:
        rng.restore(meta["rng"][me])
    else:
        rng.reseed(job.spec.seed, job.iteration)
    return LoadResult(
        path=loaded.path,
        iteration=job.iteration,
        source_layout=src_layout,
        bytes_read=loaded.stats.bytes_read,
        bytes_filled=loaded.stats.bytes_filled,
        tensors=loaded.tensors,
        seconds=time.perf_counter() - t0,
        rng_exact=exact,
        bytes_verified=loaded.stats.bytes_verified,
        bytes_unverified=loaded.stats.bytes_unverified,
    )
