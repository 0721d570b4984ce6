"""The tokenizers ``pretrain_gpt.py`` and ``build_dataset.py`` read text with, under Megatron-LM's flag names.

- ``ByteLevel`` (the default): UTF-8 bytes + end-of-document, vocabulary 257, no files.
- ``GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt``: Megatron-LM's GPT-2 byte-level BPE
  (``megatron/training/tokenizer``): vocabulary = the entries of vocab.json, end of document =
  ``<|endoftext|>``, merges.txt read as Megatron reads it (its first line skipped, one merge per line). The
  ``tokenizers`` library runs the BPE with no added special tokens, which gives Megatron's ids: a literal
  ``<|endoftext|>`` in the text is ordinary text, as in Megatron.
- ``HuggingFaceTokenizer --tokenizer-model DIR_OR_FILE``: a local tokenizer directory (transformers'
  ``AutoTokenizer``, local files only) or a ``tokenizer.json`` file; vocabulary = ``len(tokenizer)``, end of
  document = its eos token (its sep token when it has no eos); text to ids as megatron-core's
  ``HuggingFaceTokenizer`` does (special tokens only with ``--tokenizer-hf-include-special-tokens``).

Nothing is ever downloaded. Every tokenizer carries a fingerprint of the files it was read from (the
dataset records it, so a dataset built with another tokenizer is recognised) and megatron-core's dataset
interface (``vocab_size``, ``eod``, ``unique_identifiers``). A missing or unreadable file, or a vocab/merges
pair that does not match, is a :class:`TokenizerError` naming the flag and the file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tenplex_megatron.errors import TenplexError

BYTE_VOCAB_SIZE = 257
GPT2_EOD_TOKEN = "<|endoftext|>"
TOKENIZER_TYPES = ("ByteLevel", "GPT2BPETokenizer", "HuggingFaceTokenizer")


def add_tokenizer_args(group: argparse._ArgumentGroup, default: str, type_help: str | None = None,
                       choices: tuple[str, ...] | None = None) -> None:
    """Megatron-LM's tokenizer flags, with its names and meanings (pretrain_gpt.py and build_dataset.py)."""
    group.add_argument("--tokenizer-type", default=default, choices=choices, help=type_help)
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--tokenizer-model", default=None,
                       help="HuggingFaceTokenizer: a local tokenizer directory or tokenizer.json (never downloaded)")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer: text to ids adds the tokenizer's special tokens (e.g. BOS)")
# The files of a Hugging Face tokenizer directory that decide its ids (fingerprinted; model weights are not).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model")


class TokenizerError(TenplexError, ValueError):
    """A tokenizer flag or file that cannot be used; the message names the flag and the file."""


class Tokenizer(Protocol):
    """What the trainer and the dataset builder use of a tokenizer (megatron-core's datasets read the last three)."""

    type_name: str

    def tokenize(self, text: str) -> Any: ...

    def detokenize(self, ids: Any) -> str: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def files(self) -> tuple[str, ...]: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int | None: ...

    @property
    def unique_identifiers(self) -> OrderedDict: ...


def fingerprint_files(named: list[tuple[str, str]]) -> str:
    """``sha256:`` of the contents of the files, each under a role name (so a copied file keeps its fingerprint)."""
    h = hashlib.sha256()
    for role, path in named:
        h.update(role.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def _identifiers(tok: Tokenizer) -> OrderedDict:
    return OrderedDict({"class": f"{type(tok).__module__}.{type(tok).__qualname__}", "vocab_size": tok.vocab_size,
                        "fingerprint": tok.fingerprint})


class ByteTokenizer:
    """Byte-level tokenizer: vocabulary 257 (bytes 0-255 + end-of-document 256), no files, no download.

    A plain class with the attributes megatron-core's datasets read (``vocab_size``, ``eod``,
    ``unique_identifiers``), as megatron-core's own ``NullTokenizer`` is. It has no pad token: megatron-core
    then pads a short final sample with -1, masks it out of the loss and feeds it to the model as id 0.
    """

    EOD = 256
    type_name = "ByteLevel"

    def tokenize(self, text: str) -> np.ndarray:
        """UTF-8 bytes of ``text`` as int64 ids (no end-of-document appended)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def detokenize(self, ids: Any) -> str:
        """Text of ``ids``; end-of-document tokens are dropped, bad UTF-8 is replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    text_to_ids = tokenize
    ids_to_text = detokenize

    @property
    def fingerprint(self) -> str:
        return "sha256:" + hashlib.sha256(b"ByteLevel/257").hexdigest()

    @property
    def files(self) -> tuple[str, ...]:
        return ()

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Property required by megatron-core's datasets (it keys their index cache)."""
        return OrderedDict({"class": f"{type(self).__module__}.{type(self).__qualname__}",
                            "vocab_size": BYTE_VOCAB_SIZE})

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)} | {"<eod>": self.EOD}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    @property
    def eod(self) -> int:
        return self.EOD


def gpt2_byte_symbols() -> list[str]:
    """The 256 one-character symbols GPT-2's byte-level BPE writes bytes as (its ``bytes_to_unicode`` table)."""
    from tokenizers.pre_tokenizers import ByteLevel

    return ByteLevel.alphabet()


def read_gpt2_merges(merge_file: str) -> list[tuple[str, str]]:
    """merges.txt as Megatron-LM reads it: the first line (``#version: ...``) skipped, then one ``A B`` per line."""
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")[1:-1]
    except UnicodeDecodeError as e:
        raise TokenizerError(f"--merge-file {merge_file}: not a GPT-2 merges.txt (not UTF-8: {e})") from None
    merges = []
    for n, line in enumerate(lines, start=2):
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(f"--merge-file {merge_file}: line {n} is {line[:60]!r}, a GPT-2 merges.txt has "
                                 "two symbols per line after its first line")
        merges.append((parts[0], parts[1]))
    return merges


def read_gpt2_vocab(vocab_file: str) -> dict[str, int]:
    """vocab.json: a JSON object token -> id, ids 0..N-1 each once, holding every byte symbol and ``<|endoftext|>``."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            encoder = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json ({e})") from None
    if not isinstance(encoder, dict) or not encoder or not all(
        isinstance(k, str) and type(v) is int for k, v in encoder.items()
    ):
        raise TokenizerError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json (a JSON object token -> integer id)")
    ids = np.sort(np.fromiter(encoder.values(), dtype=np.int64, count=len(encoder)))
    if not np.array_equal(ids, np.arange(len(encoder))):
        raise TokenizerError(f"--vocab-file {vocab_file}: the ids are not 0..{len(encoder) - 1} each once")
    if GPT2_EOD_TOKEN not in encoder:
        raise TokenizerError(f"--vocab-file {vocab_file}: has no {GPT2_EOD_TOKEN} token (Megatron-LM's end of document)")
    missing = [s for s in gpt2_byte_symbols() if s not in encoder]
    if missing:
        raise TokenizerError(f"--vocab-file {vocab_file}: lacks {len(missing)} of the 256 byte symbols of GPT-2's "
                             f"byte-level BPE (e.g. {missing[0]!r}): not a byte-level vocabulary")
    return encoder


class _FileTokenizer:
    """What a tokenizer read from files records: its files, their fingerprint and its vocabulary size."""

    _files: tuple[str, ...]
    _fingerprint: str
    _vocab_size: int

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def files(self) -> tuple[str, ...]:
        return self._files

    @property
    def vocab_size(self) -> int:
        return self._vocab_size


class GPT2BPETokenizer(_FileTokenizer):
    """Megatron-LM's ``GPT2BPETokenizer`` from a vocab.json + merges.txt pair, run by the ``tokenizers`` library."""

    type_name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not os.path.isfile(path):
                raise TokenizerError(f"{flag} {path}: no such file")
        encoder = read_gpt2_vocab(vocab_file)
        merges = read_gpt2_merges(merge_file)
        for n, (a, b) in enumerate(merges, start=2):
            for sym in (a, b, a + b):
                if sym not in encoder:
                    raise TokenizerError(f"--merge-file {merge_file} line {n} ({a} {b}): {sym!r} is not in --vocab-file "
                                         f"{vocab_file}: the vocab/merges pair does not match")
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        self._tok = RustTokenizer(models.BPE(vocab=encoder, merges=merges))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
        self._vocab_size = len(encoder)
        self._eod = encoder[GPT2_EOD_TOKEN]
        self._files = (vocab_file, merge_file)
        self._fingerprint = fingerprint_files([("vocab.json", vocab_file), ("merges.txt", merge_file)])

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Any) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


    @property
    def eod(self) -> int:
        return self._eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        return _identifiers(self)


class HuggingFaceTokenizer(_FileTokenizer):
    """Megatron-LM's ``HuggingFaceTokenizer`` on a local tokenizer directory or ``tokenizer.json`` file."""

    type_name = "HuggingFaceTokenizer"

    def __init__(self, path: str, include_special_tokens: bool = False):
        if not os.path.exists(path):
            raise TokenizerError(f"--tokenizer-model {path}: no such file or directory (tokenizers are read from "
                                 "local files only, never downloaded)")
        if os.path.isdir(path):
            named = [(n, os.path.join(path, n)) for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]
            if not named:
                raise TokenizerError(f"--tokenizer-model {path}: the directory holds no tokenizer file "
                                     f"({', '.join(HF_TOKENIZER_FILES[:3])}, ...)")
        else:
            named = [("tokenizer.json", path)]
        try:
            if os.path.isdir(path):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
            else:
                from transformers import PreTrainedTokenizerFast

                tok = PreTrainedTokenizerFast(tokenizer_file=path)
        except Exception as e:  # transformers and tokenizers raise many kinds; the message names the path
            raise TokenizerError(f"--tokenizer-model {path}: not a readable Hugging Face tokenizer "
                                 f"({type(e).__name__}: {str(e)[:300]})") from None
        self._tok = tok
        self._include_special = include_special_tokens
        self._vocab_size = len(tok)
        eos = tok.eos_token if tok.eos_token is not None else tok.sep_token  # megatron-core: eos, else sep
        self._eod = None if eos is None else int(tok.convert_tokens_to_ids(eos))
        pad = tok.pad_token_id
        self._pad = None if pad is None else int(pad)
        self._files = tuple(p for _, p in named)
        self._fingerprint = fingerprint_files(named)

    def tokenize(self, text: str) -> list[int]:
        if self._include_special:
            return self._tok(text).input_ids
        return self._tok.convert_tokens_to_ids(self._tok.tokenize(text))

    def detokenize(self, ids: Any) -> str:
        return self._tok.decode([int(i) for i in ids])


    @property
    def eod(self) -> int | None:
        return self._eod

    @property
    def pad(self) -> int:
        """The pad id, which megatron-core's GPTDataset masks out of the loss; no pad token: AttributeError (-1 used)."""
        if self._pad is None:
            raise AttributeError(f"{self.files[0]}: the tokenizer has no pad token")
        return self._pad

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = _identifiers(self)
        ids["include_special_tokens"] = self._include_special
        return ids


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer and its files, as the flags gave them: picklable, so worker processes build their own."""

    type: str = "ByteLevel"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    include_special_tokens: bool = False

    @classmethod
    def from_flags(cls, tokenizer_type: str | None, vocab_file: str | None = None, merge_file: str | None = None,
                   tokenizer_model: str | None = None, include_special_tokens: bool = False) -> TokenizerSpec:
        """The spec for Megatron-LM's tokenizer flags; a flag that does not belong to the type is an error naming it."""
        t = tokenizer_type or "ByteLevel"
        if t not in TOKENIZER_TYPES:
            raise TokenizerError(f"--tokenizer-type {t} is not supported (supported: {', '.join(TOKENIZER_TYPES)})")
        given = {"--vocab-file": vocab_file, "--merge-file": merge_file, "--tokenizer-model": tokenizer_model}
        wanted = {"ByteLevel": (), "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
                  "HuggingFaceTokenizer": ("--tokenizer-model",)}[t]
        missing = [f for f in wanted if not given[f]]
        if missing:
            raise TokenizerError(f"--tokenizer-type {t} needs {' and '.join(missing)}")
        extra = [f for f, v in given.items() if v and f not in wanted]
        if extra:
            raise TokenizerError(f"{' and '.join(extra)} {'does' if len(extra) == 1 else 'do'} not apply to "
                                 f"--tokenizer-type {t}" + ("" if wanted else " (give GPT2BPETokenizer or "
                                                                              "HuggingFaceTokenizer)"))
        if include_special_tokens and t != "HuggingFaceTokenizer":
            raise TokenizerError(f"--tokenizer-hf-include-special-tokens does not apply to --tokenizer-type {t}")
        return cls(t, vocab_file, merge_file, tokenizer_model, include_special_tokens)


def build_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """The tokenizer ``spec`` names, read from its local files (TokenizerError naming a file that does not work)."""
    if spec.type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(spec.vocab_file, spec.merge_file)
    if spec.type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(spec.tokenizer_model, spec.include_special_tokens)
    return ByteTokenizer()


def describe(tok: Tokenizer) -> str:
    """One line for logs: type, files, vocabulary, end of document."""
    where = f" {', '.join(tok.files)}" if tok.files else ""
    return f"{tok.type_name}{where}, vocabulary {tok.vocab_size}, end of document {tok.eod}"
