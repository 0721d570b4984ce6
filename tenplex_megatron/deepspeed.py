"""DeepSpeed's calls, beside its own (``from tenplex_megatron import deepspeed as tds``): re-shard ZeRO-1/2/3 engines
(and PipelineModule stages) to a new DP/PP size.

``save_checkpoint(engine, dir)`` / ``load_checkpoint(engine, dir)`` sit next to ``engine.save_checkpoint`` /
``engine.load_checkpoint``; the load also reads DeepSpeed's ``global_stepN`` checkpoints written at any DP size,
with no conversion step on disk. A loop that saves again and again passes one ``checkpointer=``
(``open_checkpointer()``, closed at the end). Host-memory checkpoints (``open_memory``, ``save_snapshot``,
``load_latest``, ``finish_memory``) are ``--tenplex-memory``'s tier for DeepSpeed engines. Needs the
``[deepspeed]`` extra: without DeepSpeed, importing this module says which. ``import tenplex_megatron`` does not
import it.
"""

from tenplex_megatron._optional import require

require("deepspeed", "deepspeed", needed_by="tenplex_megatron.deepspeed")

from tenplex_megatron.engine.load import LoadResult  # noqa: E402
from tenplex_megatron.engine.save import SaveResult  # noqa: E402
from tenplex_megatron.frontdoor.checkpointer import Checkpointer  # noqa: E402
from tenplex_megatron.frontdoor.deepspeed import (  # noqa: E402
    NoDeepSpeedCheckpointError,
    claim_save_dir,
    load_checkpoint,
    open_checkpointer,
    save_checkpoint,
)
from tenplex_megatron.frontdoor.deepspeed_memory import (  # noqa: E402
    finish_memory,
    load_latest,
    open_memory,
    save_snapshot,
)
from tenplex_megatron.integrations.deepspeed import DeepSpeedAdapter, DeepSpeedStateError  # noqa: E402

__all__ = ["Checkpointer", "DeepSpeedAdapter", "DeepSpeedStateError", "LoadResult", "NoDeepSpeedCheckpointError",
           "SaveResult", "claim_save_dir", "finish_memory", "load_checkpoint", "load_latest", "open_checkpointer",
           "open_memory", "save_checkpoint", "save_snapshot"]
