"""Every message ``docs/troubleshooting.md`` quotes in its tables is one the code can produce.

The "message" column's backticked text is split on ``...`` (names and numbers) and on the placeholders the page
names (``N``, ``FILE``...); each literal piece must be found in a string of the package's source
(``tenplex_megatron/``, ``scripts/pretrain_gpt.py``, read with ``ast``: an f-string's fields count as
placeholders, adjacent literals are one string) or in a line the Megatron-LM patches add, or across two such
strings where one is put into a field of the other (``f"{what}: writing shards"`` into ``f"{what} failed on"``). A quote that is another
program's message, or a name rather than a message, is listed in :data:`NOT_OURS` with whose it is.
"""

from __future__ import annotations

import ast
import builtins
import glob
import os
import re

from tests.harness import ROOT

PAGE = os.path.join(ROOT, "docs", "troubleshooting.md")
#: a formatted field of an f-string, as it stands in the corpus
FIELD = "\x00"
#: the capitals the page uses for a value (a number, a name, a path), as the page's introduction says
PLACEHOLDERS = ("N", "M", "K", "R", "I", "X", "Y", "G", "D", "DIR", "FILE", "PREFIX", "MOUNT", "PATH", "CLASS",
                "FIELD", "NNNNN")
#: quotes of the message column that are not tenplex-megatron's messages: the quote, and whose it is
NOT_OURS = {
    "triton": "a Python module Megatron-LM imports (a name, not a message)",
    "six": "a Python module Megatron-LM imports (a name, not a message)",
    "unrecognized arguments: --tenplex": "argparse's, in the parser of a Megatron-LM pretrain_gpt.py without the patch",
    "(TP, PP) mismatch after resume (... vs ... from checkpoint): not supported for DistributedOptimizer with "
    "sharding type dp_reshardable": "Megatron-LM's own, from megatron/training/checkpointing.py",
    "OSError: [Errno 28] No space left on device": "the operating system's, raised by Python's file calls",
    "mp_rank_01...": "a file name of DeepSpeed's pipeline checkpoints, not a message",
}


def _field(node: ast.expr) -> str:
    """An f-string's field: :data:`FIELD`, in quotes where it is a ``!r`` (the repr of a name is quoted)."""
    return f"'{FIELD}'" if isinstance(node, ast.FormattedValue) and node.conversion == ord("r") else FIELD


def _strings(tree: ast.AST) -> list[str]:
    """Every string literal of a module; an f-string with each field as :data:`_field` writes it."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            out.append("".join(v.value if isinstance(v, ast.Constant) else _field(v) for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
    return out


def corpus() -> tuple[list[str], set[str]]:
    """The strings the package, the reference trainer and the patches can put into a message, and the names of
    the classes they define."""
    files = glob.glob(os.path.join(ROOT, "tenplex_megatron", "**", "*.py"), recursive=True)
    files.append(os.path.join(ROOT, "scripts", "pretrain_gpt.py"))
    out, classes = [], set()
    for path in files:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        out += _strings(tree)
        classes |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for path in glob.glob(os.path.join(ROOT, "patches", "*.patch")):
        with open(path, encoding="utf-8") as f:
            out += [line[1:] for line in f if line.startswith("+") and not line.startswith("+++")]
    return out, classes


def rows() -> list[tuple[int, str]]:
    """(line number, message cell) of every table row of the page but the header."""
    found = []
    with open(PAGE, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.startswith("| ") and not line.startswith(("| message |", "|---")):
                found.append((n, line.split(" | ")[0][2:]))
    return found


def quotes(cell: str) -> list[str]:
    """The backticked text of a cell."""
    return re.findall(r"`([^`]+)`", cell)


def pieces(quote: str, classes: set[str]) -> list[str]:
    """A quote's literal pieces: split on ``...`` and the placeholders, a leading ``SomeError: `` (the exception's
    type, as a rank's failure shows it) dropped when the package or Python defines that class; each piece stripped
    (the spaces beside a value are the value's), blanks dropped."""
    m = re.match(r"^(\w+): ", quote)
    if m and (m.group(1) in classes or isinstance(getattr(builtins, m.group(1), None), type)):
        quote = quote[m.end():]
    words = "|".join(sorted(PLACEHOLDERS, key=len, reverse=True))
    return [p.strip() for p in re.split(rf"\.\.\.|\b(?:{words})\b", quote) if p.strip()]


def found(piece: str, strings: list[str]) -> bool:
    """Whether a source string holds the piece, or two do where the code puts one into the other: the piece's head
    ends one string, or stands before a field of it, and its tail starts another, or follows a field of it."""
    if any(piece in s for s in strings):
        return True
    for cut in range(1, len(piece)):
        head, tail = piece[:cut], piece[cut:]
        if any(s.endswith(head) or head + FIELD in s for s in strings) and \
                any(s.startswith(tail) or FIELD + tail in s for s in strings):
            return True
    return False


def missing_pieces(quote: str, strings: list[str], classes: set[str]) -> list[str]:
    """The literal pieces of a quote that the source cannot produce."""
    return [p for p in pieces(quote, classes) if not found(p, strings)]


def test_every_quoted_message_is_in_the_source() -> None:
    strings, classes = corpus()
    missing = [f"docs/troubleshooting.md:{n}: `{q}`: {gone}" for n, cell in rows() for q in quotes(cell)
               if q not in NOT_OURS and (gone := missing_pieces(q, strings, classes))]
    assert missing == [], "quoted but not in the source:\n" + "\n".join(missing)


def test_the_check_catches_a_message_the_code_cannot_produce() -> None:
    # The same walk over the page, with one real quote changed by a word: the changed quote alone is reported.
    strings, classes = corpus()
    checked = [q for _, cell in rows() for q in quotes(cell) if q not in NOT_OURS]
    assert len(checked) >= 60, "the walk found the page's quoted messages"
    real = "no usable layout for world size N ..."
    assert real in checked and missing_pieces(real, strings, classes) == []
    assert missing_pieces(real.replace("usable", "useful"), strings, classes) == ["no useful layout for world size"]
    assert missing_pieces("CheckpointFileError: FILE: size N bytes", strings, classes) == []  # the type dropped
    assert missing_pieces("NoSuchError: FILE: size N bytes", strings, classes) == ["NoSuchError:"]


def test_every_exception_is_still_quoted_and_says_whose() -> None:
    quoted = {q for _, cell in rows() for q in quotes(cell)}
    stale = sorted(set(NOT_OURS) - quoted)
    assert stale == [], f"NOT_OURS lists quotes the page no longer has: {stale}"
    assert all(len(why.split()) >= 3 for why in NOT_OURS.values())
