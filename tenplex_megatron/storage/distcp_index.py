"""torch.distributed.checkpoint (DCP) ``.metadata`` read as plain data, without torch. Pure Python.

A ``torch_dist`` checkpoint (megatron-core's dist_checkpointing) is a DCP
directory: ``.metadata``, a pickle of torch's ``Metadata`` (every tensor's
global shape, dtype and saved chunks; for each item its ``.distcp`` file, byte
offset and length), plus the ``__R_N.distcp`` files. The pickle is read by a
restricted unpickler that allows only the classes DCP's index is made of
(:data:`METADATA_CLASSES`) and builds torch-free stand-ins for them, so neither
torch nor any other code runs; any other class fails naming the file and the
class. ``python -m tenplex_megatron inspect`` reads it without torch.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tenplex_megatron.storage.files import CheckpointFileError


class _Record:
    """A plain stand-in for one of DCP's index classes: the pickled state as attributes (nothing of torch runs)."""

    def __init__(self, *args: Any) -> None:  # pickled dataclasses come by NEWOBJ + BUILD: their state, not args
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and len(state) == 5:  # TensorProperties: (dtype, layout, requires_grad, ...)
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state
        else:
            self.state = state


def _record_class(name: str) -> type:
    return type(name, (_Record,), {})


def _name(*args: Any) -> Any:  # torch.serialization._get_layout("torch.strided"), enum members by value
    return args[0] if args else None


# (module, name) of every class a DCP ``.metadata`` pickle may name (torch 2.x), and its torch-free stand-in;
# torch dtypes (``torch.float32``, ...) become their names.
METADATA_CLASSES: Mapping[tuple[str, str], Any] = MappingProxyType({
    **{("torch.distributed.checkpoint.metadata", n): _record_class(n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta")},
    **{("torch.distributed.checkpoint.planner", n): _record_class(n) for n in ("SavePlan", "WriteItem",
                                                                               "TensorWriteData")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _record_class("_StorageInfo"),
    # megatron-core 0.15's torch_dist index: torch's Metadata (and SavePlan) plus a plain dict, mcore_data
    **{("megatron.core.dist_checkpointing.strategies.torch", n): _record_class(n) for n in ("MCoreMetadata",
                                                                                           "MCoreSavePlan")},
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _name,
    ("torch.distributed.checkpoint.planner", "WriteItemType"): _name,
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): _name,
    ("collections", "OrderedDict"): dict,
})
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
               "float8_e4m3fn", "float8_e5m2")


class UnsafePickleError(CheckpointFileError):
    """A pickle names a class outside the allowed list."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: Any, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = METADATA_CLASSES.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in DTYPE_NAMES:
            return name
        raise UnsafePickleError(f"{self.path}: names {module}.{name}, not a class of torch's checkpoint index; "
                                "pass --tenplex-trust-pickles (trust_pickles=True) to unpickle it fully, only if "
                                "you trust where it came from")


@dataclass(frozen=True)
class DcpTensor:
    """One tensor of a DCP index: global shape, dtype name, and its saved chunks (offsets, sizes)."""

    size: tuple[int, ...]
    dtype: str
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


@dataclass(frozen=True)
class DcpItem:
    """Where one saved item lies: file, byte offset and length."""

    relative_path: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpIndex:
    """A DCP ``.metadata`` as plain data: tensors, byte objects' keys, and each item's place."""

    tensors: dict[str, DcpTensor]
    objects: tuple[str, ...]
    items: dict[tuple[str, tuple[int, ...]], DcpItem]  # (key, chunk offsets; () for objects) -> place


def _dtype_name(d: Any) -> str:
    return d if isinstance(d, str) else str(d).removeprefix("torch.")


def read_dcp_metadata(ckpt_dir: str, *, trust_pickles: bool = False) -> DcpIndex:
    """The DCP index of ``ckpt_dir/.metadata`` as plain data, unpickled with only DCP's own classes allowed (as
    torch-free stand-ins: neither torch nor any other code runs). ``trust_pickles``: a full unpickle (torch's)."""
    path = os.path.join(ckpt_dir, ".metadata")
    if not os.path.isfile(path):
        raise CheckpointFileError(f"{path}: missing (not a torch_dist checkpoint?)")
    with open(path, "rb") as f:
        try:
            md = pickle.load(f) if trust_pickles else _MetadataUnpickler(f, path).load()
            tensors, objects = {}, []
            for key, v in md.state_dict_metadata.items():
                if hasattr(v, "chunks"):
                    tensors[key] = DcpTensor(tuple(int(x) for x in v.size), _dtype_name(v.properties.dtype),
                                             tuple((tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes))
                                                   for c in v.chunks))
                else:
                    objects.append(key)
            items = {(k.fqn, tuple(int(x) for x in getattr(k, "offset", None) or ())):
                     DcpItem(str(v.relative_path), int(v.offset), int(v.length)) for k, v in md.storage_data.items()}
            transformed = sorted(k.fqn for k, v in md.storage_data.items() if getattr(v, "transform_descriptors", None))
        except UnsafePickleError:
            raise
        except Exception as e:  # truncated, not a pickle, or not DCP's index
            raise CheckpointFileError(f"{path}: not a readable torch.distributed.checkpoint index ({e})") from None
    if transformed:
        raise CheckpointFileError(f"{path}: item {transformed[0]!r} is stored with transforms (compression?), "
                                  "which tenplex does not read")
    return DcpIndex(tensors, tuple(objects), items)
