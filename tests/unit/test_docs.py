"""The README and the documentation pages: short, linked, and written as reference (not as a lab notebook).

``make docs`` builds the site strictly (broken links, missing anchors, pages left out of the navigation); these
checks need no mkdocs: the README's size and links, every page in the navigation, no diary words.
"""

from __future__ import annotations

import os
import re

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


def test_no_page_speaks_of_sessions() -> None:
    for name, text in [("README.md", _read("README.md"))] + [(f"docs/{p}", _read("docs", p)) for p in PAGES]:
        assert not re.search(r"\bsessions?\b", text, re.I), f"{name}: history goes into commit messages"
        assert "../shared/" not in text, f"{name}: links outside the repository"
