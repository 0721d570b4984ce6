"""The documentation site as built: every page's Markdown rendered (``scripts/check_site.py``), on the real site and
on a page built without the extensions it uses, which the check must name."""

from __future__ import annotations

import os
import subprocess
import sys

import markdown
import yaml

from scripts import check_site

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAGE = """# A page

!!! note "Read this"
    An admonition.

| a | b |
|---|---|
| 1 | 2 |

```
!!! in a code block is code, | and so | is this |
|---|---|
```
"""


def _build(config: str, site: str, ok: bool = True) -> str:
    # No --quiet: with it MkDocs 1.6 drops the warnings before strict mode counts them, and the build passes.
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", site],
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode == 0) == ok, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_every_page_of_the_site_renders(tmp_path) -> None:
    site = str(tmp_path / "site")
    _build(os.path.join(ROOT, "mkdocs.yml"), site)
    assert check_site.site_problems(site, os.path.join(ROOT, "docs")) == []


def _mini_site(tmp_path, extensions: list) -> tuple[str, str]:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(PAGE)
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump({"site_name": "t", "docs_dir": "docs", "use_directory_urls": False,
                                      "theme": {"name": "mkdocs"}, "markdown_extensions": extensions}))
    site = str(tmp_path / "site")
    _build(str(config), site)
    return site, str(docs)


def test_a_page_built_without_its_extensions_is_named(tmp_path) -> None:
    # The strict build passes (markup of a missing extension is just text to it); the check does not. MkDocs
    # always adds `tables`, so a page rendered without it comes from Python-Markdown itself, in the theme's body.
    site, docs = _mini_site(tmp_path, [])
    problems = check_site.site_problems(site, docs)
    assert problems == ["index.md: shows '!!!' as text, an admonition (`!!! note`): enable `admonition`"]
    assert check_site.main([site, docs]) == 1
    body = markdown.markdown(PAGE, extensions=["fenced_code"])
    problems = check_site.page_problems(PAGE, f'<div role="main">{body}</div>')
    assert any(p.startswith("shows '| a | b |' as text") for p in problems), problems
    assert "renders 0 <table> of its 1 Markdown tables: enable `tables`" in problems


def test_the_projects_extensions_render_the_same_page(tmp_path) -> None:
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        extensions = yaml.safe_load(f)["markdown_extensions"]
    site, docs = _mini_site(tmp_path, extensions)
    assert check_site.site_problems(site, docs) == []
    assert check_site.main([site, docs]) == 0


def test_a_link_to_a_missing_anchor_fails_the_strict_build(tmp_path) -> None:
    # The project's validation settings, as `make docs` builds with them: a link to an anchor no page has fails.
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        validation = yaml.safe_load(f)["validation"]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# A page\n\n[there](other.md#nowhere)\n")
    (docs / "other.md").write_text("# Other\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump({"site_name": "t", "docs_dir": "docs", "use_directory_urls": False,
                                      "theme": {"name": "mkdocs"}, "validation": validation}))
    assert "#nowhere" in _build(str(config), str(tmp_path / "site"), ok=False)


def test_tables_are_counted_outside_code_blocks() -> None:
    assert check_site.markdown_tables(PAGE) == 1
    assert check_site.markdown_tables("a\n\n| x |\n|:---:|\n| 1 |\n\nx | y\n--- | ---\n1 | 2\n") == 2
