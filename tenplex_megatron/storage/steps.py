"""A given iteration's tenplex checkpoint (``--ckpt-step``), or an error that lists the iterations there."""

from __future__ import annotations

from tenplex_megatron.storage.directory import (
    committed_iterations,
    find_checkpoint,
    read_checkpoint_metadata,
)
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.formats import is_tenplex_checkpoint


def checkpoint_at(load: str, iteration: int, flag: str = "--ckpt-step") -> str:
    """The complete tenplex checkpoint of ``iteration`` under ``load`` (or ``load`` itself, if it is that one);
    else an error naming ``flag`` and listing the iterations there."""
    if is_tenplex_checkpoint(load):
        saved = read_checkpoint_metadata(load).iteration
        if saved == iteration:
            return load
        raise CheckpointFileError(f"{flag} {iteration}: {load} is the checkpoint of iteration {saved}")
    path = find_checkpoint(load, iteration)
    if path is None:
        its = committed_iterations(load)
        there = ", ".join(map(str, its)) if its else "none"
        raise CheckpointFileError(f"{flag} {iteration}: no complete tenplex checkpoint of iteration {iteration} under "
                                  f"{load}; the iterations there: {there}")
    return path
