"""Build a Megatron indexed dataset (PREFIX.bin / PREFIX.idx) with the byte-level tokenizer (vocabulary 257).

    python scripts/build_dataset.py --input docs/ notes.txt --out data/corpus     # one document per file
    python scripts/build_dataset.py --input book.txt --paragraphs --out data/book # one document per paragraph
    python scripts/build_dataset.py --generate 2000 --out data/generated          # built-in learnable corpus

Each document is its UTF-8 bytes followed by the end-of-document token (256),
written with megatron-core's ``IndexedDatasetBuilder`` (uint16 tokens); a
directory contributes its ``*.txt`` files in name order; empty documents are
skipped. The generated corpus is deterministic (``--seed``): short templated
English sentences with counting and arithmetic, so a small model visibly
learns it. Train on the result with ``pretrain_gpt.py --data-path PREFIX``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Leslie", "Frances"]
THINGS = ["apples", "books", "GPUs", "servers", "tensors", "layers", "nodes", "tokens"]


def generated_documents(n: int, seed: int = 1234) -> list[str]:
    """``n`` short, learnable documents, a pure function of ``(n, seed)``."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        who, what = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        start = rng.randint(0, 50)
        count = " ".join(str(start + i) for i in range(8))
        docs.append(f"{who} has {a} {what} and gets {b} more, so {who} has {a + b} {what}. Counting: {count}.")
    return docs


def text_files(paths: list[str]) -> list[str]:
    """The files named, a directory standing for its ``*.txt`` files in name order."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".txt"))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"--input {p}: no such file or directory")
    return files


def text_documents(paths: list[str], paragraphs: bool = False) -> list[str]:
    """One document per file, or per paragraph (blank-line separated) with ``paragraphs``; empty ones dropped."""
    docs = []
    for f in text_files(paths):
        with open(f, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        parts = re.split(r"\n\s*\n", text) if paragraphs else [text]
        docs += [p.strip() for p in parts if p.strip()]
    return docs


def build(docs: list[str], out: str) -> tuple[str, int]:
    """Write ``out.bin``/``out.idx`` (one document per entry of ``docs``, EOD appended); returns (prefix, tokens)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from tenplex_megatron.training.data import ByteTokenizer

    if not docs:
        raise ValueError("no documents to write")
    tok = ByteTokenizer()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    builder = IndexedDatasetBuilder(out + ".bin", dtype=np.uint16)
    tokens = 0
    for d in docs:
        ids = np.append(tok.tokenize(d), tok.eod)
        builder.add_item(torch.from_numpy(ids))
        builder.end_document()
        tokens += len(ids)
    builder.finalize(out + ".idx")
    return out, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="*", default=[], help="text files or directories of .txt files")
    ap.add_argument("--paragraphs", action="store_true", help="one document per paragraph instead of per file")
    ap.add_argument("--generate", type=int, default=0, metavar="N", help="add N generated documents")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the generated corpus")
    ap.add_argument("--out", required=True, help="output prefix (writes PREFIX.bin and PREFIX.idx)")
    a = ap.parse_args(argv)
    if a.generate < 0:
        ap.error("--generate must be >= 0")
    try:
        docs = text_documents(a.input, a.paragraphs) + generated_documents(a.generate, a.seed)
    except FileNotFoundError as e:
        ap.error(str(e))
    if not docs:
        ap.error("no documents: give --input files with text or --generate N")
    prefix, tokens = build(docs, a.out)
    print(f"{prefix}.bin/.idx: {len(docs)} documents, {tokens} tokens (byte-level, vocabulary 257)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
