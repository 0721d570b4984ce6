"""The one policy for what tenplex unpickles, and how.

A framework's own pickled checkpoint files (Megatron, DeepSpeed): ``torch.load`` with ``weights_only=True`` and a
named list of plain classes; anything else fails naming the file and the class, unless the user says they trust
the file. The bytes a tenplex checkpoint hands to a module's ``set_extra_state`` (Transformer Engine unpickles
them): unpickled here first with a restricted unpickler (:func:`why_unsafe_extra_state`), and left out when they
name anything else, unless the user says they trust the checkpoint.
"""

from __future__ import annotations

import io
import pickle
import re
from dataclasses import dataclass
from typing import Any

import torch

from tenplex_megatron.errors import TenplexError


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


# --- The pickles a checkpoint hands to a module's ``set_extra_state`` (Transformer Engine unpickles them)

#: the one module whose classes (dataclasses and enums: DelayedScaling, Format, ...) TE's extra state may name
TE_RECIPE_MODULE = "transformer_engine.common.recipe"
#: every other global the pickle of TE's extra state needs: tensors (torch's own pickling of a tensor rebuilds it
#: from a storage serialized with torch.save), containers, a shape, protocol 2's bytes
_EXTRA_STATE_GLOBALS = frozenset({
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"), ("collections", "OrderedDict"),
    ("torch", "Size"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"),
    ("_codecs", "encode"),
})


class RefusedPickle(TenplexError, pickle.UnpicklingError):
    """A pickle names something outside the allow list: unpickling it fully could run code."""


def _storage_from_bytes(data: bytes) -> Any:
    """What ``torch.storage._load_from_bytes`` gives (a tensor's storage, torch.save'd inside the pickle), read with
    ``weights_only=True`` instead of torch's full unpickling."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        raise RefusedPickle("a tensor's storage inside it is not plain tensor data"
                            + (f" (it names {found.group(1)})" if found else "")) from None


class _ExtraStateUnpickler(pickle.Unpickler):
    """An unpickler that builds only what Transformer Engine's extra state holds (module section above)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _EXTRA_STATE_GLOBALS:
            return super().find_class(module, name)
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if module == TE_RECIPE_MODULE:
            try:
                found = super().find_class(module, name)
            except (ImportError, AttributeError):
                found = None
            if isinstance(found, type):
                return found
        raise RefusedPickle(f"it names {module}.{name}, not a tensor, container or Transformer Engine recipe class")


class _ExtraStatePickleModule:
    """``torch.load``'s ``pickle_module`` with the restricted unpickler (for the io.BytesIO kind: torch.save)."""

    Unpickler = _ExtraStateUnpickler

    @staticmethod
    def load(f: Any, **kwargs: Any) -> Any:
        return _ExtraStateUnpickler(f, **kwargs).load()


def why_unsafe_extra_state(data: bytes, torch_save: bool) -> str | None:
    """Why unpickling ``data`` (a module's extra state: a pickle, or with ``torch_save`` a torch.save stream) could run
    code, or None when it cannot: it is unpickled here with only tensors, numbers, strings, containers and
    Transformer Engine's recipe classes allowed. Bytes that are not a pickle at all pass: the module's own
    unpickling stops at the same byte, having built nothing outside the allow list."""
    try:
        if torch_save:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=False, pickle_module=_ExtraStatePickleModule)
        else:
            _ExtraStateUnpickler(io.BytesIO(data)).load()
    except RefusedPickle as e:
        return str(e)
    except (MemoryError, RecursionError) as e:
        return f"unpickling it fails with {type(e).__name__}"
    except Exception:  # noqa: BLE001 - not a pickle: nothing outside the allow list was built
        return None
    return None
