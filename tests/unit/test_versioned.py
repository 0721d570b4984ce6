"""The one reader of versioned JSON headers: another document, a missing, mistyped or unread version is the caller's
error naming where; a document of a version this build reads comes back as it is."""

from __future__ import annotations

import pytest

from tenplex_megatron.plan.versioned import VersionedFormat


class DocError(ValueError):
    pass


NAMED = VersionedFormat("demo file", "format_version", (1, 2), DocError, name="demo", version_label="format version")
SHAPED = VersionedFormat('{"version": 1, "rows": [...]}', "version", (1,), DocError)


def test_a_document_of_a_version_this_build_reads_comes_back_unchanged() -> None:
    doc = {"format": "demo", "format_version": 2, "x": [1]}
    assert NAMED.check(doc, "f.json") is doc
    assert SHAPED.check({"version": 1}) == {"version": 1}


@pytest.mark.parametrize(("fmt", "doc", "message"), [
    (NAMED, [1, 2], r"^f\.json: not a demo file$"),
    (NAMED, {"format": "other", "format_version": 1}, r"^f\.json: not a demo file$"),
    (NAMED, {"format_version": 1}, r"^f\.json: not a demo file$"),
    (NAMED, {"format": "demo"}, r"^f\.json: format version None, this build reads 1, 2$"),
    (NAMED, {"format": "demo", "format_version": True}, r"^f\.json: format version True, this build reads 1, 2$"),
    (NAMED, {"format": "demo", "format_version": "1"}, r"format version '1', this build reads 1, 2$"),
    (NAMED, {"format": "demo", "format_version": 3}, r"version 3, this build reads 1, 2; a newer tenplex-megatron"),
    (SHAPED, "rows", r'^f\.json: expected an object \(\{"version": 1, "rows": \[\.\.\.\]\}\)$'),
    (SHAPED, {"version": 0}, r"^f\.json:1:2: version 0 is not supported \(this build reads 1\)$"),
    (SHAPED, {"version": 1.0}, r"version 1\.0 is not supported"),
])
def test_another_document_or_an_unread_version_is_the_callers_error_naming_where(fmt, doc, message) -> None:
    with pytest.raises(DocError, match=message):
        fmt.check(doc, "f.json", "f.json:1:2" if fmt is SHAPED else None)
