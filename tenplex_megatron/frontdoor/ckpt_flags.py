"""Megatron-LM's checkpoint settings at both front doors: checked at start, and the loads they ask for.

The table of what each setting does under ``--tenplex`` is ``plan/megatron_ckpt_flags.py``; this module checks a
job's flags against it before any process group starts (a ``--ckpt-step`` not under ``--load`` included), and
carries out a load that takes back less than everything or an earlier iteration (``--ckpt-step``,
``--finetune``, ``--no-load-optim``, ``--no-load-rng``, ``--pretrained-checkpoint``) from the durable checkpoints,
tenplex's or Megatron's own (adopted). Such a load names its copy: it does not fall back to another.
"""

from __future__ import annotations

import os
from typing import Any

from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.plan import megatron_ckpt_flags as table
from tenplex_megatron.plan.megatron_ckpt_flags import LoadScope
from tenplex_megatron.storage.directory import (
    committed_iterations,
    find_checkpoint,
    find_megatron_checkpoint,
    iter_dir_name,
)
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.steps import checkpoint_at


def start_problems(args: Any) -> list[str]:
    """Every refused setting in ``args`` (Megatron-LM's or the trainer's parsed flags), a meaningless retention
    setting, and a ``--ckpt-step`` with no checkpoint of that iteration under ``--load``: one line each."""
    problems = table.refusals(args)
    retention = table.retention_problem(args)
    if retention:
        problems.append(retention)
    step, load = getattr(args, "ckpt_step", None), getattr(args, "load", None)
    if step and load:
        try:
            megatron_or_tenplex_at(load, int(step))
        except CheckpointFileError as e:
            problems.append(str(e))
    return problems


def megatron_or_tenplex_at(load: str, step: int) -> tuple[str, bool]:
    """The checkpoint of ``step`` under ``load``: (path, whether tenplex's); else an error listing the steps."""
    path = os.path.join(load, iter_dir_name(step))
    if not committed_iterations(load) and find_megatron_checkpoint(path) == path:
        return path, False  # Megatron's own checkpoint of that iteration, adopted
    return checkpoint_at(load, step), True


def pretrained(load_dir: str | None, scope: LoadScope, pretrained_dir: str | None,
               finetune_scope: LoadScope) -> tuple[str | None, LoadScope]:
    """The directory and scope of a load: ``--load``'s with the flags' ``scope``, or, when ``--load`` holds no
    checkpoint, ``--pretrained-checkpoint``'s as a fine-tune (Megatron-LM's rule)."""
    if pretrained_dir and not (load_dir and (find_checkpoint(load_dir) or find_megatron_checkpoint(load_dir))):
        return pretrained_dir, finetune_scope
    return load_dir, scope


def load_scoped(engine: Any, load_dir: str, scope: LoadScope) -> LoadResult | None:
    """Collective: the checkpoint ``scope`` names under ``load_dir`` (its iteration, else the newest: tenplex's,
    else Megatron's own, adopted) into the job through ``engine`` (``frontdoor/resume.py``'s ``Engine``) at its
    layout, taking back what ``scope`` asks for; None when ``load_dir`` holds no checkpoint."""
    if scope.iteration is not None:
        path, ours = megatron_or_tenplex_at(load_dir, scope.iteration)
    else:
        found = find_checkpoint(load_dir)
        path, ours = (found, True) if found is not None else (find_megatron_checkpoint(load_dir), False)
    if path is None:
        return None
    return engine.load(path, scope) if ours else engine.adopt(path, scope)


def describe_scope(scope: LoadScope) -> str:
    """What a scoped load left out, for its line (empty for a full load)."""
    parts = [*(["fine-tune: iteration 0, fresh data position"] if scope.finetune else []),
             *(["optimizer and LR schedule left fresh"] if not scope.optimizer else []),
             *(["RNG state left alone"] if not scope.rng else [])]
    return f" ({'; '.join(parts)})" if parts else ""
