"""Megatron-LM's ``--use-checkpoint-args`` under ``--tenplex``: the model flags from a tenplex checkpoint's
metadata.json (``plan/checkpoint_args.py`` copies them as Megatron-LM does), read before Megatron-LM checks its flags
and before any process group; the layout stays the command line's.

A ``--load`` (or ``--pretrained-checkpoint``) directory holding only Megatron's own checkpoint is left to Megatron-LM's
own reader. A snapshot in host memory is not read here: the durable copy under the directory gives the model flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from tenplex_megatron import log
from tenplex_megatron.plan import checkpoint_args as table
from tenplex_megatron.plan import megatron_flag_snapshot as snap
from tenplex_megatron.storage.directory import find_checkpoint, read_checkpoint_metadata
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.steps import checkpoint_at

_log = log.get("megatron_lm")


def _source(args: Any, load_arg: str) -> str | None:
    """The tenplex checkpoint whose record gives the flags: ``--ckpt-step``'s under ``--load`` where there, else the
    newest complete one (None: none there)."""
    load_dir = getattr(args, load_arg, None)
    step = getattr(args, "ckpt_step", None)
    if step and load_arg == "load":
        try:
            return checkpoint_at(load_dir, int(step))
        except CheckpointFileError:  # the start check names the missing step
            pass
    return find_checkpoint(load_dir)


def _options() -> dict[str, tuple[str, ...]]:
    try:
        return snap.read().options()
    except (OSError, snap.FlagSnapshotError):
        return {}


def apply(args: Any, load_arg: str, argv: Sequence[str]) -> tuple[Any, argparse.Namespace] | None:
    """Set ``args``' model flags from the tenplex checkpoint under ``args.<load_arg>`` as ``--use-checkpoint-args``
    asks (``argv``: the command line, whose explicit flags must agree); returns Megatron-LM's ``(args,
    checkpoint_args)``, or None where the directory holds no tenplex checkpoint. A contradiction stops the job (exit 2)
    naming each flag and both values."""
    path = _source(args, load_arg)
    if path is None:
        return None
    meta = read_checkpoint_metadata(path)
    saved = table.recorded(meta.model or {}, meta.padded_vocab_size)
    options = _options()
    given = table.given_dests(argv, options)
    got = table.from_checkpoint(vars(args), saved, given, options=given,
                                tokenizer=bool(getattr(args, "use_tokenizer_model_from_checkpoint_args", True)))
    if got.contradictions:
        for line in got.contradictions:
            _log.error("pretrain_gpt.py: with --tenplex --use-checkpoint-args, %s (%s)", line, path)
        raise SystemExit(2)
    for dest, value in got.values.items():
        setattr(args, dest, value)
    args.iteration = meta.iteration
    _log.info("--use-checkpoint-args: %d model flags from %s (iteration %s); the layout is the command line's",
              len(got.values), path, meta.iteration)
    return args, argparse.Namespace(**saved)
