"""Megatron-LM's GPT2BPETokenizer and HuggingFaceTokenizer from local files the tests make (no download), the
datasets build_dataset.py writes with them (read back with megatron-core's own IndexedDataset and GPTDataset),
the record beside a dataset, and the errors that name a bad tokenizer file or a dataset built with another
tokenizer, all raised while the flags are parsed (no torch.distributed here)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import tty

import numpy as np
import pytest
import regex

from benchmarks import build_dataset as bench_build_dataset
from tenplex_megatron.plan.layout import padded_vocab_size, restart_padded_vocab_size
from tenplex_megatron.training.data import build_train_dataset, check_data_path
from tenplex_megatron.training.dataset_builder import Document, build_indexed_dataset, json_documents
from tenplex_megatron.training.dataset_files import meta_path, read_meta
from tenplex_megatron.training.progress import Progress
from tenplex_megatron.training.tokenizer import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    TokenizerError,
    TokenizerSpec,
    build_tokenizer,
)
from tests.harness import ROOT
from tests.tokenizer_files import EOT, TokenizerFiles, make_tokenizer_files, training_text

# GPT-2's pre-tokenizer pattern, as published with GPT-2 and used by Megatron-LM's gpt2_tokenization.py.
GPT2_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
TRICKY = ["the", " tensor", "café", " naïve", "✓", "数据", "  ", "\n\n", "\t", " it's", "we'll", " 123", "4567",
          EOT, "!?", " über", "\u00a0", "🙂", "'re", "x", " ", "façade", "..."]


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> symbol table: printable Latin-1 bytes stand for themselves, the 68 others move to 256+."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in keep]
    return {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(others)}


def reference_gpt2_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], text: str) -> list[int]:
    """GPT-2's byte-level BPE written out from its definition: the oracle for GPT2BPETokenizer's ids."""
    ranks = {m: r for r, m in enumerate(merges)}
    table = _byte_symbols()
    out: list[int] = []
    for piece in GPT2_PATTERN.findall(text):
        word = [table[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            rank = min(ranks.get(p, math.inf) for p in zip(word, word[1:]))
            if rank == math.inf:
                break
            a, b = merges[rank]
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        out += [vocab[w] for w in word]
    return out


def _gpt2_files(t: TokenizerFiles) -> tuple[dict[str, int], list[tuple[str, str]]]:
    with open(t.vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(t.merge_file, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:-1]]
    return vocab, merges


def _random_texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(TRICKY[i] for i in rng.integers(0, len(TRICKY), rng.integers(0, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok300(tmp_path_factory: pytest.TempPathFactory) -> TokenizerFiles:
    return make_tokenizer_files(str(tmp_path_factory.mktemp("tok300")), 300)


@pytest.fixture(scope="module")
def tok400(tmp_path_factory: pytest.TempPathFactory) -> TokenizerFiles:
    return make_tokenizer_files(str(tmp_path_factory.mktemp("tok400")), 400, seed=1)


def _load_build_dataset():
    spec = importlib.util.spec_from_file_location("build_dataset", os.path.join(ROOT, "scripts", "build_dataset.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bd = _load_build_dataset()


def _gpt2(t: TokenizerFiles) -> TokenizerSpec:
    return TokenizerSpec("GPT2BPETokenizer", vocab_file=t.vocab_file, merge_file=t.merge_file)


def _hf(t: TokenizerFiles) -> TokenizerSpec:
    return TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=t.hf_dir)


def _write_jsonl(path: str, texts: list) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"text": t, "id": i}) + "\n")
    return path


# ---------------------------------------------------------------- tokenizers


def test_gpt2_bpe_gives_the_ids_of_gpt2s_algorithm(tok300: TokenizerFiles) -> None:
    """Megatron's GPT2BPETokenizer: vocabulary = entries of vocab.json, eod = <|endoftext|>, ids = GPT-2's BPE
    (a literal <|endoftext|> in text is ordinary text, as Megatron's GPT2Tokenizer has no special tokens)."""
    vocab, merges = _gpt2_files(tok300)
    tok = GPT2BPETokenizer(tok300.vocab_file, tok300.merge_file)
    assert (tok.vocab_size, tok.eod) == (len(vocab), vocab[EOT]) == (300, 0)
    texts = _random_texts(400, seed=3) + training_text(50, seed=9)
    for text in texts:
        ids = tok.tokenize(text)
        assert ids == reference_gpt2_bpe(vocab, merges, text), text
        assert tok.detokenize(ids) == text
    assert tok.tokenize(EOT) != [tok.eod] and len(tok.tokenize(EOT)) > 1
    assert sum(len(tok.tokenize(t)) for t in texts) < sum(len(t.encode()) for t in texts)  # it does merge
    assert tok.unique_identifiers["fingerprint"] == tok.fingerprint and tok.fingerprint.startswith("sha256:")


def test_hugging_face_tokenizer_as_megatron_core_reads_it(tok300: TokenizerFiles, tmp_path) -> None:
    """vocab_size = len(tokenizer), eod = its eos token, ids = convert_tokens_to_ids(tokenize(text)) (no special
    tokens) or tokenizer(text).input_ids with --tokenizer-hf-include-special-tokens; a directory or a file."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tok300.hf_dir, local_files_only=True)
    d = HuggingFaceTokenizer(tok300.hf_dir)
    f = HuggingFaceTokenizer(tok300.tokenizer_json)
    assert (d.vocab_size, d.eod) == (len(ref), ref.eos_token_id) == (300, 0)
    assert f.vocab_size == 300 and f.eod is None  # a bare tokenizer.json names no eos token
    gpt2 = GPT2BPETokenizer(tok300.vocab_file, tok300.merge_file)
    for text in _random_texts(200, seed=4):
        ids = d.tokenize(text)
        assert ids == ref.convert_tokens_to_ids(ref.tokenize(text)) == f.tokenize(text)
        if EOT not in text:  # the GPT-2 files derived from the same tokenizer.json give the same ids
            assert ids == gpt2.tokenize(text)
    assert d.tokenize(EOT) == [0]  # a Hugging Face tokenizer keeps its special tokens whole
    with pytest.raises(AttributeError, match="no pad token"):
        _ = d.pad
    bos = make_tokenizer_files(str(tmp_path / "bos"), 300, post_bos=True)
    plain, special = HuggingFaceTokenizer(bos.hf_dir), HuggingFaceTokenizer(bos.hf_dir, include_special_tokens=True)
    text = "the tensor layout"
    assert special.tokenize(text) == AutoTokenizer.from_pretrained(bos.hf_dir)(text).input_ids == [0, *plain.tokenize(text)]
    assert special.unique_identifiers != plain.unique_identifiers


def test_tokenizer_flags_are_checked_by_name(tok300: TokenizerFiles) -> None:
    assert TokenizerSpec.from_flags(None) == TokenizerSpec("ByteLevel")
    assert build_tokenizer(TokenizerSpec.from_flags("ByteLevel")).vocab_size == 257
    for args, msg in (
        (("GPT2BPETokenizer", tok300.vocab_file), "--tokenizer-type GPT2BPETokenizer needs --merge-file"),
        (("GPT2BPETokenizer",), "needs --vocab-file and --merge-file"),
        (("HuggingFaceTokenizer",), "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
        (("HuggingFaceTokenizer", tok300.vocab_file, None, tok300.hf_dir), "--vocab-file does not apply to "
                                                                           "--tokenizer-type HuggingFaceTokenizer"),
        (("ByteLevel", None, None, tok300.hf_dir), "--tokenizer-model does not apply to --tokenizer-type ByteLevel"),
        (("SentencePieceTokenizer",), "--tokenizer-type SentencePieceTokenizer is not supported"),
        (("GPT2BPETokenizer", tok300.vocab_file, tok300.merge_file, None, True), "--tokenizer-hf-include-special"),
    ):
        with pytest.raises(TokenizerError, match=re.escape(msg)):
            TokenizerSpec.from_flags(*args)


def test_bad_tokenizer_files_are_named(tok300: TokenizerFiles, tok400: TokenizerFiles, tmp_path) -> None:
    """Missing, unparsable, or a vocab/merges pair that does not match: TokenizerError naming flag and file."""
    v, m = tok300.vocab_file, tok300.merge_file
    missing = str(tmp_path / "nope.json")
    not_json = tmp_path / "vocab_bad.json"
    not_json.write_text("{not json")
    no_eot = tmp_path / "vocab_noeot.json"
    vocab = json.loads(open(v, encoding="utf-8").read())
    no_eot.write_text(json.dumps({k: i for i, k in enumerate(k for k in vocab if k != EOT)}))
    gap = tmp_path / "vocab_gap.json"
    gap.write_text(json.dumps(vocab | {"zzz": 1000}))
    garbled = tmp_path / "merges_bad.txt"
    garbled.write_text("#version: 0.2\na b c\n")
    for (vf, mf), msg in (
        ((missing, m), f"--vocab-file {missing}: no such file"),
        ((v, missing), f"--merge-file {missing}: no such file"),
        ((str(not_json), m), f"--vocab-file {not_json}: not a GPT-2 vocab.json"),
        ((str(no_eot), m), f"--vocab-file {no_eot}: has no {EOT}"),
        ((str(gap), m), f"--vocab-file {gap}: the ids are not 0..300"),
        ((v, str(garbled)), f"--merge-file {garbled}: line 2"),
        ((v, tok400.merge_file), f"--merge-file {tok400.merge_file} line"),
    ):
        with pytest.raises(TokenizerError, match=re.escape(msg)):
            GPT2BPETokenizer(vf, mf)
    with pytest.raises(TokenizerError, match="the vocab/merges pair does not match"):
        GPT2BPETokenizer(v, tok400.merge_file)
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text('{"model": 1}')
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    for path, msg in ((missing, f"--tokenizer-model {missing}: no such file or directory"),
                      (str(garbage), f"--tokenizer-model {garbage}: not a readable Hugging Face tokenizer"),
                      (str(empty), f"--tokenizer-model {empty}: the directory holds no tokenizer file")):
        with pytest.raises(TokenizerError, match=re.escape(msg)):
            HuggingFaceTokenizer(path)


# ---------------------------------------------------------------- datasets


DOCS = [*training_text(60, seed=5), "", ["first sentence.", "", " second one " + EOT + " here"], "✓ 数据\n newline"]


def _expected(texts: list, encode, eod: int | None) -> tuple[list[list[int]], list[int]]:
    """preprocess_data.py's layout, from its definition: per document the non-empty sentences' ids, one sequence
    each, eod appended to the last one when the document has tokens; document boundaries in sequences."""
    sequences, boundaries = [], [0]
    for t in texts:
        seqs = [ids for ids in (encode(s) for s in (t if isinstance(t, list) else [t])) if ids]
        if seqs and eod is not None:
            seqs[-1] = seqs[-1] + [eod]
        sequences += seqs
        boundaries.append(len(sequences))
    return sequences, boundaries


@pytest.mark.parametrize("kind", ["gpt2", "hf"])
def test_dataset_matches_megatron_core_reader(kind: str, tok300: TokenizerFiles, tmp_path) -> None:
    """JSON lines -> .bin/.idx read back with megatron-core's IndexedDataset: same ids (from an independent
    encoder), same sequences and document boundaries, dtype uint16 (optimal_dtype(300)); workers 1 and 2 write
    the same bytes; the record names the tokenizer; GPTDataset reads it with the tokenizer."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    src = _write_jsonl(str(tmp_path / "docs.jsonl"), DOCS)
    if kind == "gpt2":
        spec, (vocab, merges) = _gpt2(tok300), _gpt2_files(tok300)

        def encode(s: str) -> list[int]:
            return reference_gpt2_bpe(vocab, merges, s)
    else:
        spec, ref = _hf(tok300), AutoTokenizer.from_pretrained(tok300.hf_dir, local_files_only=True)

        def encode(s: str) -> list[int]:
            return ref.convert_tokens_to_ids(ref.tokenize(s))
    for append_eod in (True, False):
        out = str(tmp_path / f"{kind}_{append_eod}")
        r = build_indexed_dataset(json_documents(src), out, spec, append_eod=append_eod, workers=1)
        ds = IndexedDataset(out)
        want, bounds = _expected(DOCS, encode, 0 if append_eod else None)
        assert ds.index.dtype == np.uint16
        assert list(ds.document_indices) == bounds and len(bounds) == len(DOCS) + 1
        assert [ds[i].tolist() for i in range(len(ds))] == want
        assert (r.documents, r.sequences, r.tokens) == (len(DOCS), len(want), sum(map(len, want)))
        meta = read_meta(out)
        assert (meta.tokenizer.type, meta.tokenizer.vocab_size, meta.tokenizer.eod) == (spec.type, 300, 0)
        assert meta.max_token_id == max(max(s) for s in want) and meta.append_eod == append_eod
    par = str(tmp_path / f"{kind}_w2")
    build_indexed_dataset(json_documents(src), par, spec, workers=2)
    for ext in (".bin", ".idx"):
        with open(par + ext, "rb") as a, open(str(tmp_path / f"{kind}_True") + ext, "rb") as b:
            assert a.read() == b.read()
    tok = build_tokenizer(spec)
    check_data_path([par], tok)
    train = build_train_dataset([par], "100,0,0", 16, 1234, 8, tok)
    assert len(train) >= 8 and int(train[0]["tokens"].max()) < 300


def test_build_dataset_cli_progress_and_errors(tok300: TokenizerFiles, tmp_path, capsys) -> None:
    """The script: tokenizer flags, --workers, progress lines with docs/s and tokens/s when stderr is no
    terminal; a bad tokenizer file or JSON line is named and leaves no output behind."""
    src = _write_jsonl(str(tmp_path / "docs.jsonl"), training_text(120, seed=2))
    out = str(tmp_path / "cli")
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", tok300.vocab_file, "--merge-file", tok300.merge_file]
    assert bd.main(["--input", src, "--out", out, *gpt2, "--workers", "2", "--log-interval", "50"]) == 0
    cap = capsys.readouterr()
    assert regex.search(r"Processed 50 documents \([0-9.]+ docs/s, [0-9.]+ tokens/s", cap.err), cap.err
    assert "Processed 100 documents" in cap.err
    assert regex.search(r"120 documents, \d+ tokens \(GPT2BPETokenizer .*\); [0-9.]+ docs/s, [0-9.]+ tokens/s.* "
                        r"with 2 workers", cap.out), cap.out
    check_data_path([out], build_tokenizer(_gpt2(tok300)))
    bad = str(tmp_path / "bad")
    missing = str(tmp_path / "missing_vocab.json")
    assert bd.main(["--input", src, "--out", bad, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", missing,
                    "--merge-file", tok300.merge_file]) == 2
    assert f"--vocab-file {missing}: no such file" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": oops}\n')
    assert bd.main(["--input", str(broken), "--out", bad, "--workers", "2"]) == 2
    assert f"{broken}:2: not a JSON line" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bd.main(["--input", src, "--out", bad, "--tokenizer-type", "HuggingFaceTokenizer"])
    assert "needs --tokenizer-model" in capsys.readouterr().err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("bad")]


def _read_all(master: int) -> str:
    """Everything written to the pty (its slave end is closed): a pty delivers writes in pieces, one read may not
    return them all."""
    data = b""
    while True:
        try:
            piece = os.read(master, 1 << 16)
        except OSError:  # EIO: the slave end is closed and drained
            break
        if not piece:
            break
        data += piece
    os.close(master)
    return data.decode()


def test_progress_bar_on_a_terminal() -> None:
    """On a terminal (a real pty), the bar is redrawn in place with documents and tokens per second."""
    master, slave = os.openpty()
    tty.setraw(slave)  # no newline translation: what is read is what was written
    ticks = iter(float(i) for i in range(100))
    with open(slave, "w", closefd=True) as term:
        p = Progress(total_bytes=4000, stream=term, clock=lambda: next(ticks), redraw_s=0)
        assert p.interactive
        for _ in range(4):
            p.update(1, 250, 1000)
        p.close()
    out = _read_all(master)
    assert out.count("\r") == 5 and out.endswith("\n")
    assert "| 100% 0.0/0.0 MB" in out and "4 docs" in out and "tokens/s" in out and "docs/s" in out
    assert "#" * 24 in out and "|" + "#" * 6 + "." * 18 + "|  25%" in out


# ---------------------------------------------------------------- pretrain_gpt.py: flags and dataset checks

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "2",
        "--make-vocab-size-divisible-by", "16"]


def _flags(spec: TokenizerSpec) -> list[str]:
    if spec.type == "GPT2BPETokenizer":
        return ["--tokenizer-type", spec.type, "--vocab-file", spec.vocab_file, "--merge-file", spec.merge_file]
    return ["--tokenizer-type", spec.type, "--tokenizer-model", spec.tokenizer_model]


@pytest.fixture(scope="module")
def datasets(tok300: TokenizerFiles, tok400: TokenizerFiles, tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("datasets")
    texts = training_text(150, seed=7)
    out = {}
    for name, spec in (("gpt2_300", _gpt2(tok300)), ("hf_400", _hf(tok400))):
        out[name] = bd.build(texts, str(d / name), spec)[0]
    return out


def test_pretrain_takes_the_vocabulary_from_the_tokenizer(tok300, tok400, datasets) -> None:
    """--data-path with each tokenizer: the vocabulary is the tokenizer's, padded by Megatron's rule."""
    from tenplex_megatron.training.pretrain import parse_args

    a = parse_args([*BASE, "--data-path", datasets["gpt2_300"], *_flags(_gpt2(tok300))])
    b = parse_args([*BASE, "--data-path", datasets["hf_400"], *_flags(_hf(tok400))])
    assert (a.vocab_size, b.vocab_size) == (300, 400)
    assert a.tokenizer.type_name == "GPT2BPETokenizer" and b.tokenizer.type_name == "HuggingFaceTokenizer"
    assert [padded_vocab_size(300, 16, tp) for tp in (1, 2)] == [304, 320]
    assert restart_padded_vocab_size(300, 16, 1, 320) == 320  # a restart at TP1 keeps TP2's padding
    c = parse_args([*BASE, "--mock-data", *_flags(_gpt2(tok300))])
    assert c.vocab_size == 300  # the tokenizer sets the vocabulary with --mock-data too
    assert parse_args([*BASE, "--mock-data", "--vocab-size", "100"]).tokenizer is None


def test_dataset_built_with_another_tokenizer_is_named(tok300, tok400, datasets, tmp_path, capsys) -> None:
    """The recorded vocabulary size, the fingerprint, a stale record, and (without a record, as preprocess_data.py
    leaves it) the largest token id: each a clear error naming the file, raised while parsing flags."""
    from tenplex_megatron.training.pretrain import parse_args

    g300, h400 = datasets["gpt2_300"], datasets["hf_400"]

    def error(args: list[str]) -> str:
        with pytest.raises(SystemExit):
            parse_args([*BASE, *args])
        return capsys.readouterr().err

    err = error(["--data-path", g300, *_flags(_hf(tok400))])
    assert (f"--data-path {g300}: built with GPT2BPETokenizer (vocabulary 300, end of document 0) according to "
            f"{meta_path(g300)}, but the tokenizer given is HuggingFaceTokenizer (vocabulary 400") in err
    err = error(["--data-path", g300, *_flags(_hf(tok300))])  # same vocabulary size and eod, other files
    assert f"--data-path {g300}: built with another tokenizer according to {meta_path(g300)}" in err
    assert tok300.vocab_file in err and tok300.tokenizer_json in err
    # Without the record (a dataset of preprocess_data.py): the largest token id is found in the .bin.
    bare = str(tmp_path / "bare")
    for ext in (".bin", ".idx"):
        shutil.copy(h400 + ext, bare + ext)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(bare)
    largest = max(int(ds[i].max()) for i in range(len(ds)) if len(ds[i]))
    assert largest >= 300
    err = error(["--data-path", bare, *_flags(_gpt2(tok300))])
    assert (f"--data-path {bare}: {bare}.bin holds token id {largest}, but the tokenizer given (GPT2BPETokenizer) "
            "has a vocabulary of 300 (ids 0..299)") in err
    assert parse_args([*BASE, "--data-path", bare, *_flags(_hf(tok400))]).vocab_size == 400
    # A record that describes another .bin (the dataset was rebuilt by another tool), or does not parse.
    shutil.copy(meta_path(g300), meta_path(bare))
    assert f"{meta_path(bare)} describes another {bare}.bin" in error(["--data-path", bare, *_flags(_hf(tok400))])
    with open(meta_path(bare), "w") as f:
        f.write("{")
    assert f"--data-path {bare}: {meta_path(bare)} does not parse" in error(["--data-path", bare, *_flags(_hf(tok400))])
    # The byte-level default is checked the same way.
    assert f"according to {meta_path(g300)}" in error(["--data-path", g300])
    err = error(["--data-path", g300, *_flags(_gpt2(tok300)), "--vocab-size", "512"])
    assert "--vocab-size 512 does not match the tokenizer's vocabulary of 300" in err
    assert "--vocab-file does not apply to --tokenizer-type NullTokenizer" in error(
        ["--mock-data", "--vocab-size", "100", "--vocab-file", tok300.vocab_file])
    missing = str(tmp_path / "nothing")
    assert f"--tokenizer-model {missing}: no such file or directory" in error(
        ["--data-path", g300, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", missing])


def test_byte_level_documents_from_text_files_and_generated(tmp_path) -> None:
    """The default tokenizer still writes the byte-level datasets it did (and records itself)."""
    docs = bd.generated_documents(20, seed=3)
    prefix, tokens = bd.build(docs, str(tmp_path / "bytes"))
    meta = read_meta(prefix)
    assert (meta.tokenizer.type, meta.tokenizer.vocab_size, meta.max_token_id) == ("ByteLevel", 257, 256)
    assert tokens == sum(len(d.encode()) + 1 for d in docs)
    r = build_indexed_dataset([Document("text", "", "empty")], str(tmp_path / "one_empty"), TokenizerSpec())
    assert (r.documents, r.sequences, r.tokens, r.max_token_id) == (1, 0, 0, -1)


def test_bench_build_dataset_runs_at_its_smallest_size(tmp_path) -> None:
    """``benchmarks.build_dataset`` end to end on a tiny input (speed is measured there, not asserted here)."""
    out = tmp_path / "bench.json"
    assert bench_build_dataset.main(["--mb", "0.05", "--vocab", "300", "--workers", "1", "--megatron-lm", "", "--workdir",
                       str(tmp_path / "work"), "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["tokenizer"] for r in runs] == ["ByteLevel", "GPT2BPETokenizer", "HuggingFaceTokenizer"]
    assert all(r["tool"] == "build_dataset" and r["docs_per_s"] > 0 and r["tokens_per_s"] > 0 for r in runs)
    assert len({r["docs"] for r in runs}) == 1 and runs[0]["tokens"] > runs[1]["tokens"]  # BPE merges bytes
