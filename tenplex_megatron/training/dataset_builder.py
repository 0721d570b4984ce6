"""Text to a Megatron indexed dataset, byte for byte as Megatron-LM's ``tools/preprocess_data.py`` writes it.

Documents come from JSON lines (one document per line, its text under the JSON key, as preprocess_data
reads them: a list of strings is a list of sentences, an empty text an empty document), from text files
(one document per file or per paragraph; empty ones dropped) or from given strings. Worker processes
(``multiprocessing.Pool``, ``imap`` in order, chunks of 32, as preprocess_data) tokenize them; each
non-empty sentence is one sequence, the end-of-document id is appended to a document that has tokens
(``append_eod``, preprocess_data's ``--append-eod``), and megatron-core's own ``IndexedDatasetBuilder`` writes
``PREFIX.bin``/``PREFIX.idx`` with dtype ``DType.optimal_dtype(vocab_size)``. ``PREFIX.meta.json`` records
the tokenizer beside them. Files are written under temporary names and renamed when complete.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from tenplex_megatron.flags import FlagError
from tenplex_megatron.training.dataset_files import DatasetError, DatasetMeta, TokenizerRecord, meta_path, write_meta
from tenplex_megatron.training.progress import Progress
from tenplex_megatron.training.tokenizer import Tokenizer, TokenizerError, TokenizerSpec, build_tokenizer, describe

CHUNK = 32  # documents per task sent to a worker, as preprocess_data.py's pool.imap(..., 32)


class MissingInputError(DatasetError, FileNotFoundError):
    """An ``--input`` file or directory that is not there."""


@dataclass(frozen=True)
class Document:
    """One unit of work: a JSON line (parsed by the worker) or a text, and where it came from (for errors)."""

    kind: str  # "json" or "text"
    payload: str
    where: str


@dataclass(frozen=True)
class BuildResult:
    """What was written and how fast."""

    prefix: str
    documents: int
    sequences: int
    tokens: int
    max_token_id: int
    input_bytes: int
    seconds: float
    workers: int
    tokenizer: str

    @property
    def docs_per_s(self) -> float:
        return self.documents / max(self.seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def input_files(paths: list[str]) -> list[str]:
    """The files named, a directory standing for its ``*.txt`` and ``*.jsonl`` files in name order."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith((".txt", ".jsonl")))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise MissingInputError(f"--input {p}: no such file or directory")
    return files


def is_json_lines(path: str) -> bool:
    return path.endswith((".jsonl", ".json"))


def json_documents(path: str) -> Iterator[Document]:
    """One document per line of a JSON-lines file, read as preprocess_data reads it (text mode, UTF-8)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            yield Document("json", line, f"{path}:{n}")


def text_documents(path: str, paragraphs: bool = False) -> Iterator[Document]:
    """A text file as one document, or one per paragraph (blank-line separated); stripped, empty ones dropped."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    parts = re.split(r"\n\s*\n", text) if paragraphs else [text]
    for i, p in enumerate(parts, start=1):
        if p.strip():
            yield Document("text", p.strip(), f"{path}" + (f" paragraph {i}" if paragraphs else ""))


def file_documents(paths: list[str], paragraphs: bool = False) -> Iterator[Document]:
    """The documents of every input file: JSON lines for ``*.jsonl``/``*.json``, text otherwise."""
    for f in paths:
        yield from (json_documents(f) if is_json_lines(f) else text_documents(f, paragraphs))


#: the attribute of a pool worker's process object (``multiprocessing.current_process()``) that holds its Encoder
WORKER_ENCODER = "tenplex_encoder"


def _sentences(doc: Document, key: str) -> list[str]:
    if doc.kind == "text":
        return [doc.payload]
    try:
        data = json.loads(doc.payload)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{doc.where}: not a JSON line ({e})") from None
    if not isinstance(data, dict) or key not in data:
        raise DatasetError(f"{doc.where}: no key {key!r} (--json-keys)")
    text = data[key]
    sentences = text if isinstance(text, list) else [text]
    if not all(isinstance(s, str) for s in sentences):
        raise DatasetError(f"{doc.where}: {key!r} is neither a string nor a list of strings")
    return sentences


@dataclass(frozen=True)
class Encoder:
    """One process's tokenizer and settings, turning a document into its sequences (preprocess_data's ``Encoder``)."""

    tok: Tokenizer
    key: str  # --json-keys
    append_eod: bool

    def __call__(self, doc: Document) -> tuple[np.ndarray, list[int], int]:
        """(token ids, sequence lengths, input bytes) of one document, as preprocess_data's ``Encoder.encode``."""
        parts, lengths = [], []
        for sentence in _sentences(doc, self.key):
            ids = np.asarray(self.tok.tokenize(sentence), dtype=np.int64)
            if len(ids) > 0:
                parts.append(ids)
                lengths.append(len(ids))
        if parts and self.append_eod:
            parts.append(np.array([self.tok.eod], dtype=np.int64))
            lengths[-1] += 1
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return ids, lengths, len(doc.payload.encode("utf-8"))


def _start_worker(spec: TokenizerSpec, json_key: str, append_eod: bool) -> None:
    """A pool worker's start: its Encoder (the tokenizer built once), kept on the worker's own process object, so
    it lives as long as the worker does."""
    setattr(multiprocessing.current_process(), WORKER_ENCODER, Encoder(build_tokenizer(spec), json_key, append_eod))


def _encode_in_worker(doc: Document) -> tuple[np.ndarray, list[int], int]:
    return getattr(multiprocessing.current_process(), WORKER_ENCODER)(doc)


def _remove(*paths: str) -> None:
    for p in paths:
        if os.path.exists(p):
            os.remove(p)


def build_indexed_dataset(
    docs: Iterable[Document], prefix: str, spec: TokenizerSpec, *, json_key: str = "text", append_eod: bool = True,
    workers: int = 1, progress: Progress | None = None,
) -> BuildResult:
    """Tokenize ``docs`` with ``workers`` processes and write ``prefix.bin``/``.idx``/``.meta.json``.

    Raises TokenizerError (naming the tokenizer file) before anything is written, DatasetError naming the
    input file and line for a bad document (nothing is left behind then).
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tok = build_tokenizer(spec)
    if append_eod and tok.eod is None:
        raise TokenizerError(f"{describe(tok)}: the tokenizer has no end-of-document (eos) token to append; give "
                             "its directory with a tokenizer_config.json naming eos_token, or --no-append-eod")
    if workers < 1:
        raise FlagError(f"--workers {workers}: must be at least 1")
    progress = progress if progress is not None else Progress(every=0)
    dtype = DType.optimal_dtype(tok.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    documents = sequences = tokens = nbytes = 0
    largest = -1
    pool = None
    try:
        if workers == 1:
            encoded: Iterable = map(Encoder(tok, json_key, append_eod), docs)
        else:
            pool = multiprocessing.Pool(workers, initializer=_start_worker, initargs=(spec, json_key, append_eod))
            encoded = pool.imap(_encode_in_worker, docs, CHUNK)
        progress.start()
        for ids, lengths, size in encoded:
            if len(ids):
                top = int(ids.max())
                if top >= tok.vocab_size or int(ids.min()) < 0:
                    bad = top if top >= tok.vocab_size else ids.min()
                    raise TokenizerError(f"{describe(tok)}: produced token id {bad} outside its vocabulary of "
                                         f"{tok.vocab_size}")
                largest = max(largest, top)
            builder.add_document(ids, lengths)
            documents, sequences, tokens, nbytes = documents + 1, sequences + len(lengths), tokens + len(ids), nbytes + size
            progress.update(1, len(ids), size)
        builder.finalize(tmp + ".idx")
        if pool is not None:
            pool.close()
            pool.join()
    except BaseException:
        if pool is not None:
            pool.terminate()
        builder.data_file.close()
        _remove(tmp + ".bin", tmp + ".idx")
        raise
    finally:
        progress.close()
    if documents == 0:
        _remove(tmp + ".bin", tmp + ".idx")
        raise DatasetError("no documents to write")
    _remove(meta_path(prefix))  # a record of an older build there must not describe the new files
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")
    write_meta(prefix, DatasetMeta(TokenizerRecord.of(tok), documents, sequences, tokens, largest,
                                   os.path.getsize(prefix + ".bin"), append_eod))
    return BuildResult(prefix, documents, sequences, tokens, largest, nbytes, progress.elapsed(), workers, describe(tok))
