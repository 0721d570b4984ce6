"""Tokenizers the tests make themselves, from text they write: nothing is downloaded.

A small byte-level BPE is trained by the ``tokenizers`` library and saved as ``tokenizer.json`` (plus a
``tokenizer_config.json`` naming its eos token, so transformers' ``AutoTokenizer`` reads the directory);
GPT-2-format ``vocab.json`` + ``merges.txt`` are derived from that ``tokenizer.json`` as GPT-2's own files
are laid out (``#version`` line, then one merge per line, highest priority first).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

EOT = "<|endoftext|>"

WORDS = ("the a of and to in is it that was for on are with as I his they be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said an each she which do their "
         "time if will way about many then them write would like so these her long make thing see him two has look "
         "more day could go come did number sound no most people my over know water than call first who may down "
         "side been now find tensor pipeline shard layout checkpoint restart GPU café naïve façade über ✓ 数据").split()


def training_text(n: int = 400, seed: int = 0) -> list[str]:
    """Deterministic English-like lines with numbers, punctuation, contractions and some non-ASCII."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 999)))
        if rng.random() < 0.2:
            words.append(rng.choice(["it's", "we'll", "they're", "don't", "I'm"]))
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ",", ":"]))
    return lines


@dataclass(frozen=True)
class TokenizerFiles:
    """One trained BPE in both formats."""

    tokenizer_json: str  # the tokenizers library's file
    hf_dir: str  # tokenizer.json + tokenizer_config.json (eos_token)
    vocab_file: str  # GPT-2 vocab.json derived from tokenizer.json
    merge_file: str  # GPT-2 merges.txt derived from tokenizer.json
    vocab_size: int


def train_bpe(texts: list[str], vocab_size: int, post_bos: bool = False):
    """A byte-level BPE with ``<|endoftext|>`` (id 0) trained to ``vocab_size`` on ``texts``.

    ``post_bos``: a post-processor that puts ``<|endoftext|>`` before every text (a BOS, as some tokenizers do).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"the training text allows only {tok.get_vocab_size()} tokens, {vocab_size} asked")
    if post_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", special_tokens=[(EOT, 0)])
    return tok


def derive_gpt2_files(tokenizer_json: str, out_dir: str) -> tuple[str, str]:
    """GPT-2 ``vocab.json`` + ``merges.txt`` holding the BPE of a ``tokenizer.json``."""
    with open(tokenizer_json, encoding="utf-8") as f:
        model = json.load(f)["model"]
    assert model["type"] == "BPE"
    vocab, merges = os.path.join(out_dir, "vocab.json"), os.path.join(out_dir, "merges.txt")
    with open(vocab, "w", encoding="utf-8") as f:
        json.dump(model["vocab"], f, ensure_ascii=False)
    with open(merges, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for m in model["merges"]:
            a, b = m if isinstance(m, list) else m.split(" ")
            f.write(f"{a} {b}\n")
    return vocab, merges


def make_tokenizer_files(root: str, vocab_size: int, seed: int = 0, post_bos: bool = False,
                         texts: list[str] | None = None) -> TokenizerFiles:
    """Train a BPE of ``vocab_size`` on ``texts`` (default: generated text) and write it in both formats under ``root``."""
    os.makedirs(root, exist_ok=True)
    tok = train_bpe(texts if texts is not None else training_text(seed=seed), vocab_size, post_bos)
    hf_dir = os.path.join(root, "hf")
    os.makedirs(hf_dir, exist_ok=True)
    tokenizer_json = os.path.join(hf_dir, "tokenizer.json")
    tok.save(tokenizer_json)
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT}, f)
    gpt2_dir = os.path.join(root, "gpt2")
    os.makedirs(gpt2_dir, exist_ok=True)
    vocab, merges = derive_gpt2_files(tokenizer_json, gpt2_dir)
    return TokenizerFiles(tokenizer_json, hf_dir, vocab, merges, vocab_size)
