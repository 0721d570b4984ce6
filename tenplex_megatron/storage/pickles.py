"""The one policy for reading a framework's own pickled checkpoint files (Megatron, DeepSpeed): ``torch.load``
with ``weights_only=True`` and a named list of plain classes; anything else fails naming the file and the class,
unless the user says they trust the file."""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PicklePolicy:
    """Which classes a framework's pickles may hold, and how its refusals are worded."""

    allowed: tuple[Any, ...]
    framework: str  # "Megatron", "DeepSpeed": in "not a readable <framework> checkpoint file"
    allowed_words: str  # what a refused class is not, e.g. "one of the plain classes allowed"
    trust_words: str  # how to trust the file, e.g. "--tenplex-trust-pickles (trust_pickles=True)"
    error: type[Exception]


def load_restricted(src: Any, path: str, policy: PicklePolicy, *, trust_pickles: bool, mmap: bool) -> Any:
    """``torch.load`` of ``src`` (a path or a file object read from ``path``) under ``policy``."""
    try:
        if trust_pickles:
            return torch.load(src, map_location="cpu", weights_only=False, mmap=mmap)
        with torch.serialization.safe_globals(list(policy.allowed)):
            return torch.load(src, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        why = f"it names {found.group(1)}, not {policy.allowed_words}" if found else type(e).__name__
        raise policy.error(
            f"{path}: cannot be read with torch.load(weights_only=True) ({why}); pass {policy.trust_words} to "
            "unpickle it fully, only if you trust where it came from") from None
    except (RuntimeError, OSError, EOFError) as e:
        raise policy.error(f"{path}: not a readable {policy.framework} checkpoint file ({e})") from None
