"""One reader for the package's versioned JSON documents: is this the format, at a version this build reads?

Every file and message tenplex-megatron writes carries a version (and, where it names itself, a ``format`` key); a
:class:`VersionedFormat` says how to recognise one and raises the caller's error type, naming where, when it is
another document or a version this build does not read. Pure Python, so every layer can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VersionedFormat:
    """A versioned JSON document: its ``format`` value (None: recognised by its shape), version key and versions."""

    kind: str  # what errors call it: "tenplex-megatron metadata file", or a shape '{"version": 1, "events": [...]}'
    version_key: str  # "version", "format_version", "ptc_version"
    versions: tuple[int, ...]  # the versions this build reads
    error: type[Exception]  # raised when a document is not this format or not a version it reads
    name: str | None = None  # the value of the document's "format" key; None: the document has no such key
    version_label: str = "version"  # how errors name the version: "format version", "lease format version"

    def check(self, doc: object, where: str = "", version_where: str | None = None) -> dict[str, Any]:
        """``doc`` itself when it is this format at a version this build reads; else :attr:`error` naming ``where``
        (``version_where`` for a bad version, e.g. the version's line and column; default ``where``)."""
        prefix = f"{where}: " if where else ""
        if self.name is None and not isinstance(doc, dict):
            raise self.error(f"{prefix}expected an object ({self.kind})")
        if self.name is not None and (not isinstance(doc, dict) or doc.get("format") != self.name):
            raise self.error(f"{prefix}not a {self.kind}")
        assert isinstance(doc, dict)
        version = doc.get(self.version_key)
        if type(version) is int and version in self.versions:
            return doc
        at = f"{version_where}: " if version_where else prefix
        readable = ", ".join(map(str, self.versions))
        newer = "; a newer tenplex-megatron wrote it" if type(version) is int and version > max(self.versions) else ""
        if self.name is None:
            raise self.error(f"{at}{self.version_label} {version!r} is not supported (this build reads {readable})"
                             f"{newer}")
        raise self.error(f"{at}{self.version_label} {version!r}, this build reads {readable}{newer}")
