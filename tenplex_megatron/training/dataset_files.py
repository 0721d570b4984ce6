"""A Megatron indexed dataset's files checked against the tokenizer a run is given, before training starts.

``PREFIX.idx`` / ``PREFIX.bin`` are megatron-core's format (``IndexedDatasetBuilder``). Beside them
``scripts/build_dataset.py`` writes ``PREFIX.meta.json`` (versioned JSON): the tokenizer it used (type,
vocabulary size, end-of-document id, fingerprint of its files), the counts, and the largest token id. A run
then refuses a dataset built with another tokenizer, naming the file. A dataset without that record (made by
Megatron-LM's ``tools/preprocess_data.py``) is checked by scanning its ``.bin`` for the largest token id,
which must be below the tokenizer's vocabulary. All checks read files only: every rank runs them while
parsing flags, before any process group starts.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from tenplex_megatron.errors import TenplexError
from tenplex_megatron.plan.versioned import VersionedFormat
from tenplex_megatron.training.tokenizer import Tokenizer

INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron.core.datasets.indexed_dataset._INDEX_HEADER
# indexed_dataset.DType code -> numpy dtype (uint8, int8, int16, int32, int64, float64, float32, uint16)
INDEX_DTYPES = MappingProxyType({1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                                 7: np.float32, 8: np.uint16})
META_FORMAT = "tenplex-megatron/indexed-dataset-meta"
META_VERSION = 1


class DatasetError(TenplexError, ValueError):
    """A dataset that is missing, malformed or built with another tokenizer; the message names prefix and file."""


META_DOCUMENT = VersionedFormat("tenplex-megatron dataset record", "version", (META_VERSION,), DatasetError,
                                name=META_FORMAT, version_label="dataset record version")
_SCAN_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class IndexHeader:
    """The fixed part of a ``.idx`` file: token dtype, sequence and document counts."""

    dtype: type
    sequences: int
    documents: int


@dataclass(frozen=True)
class TokenizerRecord:
    """The tokenizer a dataset was built with, as recorded beside it."""

    type: str
    vocab_size: int
    eod: int | None
    fingerprint: str
    files: tuple[str, ...]

    @classmethod
    def of(cls, tok: Tokenizer) -> TokenizerRecord:
        return cls(tok.type_name, tok.vocab_size, tok.eod, tok.fingerprint, tuple(os.path.abspath(f) for f in tok.files))

    def describe(self) -> str:
        return f"{self.type} (vocabulary {self.vocab_size}, end of document {self.eod})"


@dataclass(frozen=True)
class DatasetMeta:
    """``PREFIX.meta.json``: what ``build_dataset.py`` wrote and with which tokenizer."""

    tokenizer: TokenizerRecord
    documents: int
    sequences: int
    tokens: int
    max_token_id: int
    bin_bytes: int
    append_eod: bool

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokenizer"]["files"] = list(self.tokenizer.files)
        return {"format": META_FORMAT, "version": META_VERSION, **d}

    @classmethod
    def from_json(cls, d: Any, path: str) -> DatasetMeta:
        META_DOCUMENT.check(d, path)
        try:
            t = d["tokenizer"]
            rec = TokenizerRecord(str(t["type"]), int(t["vocab_size"]), None if t["eod"] is None else int(t["eod"]),
                                  str(t["fingerprint"]), tuple(str(f) for f in t["files"]))
            return cls(rec, int(d["documents"]), int(d["sequences"]), int(d["tokens"]), int(d["max_token_id"]),
                       int(d["bin_bytes"]), bool(d["append_eod"]))
        except (KeyError, TypeError, ValueError) as e:
            raise DatasetError(f"{path}: malformed dataset record ({type(e).__name__}: {e})") from None


def meta_path(prefix: str) -> str:
    return prefix + ".meta.json"


def write_meta(prefix: str, meta: DatasetMeta) -> str:
    """Write ``PREFIX.meta.json`` atomically (temporary file, then rename); returns its path."""
    path = meta_path(prefix)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(meta.to_json(), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def read_meta(prefix: str) -> DatasetMeta | None:
    """``PREFIX.meta.json`` if there is one (DatasetError naming it when it does not parse)."""
    path = meta_path(prefix)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"--data-path {prefix}: {path} does not parse ({e})") from None
    return DatasetMeta.from_json(d, path)


def read_index_header(prefix: str) -> IndexHeader:
    """The header of ``PREFIX.idx`` (DatasetError naming the prefix and the file when it is missing or malformed)."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    missing = [p for p in (idx, bin_) if not os.path.isfile(p)]
    if missing:
        raise DatasetError(f"--data-path {prefix}: not a Megatron indexed dataset ({', '.join(missing)} missing)")
    with open(idx, "rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != INDEX_HEADER:
        raise DatasetError(f"--data-path {prefix}: {idx} is not a Megatron index file (bad header)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in INDEX_DTYPES:
        raise DatasetError(f"--data-path {prefix}: {idx} is not a Megatron index file (version {version}, dtype "
                           f"code {code})")
    return IndexHeader(INDEX_DTYPES[code], n_seq, n_doc)


def check_indexed_dataset(prefix: str) -> IndexHeader:
    """Raise DatasetError naming ``prefix`` unless it is a readable Megatron indexed dataset (.bin + .idx)."""
    header = read_index_header(prefix)
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    n_seq, n_doc = header.sequences, header.documents
    if os.path.getsize(idx) < 34 + 12 * n_seq + 8 * n_doc:
        raise DatasetError(f"--data-path {prefix}: {idx} is truncated ({os.path.getsize(idx)} bytes for {n_seq} "
                           "sequences)")
    if n_seq == 0:
        raise DatasetError(f"--data-path {prefix}: the dataset holds no documents")
    with open(idx, "rb") as f:
        f.seek(34 + 4 * (n_seq - 1))
        (last_len,) = struct.unpack("<i", f.read(4))
        f.seek(34 + 4 * n_seq + 8 * (n_seq - 1))
        (last_ptr,) = struct.unpack("<q", f.read(8))
    expected, got = last_ptr + last_len * np.dtype(header.dtype).itemsize, os.path.getsize(bin_)
    if expected != got:
        raise DatasetError(f"--data-path {prefix}: {bin_} has {got} bytes, its index {idx} describes {expected}")
    return header


def token_id_range(prefix: str, dtype: type) -> tuple[int, int]:
    """The smallest and largest token id in ``PREFIX.bin`` ((0, -1) when empty), read in chunks through a memory map."""
    path = prefix + ".bin"
    if os.path.getsize(path) == 0:
        return 0, -1
    data = np.memmap(path, dtype=dtype, mode="r")
    lo, hi = None, None
    for i in range(0, len(data), _SCAN_ELEMENTS):
        chunk = data[i:i + _SCAN_ELEMENTS]
        a, b = int(chunk.min()), int(chunk.max())
        lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    return lo, hi


def check_dataset_tokenizer(prefix: str, tok: Tokenizer) -> None:
    """Raise DatasetError naming the file unless ``prefix`` was built with ``tok`` (as far as can be told).

    With ``PREFIX.meta.json``: its tokenizer must have the same vocabulary size, end of document and file
    fingerprint, and it must describe the ``.bin`` there now. Always: every token id must be below
    ``tok.vocab_size`` (the recorded largest id, else a scan of the ``.bin``).
    """
    header = check_indexed_dataset(prefix)
    meta, path, bin_ = read_meta(prefix), meta_path(prefix), prefix + ".bin"
    if meta is not None:
        if meta.bin_bytes != os.path.getsize(bin_) or meta.sequences != header.sequences:
            raise DatasetError(f"--data-path {prefix}: {path} describes another {bin_} ({meta.sequences} sequences, "
                               f"{meta.bin_bytes} bytes; there are {header.sequences}, {os.path.getsize(bin_)}): the "
                               "dataset was rebuilt by another tool; rebuild it with build_dataset.py or remove "
                               f"{path}")
        rec, given = meta.tokenizer, TokenizerRecord.of(tok)
        if (rec.vocab_size, rec.eod) != (given.vocab_size, given.eod):
            raise DatasetError(f"--data-path {prefix}: built with {rec.describe()} according to {path}, but the "
                               f"tokenizer given is {given.describe()}: give the tokenizer the dataset was built with")
        if rec.fingerprint != given.fingerprint:
            raise DatasetError(f"--data-path {prefix}: built with another tokenizer according to {path}: "
                               f"{rec.describe()} from {', '.join(rec.files) or 'no files'} ({rec.fingerprint}), the "
                               f"tokenizer given is {given.describe()} from {', '.join(given.files) or 'no files'} "
                               f"({given.fingerprint}); if they are known to give the same ids, remove {path}")
        smallest, largest = 0, meta.max_token_id
    elif np.issubdtype(header.dtype, np.unsignedinteger) and np.iinfo(header.dtype).max < tok.vocab_size:
        smallest, largest = 0, -1  # the dtype cannot hold an id as large as the vocabulary: nothing to scan
    else:
        smallest, largest = token_id_range(prefix, header.dtype)
    if smallest < 0:
        raise DatasetError(f"--data-path {prefix}: {bin_} holds token id {smallest}: token ids cannot be negative")
    if largest >= tok.vocab_size:
        raise DatasetError(f"--data-path {prefix}: {bin_} holds token id {largest}, but the tokenizer given "
                           f"({tok.type_name}) has a vocabulary of {tok.vocab_size} (ids 0..{tok.vocab_size - 1}): the "
                           "dataset was built with another tokenizer")
