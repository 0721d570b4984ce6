"""Copy the support table of ``docs/support.md`` ("At a glance") into ``README.md``: one source of truth.

    python -m scripts.support_table            # rewrite README.md's table from docs/support.md
    python -m scripts.support_table --check    # exit 1 if README.md's table is not the copy

The README's table sits between two HTML comments (``BEGIN``/``END`` below); links relative to ``docs/`` are
rewritten to work from the repository's root. ``tests/unit/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORT = os.path.join(ROOT, "docs", "support.md")
README = os.path.join(ROOT, "README.md")
HEADING = "## At a glance"
BEGIN = "<!-- support table: a copy of docs/support.md's 'At a glance' (python -m scripts.support_table) -->"
END = "<!-- end of the support table -->"


def glance(support: str) -> str:
    """The first table under docs/support.md's "At a glance" heading, its lines as they are."""
    if HEADING not in support:
        raise ValueError(f"docs/support.md: no {HEADING!r} heading")
    rows = []
    for line in support.split(HEADING, 1)[1].splitlines():
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    if len(rows) < 3:
        raise ValueError(f"docs/support.md: no table under {HEADING!r}")
    return "\n".join(rows)


def for_readme(table: str) -> str:
    """The table with its links made relative to the repository's root: ``x.md`` -> ``docs/x.md``, ``#a`` ->
    ``docs/support.md#a``."""
    table = re.sub(r"\]\((?![a-z]+://|#)([^)]+)\)", r"](docs/\1)", table)
    return re.sub(r"\]\(#([^)]+)\)", r"](docs/support.md#\1)", table)


def readme_with_table(readme: str, support: str) -> str:
    """README.md's text with the block between BEGIN and END replaced by the copy."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise ValueError(f"README.md: needs the support table's markers once each: {BEGIN} ... {END}")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{for_readme(glance(support))}\n\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md's table is not the copy")
    args = ap.parse_args(argv)
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    with open(SUPPORT, encoding="utf-8") as f:
        support = f.read()
    want = readme_with_table(readme, support)
    if args.check:
        if want != readme:
            print("README.md: its support table is not docs/support.md's 'At a glance': "
                  "run python -m scripts.support_table", file=sys.stderr)
            return 1
        return 0
    if want != readme:
        with open(README, "w", encoding="utf-8") as f:
            f.write(want)
        print(f"wrote {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
