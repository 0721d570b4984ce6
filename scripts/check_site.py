"""Check the built documentation site against its sources: every page rendered as its Markdown means.

    python -m scripts.check_site site docs      # after `mkdocs build`; exit 1 naming each page and what it shows

``mkdocs build --strict`` catches broken links and anchors, but a page written for a Markdown extension that
``mkdocs.yml`` does not enable builds without a warning and shows its markup as text (an admonition as a literal
``!!! warning`` paragraph, a table as rows of pipes). ``make docs`` runs this after the build;
``tests/unit/test_docs_site.py`` runs it on the real site and on a page built without the extensions.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from html.parser import HTMLParser

# Markup of Python-Markdown extensions that, when the extension is off, reaches the page as text. Each pattern is
# matched against the page's text outside <code> and <pre>, so a page may still show the markup as code.
UNRENDERED = (
    (re.compile(r"!!!"), "an admonition (`!!! note`): enable `admonition`"),
    (re.compile(r"\?\?\?\+?\s"), "a collapsible block (`???`): enable `pymdownx.details`"),
    (re.compile(r'===\+? "'), 'a tab (`=== "name"`): enable `pymdownx.tabbed`'),
    (re.compile(r"\[\^[^\]]+\]"), "a footnote (`[^1]`): enable `footnotes`"),
    (re.compile(r"\{\s*[:#.][^}]*\}"), "an attribute list (`{: ...}`, `{#id}`): enable `attr_list`"),
    (re.compile(r"(?m)^\s*\|.*\|\s*$"), "a table row as text (`| a | b |`): enable `tables`"),
)

# A Markdown table's delimiter row (`|---|:---:|`), the one line every table has exactly once.
_DELIMITER = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_tables(text: str) -> int:
    """How many tables a Markdown page holds: delimiter rows outside fenced code blocks."""
    count, fenced = 0, False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and "|" in line and _DELIMITER.match(line):
            count += 1
    return count


class _PageText(HTMLParser):
    """The page body's text outside <code>, <pre> and <script>, one string per block, and its <table> count."""

    _SKIP = {"code", "pre", "script", "style"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth = 0
        self.main_divs = 0  # open <div>s from the theme's <div role="main"> down: the page body
        self.tables = 0
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "div" and (self.main_divs or ("role", "main") in attrs):
            self.main_divs += 1
        if tag in self._SKIP:
            self.depth += 1
        if tag == "table" and self.main_divs:
            self.tables += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP and self.depth:
            self.depth -= 1
        if tag == "div" and self.main_divs:
            self.main_divs -= 1

    def handle_data(self, data: str) -> None:
        if self.main_divs and not self.depth:
            self.text.append(data)


def page_problems(markdown: str, html: str) -> list[str]:
    """What a page's HTML shows of markup it did not render: each unrendered extension once, and tables lost."""
    parser = _PageText()
    parser.feed(html)
    text = "".join(parser.text)
    problems = []
    for pattern, what in UNRENDERED:
        m = pattern.search(text)
        if m:
            problems.append(f"shows {m.group(0).strip()!r} as text, {what}")
    want = markdown_tables(markdown)
    if parser.tables != want:
        problems.append(f"renders {parser.tables} <table> of its {want} Markdown tables: enable `tables`")
    return problems


def site_problems(site_dir: str, docs_dir: str) -> list[str]:
    """Every problem of every page of ``docs_dir`` in the site built into ``site_dir`` (use_directory_urls off)."""
    problems = []
    for root, _dirs, files in os.walk(docs_dir):
        for name in sorted(files):
            if not name.endswith(".md"):
                continue
            src = os.path.join(root, name)
            rel = os.path.relpath(src, docs_dir)
            out = os.path.join(site_dir, "index.html" if rel == "README.md" else rel[: -len(".md")] + ".html")
            if not os.path.isfile(out):
                problems.append(f"{rel}: not built ({out} is missing)")
                continue
            with open(src, encoding="utf-8") as f:
                markdown = f.read()
            with open(out, encoding="utf-8") as f:
                html = f.read()
            problems += [f"{rel}: {p}" for p in page_problems(markdown, html)]
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("site", help="the built site (mkdocs.yml's site_dir)")
    ap.add_argument("docs", help="the Markdown sources (mkdocs.yml's docs_dir)")
    args = ap.parse_args(argv)
    problems = site_problems(args.site, args.docs)
    for p in problems:
        print(f"check_site: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
