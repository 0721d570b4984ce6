"""DeepSpeed adapter: re-shard ZeRO-1/2/3 engines (and PipelineModule stages) to a new DP/PP size.

The adapter to the framework only (``DeepSpeedAdapter``: an engine's state described from DeepSpeed's own
bookkeeping, ``zero.py``; DeepSpeed's own ``global_stepN`` files read in place, ``native.py``). The calls users make
(``save_checkpoint``, ``load_checkpoint``, the host-memory ones) are the front door's: ``tenplex_megatron.deepspeed``.
Needs the ``[deepspeed]`` extra: without DeepSpeed, importing this package says which.
"""

from typing import Any

from tenplex_megatron._optional import require

require("deepspeed", "deepspeed", needed_by="tenplex_megatron.integrations.deepspeed")

from tenplex_megatron.integrations.deepspeed.adapter import DeepSpeedAdapter  # noqa: E402
from tenplex_megatron.integrations.deepspeed.zero import DeepSpeedStateError  # noqa: E402

__all__ = ["DeepSpeedAdapter", "DeepSpeedStateError"]

#: the calls that moved to the front door, each named by its new import path when asked for here
MOVED = frozenset({"claim_save_dir", "finish_memory", "load_checkpoint", "load_latest", "open_checkpointer",
                   "open_memory", "save_checkpoint", "save_snapshot", "LoadResult"})


def __getattr__(name: str) -> Any:
    """A moved call is named with its new path (PEP 562), rather than a bare AttributeError."""
    if name in MOVED:
        raise AttributeError(f"tenplex_megatron.integrations.deepspeed.{name} moved: "
                             f"from tenplex_megatron.deepspeed import {name}")
    raise AttributeError(f"module 'tenplex_megatron.integrations.deepspeed' has no attribute {name!r}")
