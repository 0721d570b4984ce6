"""What the library logs, caught in a test: a handler on the ``tenplex_megatron`` logger (whatever its own handlers
show, and without relying on propagation to pytest's caplog). Imports nothing of torch or the multi-process suite."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def logged() -> Iterator[list[logging.LogRecord]]:
    """The records the library logs meanwhile, in order."""
    handler = _Records()
    logger = logging.getLogger("tenplex_megatron")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
