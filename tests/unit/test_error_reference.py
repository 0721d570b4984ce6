"""``docs/errors.md`` (Error types) is what ``python -m tenplex_megatron.docs_reference`` writes, and lists every
exception class of the package (found by test_error_root.py's own walk) with its module, bases and docstring."""

from __future__ import annotations

import re

import pytest

from tenplex_megatron import docs_reference, error_reference
from tests.unit.test_error_root import _exception_classes


def _rows(page: str) -> dict[str, tuple[str, str, str]]:
    """The page's table: 'module.Class' -> (module, bases, what), from the Markdown itself."""
    rows = {}
    for line in page.splitlines():
        m = re.match(r"^\| `(\w+)` \| `([\w.]+)` \| (.+?) \| (.+) \|$", line)
        if m:
            rows[f"{m.group(2)}.{m.group(1)}"] = (m.group(2), m.group(3), m.group(4))
    return rows


def test_the_error_page_is_current() -> None:
    with open(docs_reference.ERRORS_OUT, encoding="utf-8") as f:
        page = f.read()
    assert page == error_reference.render_errors(), \
        "docs/errors.md is stale: run python -m tenplex_megatron.docs_reference"


def test_every_error_class_is_on_the_page_with_its_module_bases_and_docstring() -> None:
    with open(docs_reference.ERRORS_OUT, encoding="utf-8") as f:
        rows = _rows(f.read())
    classes = _exception_classes()
    assert len(classes) >= 20  # the walk really found the package's classes
    for cls in classes:
        key = f"{cls.__module__}.{cls.__qualname__}"
        assert key in rows, f"{key} is not on docs/errors.md"
        module, bases, what = rows[key]
        assert module == cls.__module__
        assert re.findall(r"`(\w+)`", bases) == [b.__name__ for b in cls.__bases__], key
        doc = (cls.__dict__.get("__doc__") or "").strip()
        assert doc, f"{key} has no docstring"
        words = re.findall(r"[A-Za-z]{4,}", re.sub(r":\w+:", "", doc.splitlines()[0]))  # reST roles dropped
        assert words and all(w in what for w in words), (key, what)
    assert len(rows) == len(classes), sorted(set(rows) - {f"{c.__module__}.{c.__qualname__}" for c in classes})


def test_a_subclass_follows_its_base_and_an_undocumented_class_is_refused_by_name() -> None:
    order = error_reference.error_classes()
    assert order[0].__name__ == "TenplexError"
    for i, cls in enumerate(order[1:], 1):
        assert all(order.index(b) < i for b in cls.__bases__ if b in order), cls

    class Undocumented(error_reference.TenplexError):
        pass

    with pytest.raises(ValueError, match=r"test_error_reference\..*Undocumented has no docstring"):
        error_reference.summary(Undocumented)
    assert error_reference.summary(type("Roles", (), {"__doc__": "A closed :class:`~x.Checkpointer`, ``x``.\n"
                                                                 "more"})) == "A closed `Checkpointer`, `x`."
