"""DeepSpeed adapter: re-shard ZeRO-1/2/3 engines (and PipelineModule stages) to a new DP/PP size.

``save_checkpoint(engine, dir)`` / ``load_checkpoint(engine, dir)`` sit next to
DeepSpeed's own calls; the load also reads DeepSpeed's ``global_stepN``
checkpoints written at any DP size, with no conversion step on disk. Host-memory
checkpoints (``open_memory``, ``save_snapshot``, ``load_latest``, ``finish_memory``)
are ``--tenplex-memory``'s tier for DeepSpeed engines. Needs the
``[deepspeed]`` extra: without DeepSpeed, importing this package says which.
"""

from tenplex_megatron._optional import require

require("deepspeed", "deepspeed", needed_by="tenplex_megatron.integrations.deepspeed")

from tenplex_megatron.engine.load import LoadResult  # noqa: E402
from tenplex_megatron.integrations.deepspeed.adapter import (  # noqa: E402
    DeepSpeedAdapter,
    load_checkpoint,
    save_checkpoint,
)
from tenplex_megatron.integrations.deepspeed.memory import (  # noqa: E402
    finish_memory,
    load_latest,
    open_memory,
    save_snapshot,
)
from tenplex_megatron.integrations.deepspeed.zero import DeepSpeedStateError  # noqa: E402

__all__ = ["DeepSpeedAdapter", "DeepSpeedStateError", "LoadResult", "finish_memory", "load_checkpoint", "load_latest",
           "open_memory", "save_checkpoint", "save_snapshot"]
