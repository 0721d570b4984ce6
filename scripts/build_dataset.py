"""Build a Megatron indexed dataset (PREFIX.bin / PREFIX.idx) from text, as Megatron-LM's tools/preprocess_data.py.

    python scripts/build_dataset.py --input docs/ notes.txt --out data/corpus     # byte-level, one document per file
    python scripts/build_dataset.py --input book.txt --paragraphs --out data/book # one document per paragraph
    python scripts/build_dataset.py --generate 2000 --out data/generated          # built-in learnable corpus
    python scripts/build_dataset.py --input corpus.jsonl --json-keys text --out data/gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --workers 8
    python scripts/build_dataset.py --input corpus.jsonl --out data/hf \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model path/to/tokenizer_dir_or_tokenizer.json

Tokenizers take Megatron-LM's flags and meanings (``tenplex_megatron/training/tokenizer.py``); the default is
the byte-level one (vocabulary 257). ``*.jsonl``/``*.json`` inputs are JSON lines, one document per line under
``--json-keys`` (default ``text``), read exactly as preprocess_data.py reads them; other files are text, one
document per file (or per paragraph with ``--paragraphs``); a directory contributes its ``*.txt`` and
``*.jsonl`` files in name order. The end-of-document id is appended to every document that has tokens
(preprocess_data.py's ``--append-eod``; ``--no-append-eod`` leaves it out). The output is the same
``.bin``/``.idx`` preprocess_data.py writes for the same documents and tokenizer (megatron-core's
``IndexedDatasetBuilder``), plus ``PREFIX.meta.json`` recording the tokenizer, which ``pretrain_gpt.py``
checks. ``--workers N`` processes tokenize (default: every core); progress in documents and tokens per
second goes to stderr (a bar on a terminal, a line every ``--log-interval`` documents otherwise). The
generated corpus is deterministic (``--seed``): short templated English sentences with counting and
arithmetic, so a small model visibly learns it. Train on the result with ``pretrain_gpt.py --data-path
PREFIX`` and the same tokenizer flags.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

from tenplex_megatron.training.dataset_builder import (
    BuildResult,
    Document,
    build_indexed_dataset,
    file_documents,
    input_files,
)
from tenplex_megatron.training.progress import Progress
from tenplex_megatron.training.tokenizer import (
    TOKENIZER_TYPES,
    TokenizerError,
    TokenizerSpec,
    add_tokenizer_args,
)

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


def text_documents(paths: list[str], paragraphs: bool = False) -> list[str]:
    """The texts of the documents of ``paths`` (JSON lines parsed), in order."""
    import json

    return [json.loads(d.payload)["text"] if d.kind == "json" else d.payload
            for d in file_documents(input_files(paths), paragraphs)]


def build(docs: list[str], out: str, spec: TokenizerSpec | None = None, append_eod: bool = True,
          workers: int = 1) -> tuple[str, int]:
    """Write ``out.bin``/``out.idx``/``out.meta.json`` (one document per entry of ``docs``); returns (prefix, tokens)."""
    r = build_indexed_dataset((Document("text", d, f"document {i}") for i, d in enumerate(docs)), out,
                              spec or TokenizerSpec(), append_eod=append_eod, workers=workers)
    return r.prefix, r.tokens


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    g = ap.add_argument_group("input and output")
    g.add_argument("--input", nargs="*", default=[], help="JSON-lines or text files, or directories of them")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="the JSON key holding the text (one key)")
    g.add_argument("--paragraphs", action="store_true", help="text files: one document per paragraph, not per file")
    g.add_argument("--generate", type=int, default=0, metavar="N", help="add N generated documents")
    g.add_argument("--seed", type=int, default=1234, help="seed of the generated corpus")
    g.add_argument("--out", required=True, help="output prefix (writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json)")
    g = ap.add_argument_group("tokenizer (Megatron-LM's flags)")
    add_tokenizer_args(g, "ByteLevel", choices=TOKENIZER_TYPES)
    g.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="append the end-of-document id to every document with tokens (default: yes)")
    g = ap.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="tokenizing processes "
                   "(default: every core)")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines (no terminal)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.generate < 0:
        ap.error("--generate must be >= 0")
    if a.workers < 1:
        ap.error(f"--workers {a.workers}: must be at least 1")
    if len(a.json_keys) != 1:
        ap.error(f"--json-keys {' '.join(a.json_keys)}: give one key (Megatron-LM writes one dataset per key)")
    try:
        spec = TokenizerSpec.from_flags(a.tokenizer_type, a.vocab_file, a.merge_file, a.tokenizer_model,
                                        a.tokenizer_hf_include_special_tokens)
        files = input_files(a.input)
    except (TokenizerError, FileNotFoundError) as e:
        ap.error(str(e))
    generated = generated_documents(a.generate, a.seed)
    if not files and not generated:
        ap.error("no documents: give --input files with text or --generate N")

    def docs():
        yield from file_documents(files, a.paragraphs)
        yield from (Document("text", d, f"generated document {i}") for i, d in enumerate(generated))

    total = sum(os.path.getsize(f) for f in files) + sum(len(d.encode()) for d in generated)
    try:
        r: BuildResult = build_indexed_dataset(docs(), a.out, spec, json_key=a.json_keys[0], append_eod=a.append_eod,
                                               workers=a.workers, progress=Progress(total, every=a.log_interval))
    except (TokenizerError, ValueError) as e:
        print(f"build_dataset.py: error: {e}", file=sys.stderr)
        return 2
    print(f"{r.prefix}.bin/.idx: {r.documents} documents, {r.tokens} tokens ({r.tokenizer}); "
          f"{r.docs_per_s:.1f} docs/s, {r.tokens_per_s:.1f} tokens/s, {r.input_bytes / 1e6 / max(r.seconds, 1e-9):.2f} "
          f"MB/s with {r.workers} worker{'s' if r.workers > 1 else ''} in {r.seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
