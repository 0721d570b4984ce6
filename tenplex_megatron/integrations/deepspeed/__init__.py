"""DeepSpeed integration: re-shard ZeRO-1/2/3 engines (and PipelineModule stages) to a new DP/PP size.

``save_checkpoint(engine, dir)`` / ``load_checkpoint(engine, dir)`` sit next to
DeepSpeed's own calls; the load also reads DeepSpeed's ``global_stepN``
checkpoints written at any DP size, with no conversion step on disk.
"""

from tenplex_megatron.integrations.deepspeed.checkpoint import LoadResult, load_checkpoint, save_checkpoint
from tenplex_megatron.integrations.deepspeed.describe import DeepSpeedStateError

__all__ = ["DeepSpeedStateError", "LoadResult", "load_checkpoint", "save_checkpoint"]
