"""The README and the documentation pages: short, linked, and written as reference (not as a lab notebook).

``make docs`` builds the site strictly (broken links, missing anchors, pages left out of the navigation); these
checks need no mkdocs: the README's size and links, every page in the navigation, no diary words.
"""

from __future__ import annotations

import os
import re

from scripts import support_table
from tests.harness import ROOT

DOCS = os.path.join(ROOT, "docs")
PAGES = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_readme_is_short_and_its_links_resolve() -> None:
    readme = _read("README.md")
    assert len(readme.splitlines()) <= 200, "README.md: at most 200 lines; the rest goes into docs/"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert links, "README.md links into docs/"
    for link in links:
        if "://" in link:
            continue
        assert not link.startswith(".."), f"README.md links outside the repository: {link}"
        assert os.path.exists(os.path.join(ROOT, link)), f"README.md: broken link {link}"


def test_every_page_is_in_the_navigation() -> None:
    nav = _read("mkdocs.yml")
    for page in PAGES:
        assert re.search(rf":\s+{re.escape(page)}\s*$", nav, re.M), f"docs/{page} is not in mkdocs.yml's nav"


# A reader's page states what holds; how it came to hold goes into commit messages, plans into issues. Each pattern
# is matched in prose only (fenced code blocks and code spans are left out: a command or a log may say anything),
# case-insensitively, and names one habit of a lab notebook.
DIARY = (
    # An issue reference: the reader has no tracker; say what the thing is. `&#124;` (an HTML entity) and a link's
    # `page.md#anchor` and a link to an anchor of the same page, `](#1-install)`, are not references; a number after
    # `#` preceded by a letter, `&`, `/`, `#` or a link's opening parenthesis is left alone.
    (r"(?<![\w&/#])(?<!\]\()#\d+\b", "an issue reference (#N): say what the thing is"),
    (r"\bissues? \d+\b|\b(?:the|this|that) issue's\b", "an issue named in words: say what the thing is"),
    # Changelog wording: what a reader sees is the current state, compared with nothing.
    (r"\bno longer\b", "changelog wording ('no longer'): say what holds"),
    (r"\bfor the record\b", "'for the record': a figure is there because it says something; say what"),
    # Plans: what is not done is a limit ("not supported", "not run"), said as such.
    (r"\bis the next step\b|\bthe next step is\b|\bthe next GPU run\b", "a plan: say what is missing as a limit"),
    # The machine's momentary state: a figure's caption names the machine and says whether it was shared.
    (r"\bload averages?\b|\bunder load\b|\bat (?:a )?load (?:of )?\d", "a load average: name the machine and say it "
     "was shared"),
    # 'here' for this machine or this run: the reader is elsewhere; name the machine or the run.
    (r"\b(?:seen|measured|ran|runs|run|built from nothing|lost) here\b|\b\d+(?:\.\d+)? s(?: of wall time)? here\b",
     "'here' meaning the machine or the run: name it"),
)


def prose(text: str) -> str:
    """A page without its fenced code blocks and code spans, line numbers kept (a code line becomes empty)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return "\n".join(lines)


def diary(text: str) -> list[str]:
    """Every diary habit of a page, as 'line N: what (the words)'. Patterns span line breaks (Markdown wraps)."""
    body = prose(text)
    found = []
    for pattern, what in DIARY:
        for m in re.finditer(pattern.replace(" ", r"\s+"), body, re.I):
            found.append(f"line {body.count(chr(10), 0, m.start()) + 1}: {what} ({m.group(0)!r})")
    return found


def test_no_page_reads_as_a_lab_notebook() -> None:
    problems = []
    for name in ["README.md"] + [f"docs/{p}" for p in PAGES]:
        problems += [f"{name}: {p}" for p in diary(_read(*name.split("/")))]
    assert problems == [], "\n".join(problems)


def test_the_diary_check_finds_each_habit_in_prose_only() -> None:
    page = """See issue #4's targets and issue 13. It no longer hangs; for the record, the next step is a
fix. Measured under load (load average 12) and at load 3, seen here, 38 s here.

```
git log --grep '#4' --grep 'no longer'   # code may say anything
```

`#4` and `measured here` in code spans; [a link](page.md#section-2), `&#124;` and a rank 3 are prose.
"""
    found = diary(page)
    for words in ("'#4'", "'issue 13'", "'no longer'", "'for the record'", "'the next step is'", "'under load'",
                  "'load average'", "'at load 3'", "'seen here'", "'38 s here'"):
        assert any(words in f for f in found), (words, found)
    assert all(f.startswith(("line 1:", "line 2:")) for f in found), found
    assert len(found) == 10, found
    assert diary("wrapped over\na line: it no\nlonger") == ["line 2: changelog wording ('no longer'): say what "
                                                             "holds ('no\\nlonger')"]


def test_no_page_speaks_of_sessions() -> None:
    for name, text in [("README.md", _read("README.md"))] + [(f"docs/{p}", _read("docs", p)) for p in PAGES]:
        assert not re.search(r"\bsessions?\b", text, re.I), f"{name}: history goes into commit messages"
        assert "../shared/" not in text, f"{name}: links outside the repository"


def test_the_readmes_support_table_is_support_md_s() -> None:
    # One source of truth: docs/support.md's "At a glance" table, copied with its links made relative to the root.
    readme, support = _read("README.md"), _read("docs", "support.md")
    assert support_table.readme_with_table(readme, support) == readme, \
        "README.md's support table differs from docs/support.md's 'At a glance': python -m scripts.support_table"
    assert support_table.main(["--check"]) == 0
    row = next(line for line in support_table.glance(support).splitlines() if line.startswith("| DeepSpeed |"))
    changed = support.replace(row, row.replace("ZeRO-0", "ZeRO-0, ZeRO++"))
    assert support_table.readme_with_table(readme, changed) != readme  # a changed row is a different copy
    assert "](docs/gpu.md)" in support_table.for_readme("[GPU check](gpu.md)")
    assert support_table.for_readme("[x](#limits) [y](https://a.b/c.md)") == \
        "[x](docs/support.md#limits) [y](https://a.b/c.md)"


def test_the_readmes_quickstart_is_what_the_code_runs_and_prints() -> None:
    # The quickstart's patch exists, its Megatron-LM flags are ones the opt-in suite runs pretrain_gpt.py with, its
    # --tenplex flags are the hook's, and the restart line it shows is the hook's own (restart_sources.loaded_line
    # behind the package logger's prefix), with N, X and S standing for the figures.
    from tenplex_megatron import flags
    from tenplex_megatron.engine.load import LoadResult
    from tenplex_megatron.frontdoor.restart_sources import loaded_line
    from tenplex_megatron.log import PREFIX
    from tenplex_megatron.plan.layout import ParallelLayout

    section = _read("README.md").split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```\n(.*?)```", section, re.S)
    assert len(blocks) >= 2, "README.md's quickstart: the commands, then what a restart prints"
    commands, printed = blocks[0], blocks[1].strip()

    patches = re.findall(r"git apply \.\./tenplex-megatron/(\S+)", commands)
    assert patches and all(os.path.isfile(os.path.join(ROOT, p)) for p in patches), patches
    suite = _read("tests", "megatron_lm", "test_megatron_lm.py") + _read("tests", "megatron_lm", "run_megatron_lm.py")
    torchrun = [line for line in commands.splitlines() if line.startswith("torchrun ")]
    assert len(torchrun) == 2, commands
    for flag in {f for line in torchrun for f in re.findall(r"--[a-z][a-z_-]*", line)} - {"--nproc_per_node"}:
        if flag.startswith("--tenplex"):
            assert flag in {f.name for f in flags.flags_for(flags.HOOK)}, f"README.md quickstart: {flag}"
        else:
            assert f'"{flag}"' in suite, f"README.md quickstart: {flag} is not a flag the opt-in suite runs"

    src, dst = (ParallelLayout(**{k: int(v) for k, v in (kv.split("=") for kv in side.split(","))})
                for side in re.search(r"layout (\S+) -> (\S+),", printed).groups())
    res = LoadResult(path="ckpt/iter_0000500", iteration=500, source_layout=src.to_json(), bytes_read=12_345_678,
                     bytes_filled=0, tensors=42, seconds=1.5, rng_exact=False)
    pattern = re.escape(printed).replace("N\\ tensors", r"\d+\ tensors").replace("X\\ MB", r"[\d.]+\ MB")
    pattern = pattern.replace("in\\ S\\ s", r"in\ [\d.]+\ s")
    assert re.fullmatch(pattern, PREFIX + loaded_line(res, dst)), (printed, PREFIX + loaded_line(res, dst))
