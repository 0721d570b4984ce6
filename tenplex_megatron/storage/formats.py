"""Every checkpoint format the package reads, recognised in one place, by what is on disk (nothing is unpickled).

- **tenplex**: ``metadata.json`` whose ``format`` is ``tenplex-megatron`` (``directory.py``: the layout and commit);
- **torch_dist**: megatron-core's dist_checkpointing, ``metadata.json`` naming a ``sharded_backend``;
- **torch**: Megatron-LM's legacy ``--ckpt-format torch``, ``mp_rank_*/model_optim_rng.pt``;
- **deepspeed**: DeepSpeed's ``engine.save_checkpoint``, ``latest`` and ``global_stepN/`` (no ``metadata.json``);
- **huggingface**: transformers' ``config.json`` beside ``model.safetensors`` or its shards' index.

:func:`recognise` names the format of one checkpoint directory; a new format is a recogniser here, added to
:data:`RECOGNISERS` in the order of precedence, and an opener where the framework's adapter lives. Pure file checks.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable
from typing import Any

from tenplex_megatron.storage.bounded import METADATA_MAX_ENV, metadata_cap, read_checkpoint_file
from tenplex_megatron.storage.files import CheckpointFileError

TENPLEX = "tenplex"
TORCH_DIST = "torch_dist"
LEGACY_TORCH = "torch"
DEEPSPEED = "deepspeed"
HUGGING_FACE = "huggingface"
FORMAT_NAME = "tenplex-megatron"  # a tenplex metadata.json's ``format``
METADATA_FILE = "metadata.json"
HF_CONFIG, HF_SINGLE, HF_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
_LEGACY_RANK_RE = re.compile(r"mp_rank_\d{2}(_\d{3})?")


def load_metadata_json(ckpt_dir: str) -> Any:
    """The parsed JSON of ``ckpt_dir``'s ``metadata.json``, read bounded (``bounded.py``: confined, a regular file,
    at most ``TENPLEX_METADATA_MAX_MB``); ``FileNotFoundError`` when missing, :class:`CheckpointFileError` naming
    the file otherwise."""
    raw = read_checkpoint_file(ckpt_dir, METADATA_FILE, metadata_cap(), METADATA_MAX_ENV)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, an integer of too many digits
        raise CheckpointFileError(f"{os.path.join(ckpt_dir, METADATA_FILE)}: malformed JSON: {e}") from None


def _metadata(path: str) -> Any:
    """``path``'s metadata.json, or None where it is missing or unreadable."""
    try:
        return load_metadata_json(path)
    except (OSError, CheckpointFileError):
        return None


def is_tenplex_checkpoint(path: str) -> bool:
    """A committed tenplex checkpoint (megatron-core's torch_dist format also writes a metadata.json)."""
    meta = _metadata(path)
    return isinstance(meta, dict) and meta.get("format") == FORMAT_NAME


def is_torch_dist_checkpoint(path: str) -> bool:
    """A checkpoint of megatron-core's dist_checkpointing (its metadata.json names a sharded backend)."""
    meta = _metadata(path)
    return isinstance(meta, dict) and "sharded_backend" in meta


def is_legacy_megatron_checkpoint(path: str) -> bool:
    """An iteration directory of Megatron-LM's legacy ``--ckpt-format torch`` (``mp_rank_*/model_optim_rng.pt``)."""
    try:
        return any(_LEGACY_RANK_RE.fullmatch(n) and os.path.isfile(os.path.join(path, n, "model_optim_rng.pt"))
                   for n in os.listdir(path))
    except OSError:
        return False


def is_megatron_checkpoint(path: str) -> bool:
    """Megatron's own checkpoint of one iteration: torch_dist or the legacy torch format."""
    return is_torch_dist_checkpoint(path) or is_legacy_megatron_checkpoint(path)


def deepspeed_step_dirs(path: str) -> list[str]:
    """DeepSpeed's ``global_stepN`` directories under ``path`` (sorted by name)."""
    return sorted(d for d in glob.glob(os.path.join(path, "global_step*")) if os.path.isdir(d))


def is_deepspeed_checkpoint_dir(path: str) -> bool:
    """A directory DeepSpeed's ``engine.save_checkpoint`` wrote (``latest`` and/or ``global_stepN/``)."""
    if os.path.exists(os.path.join(path, METADATA_FILE)):
        return False
    return (os.path.isfile(os.path.join(path, "latest")) or bool(deepspeed_step_dirs(path))
            or bool(glob.glob(os.path.join(path, "*_optim_states.pt"))))


def is_hf_checkpoint(path: str) -> bool:
    """A Hugging Face transformers checkpoint: ``config.json`` and the weights in safetensors (one file or shards
    named by an index)."""
    return os.path.isfile(os.path.join(path, HF_CONFIG)) and (
        os.path.isfile(os.path.join(path, HF_SINGLE)) or os.path.isfile(os.path.join(path, HF_INDEX)))


#: (format, its recogniser), in the order of precedence (a tenplex metadata.json wins over anything beside it)
RECOGNISERS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    (TENPLEX, is_tenplex_checkpoint),
    (TORCH_DIST, is_torch_dist_checkpoint),
    (LEGACY_TORCH, is_legacy_megatron_checkpoint),
    (DEEPSPEED, is_deepspeed_checkpoint_dir),
    (HUGGING_FACE, is_hf_checkpoint),
)
FORMATS = tuple(name for name, _ in RECOGNISERS)


def recognise(path: str) -> str | None:
    """The format of the checkpoint directory ``path`` (:data:`FORMATS`), or None where it is none of them."""
    return next((name for name, test in RECOGNISERS if test(path)), None)
