"""DeepSpeed adapter: re-shard ZeRO-1/2/3 engines (and PipelineModule stages) to a new DP/PP size.

``save_checkpoint(engine, dir)`` / ``load_checkpoint(engine, dir)`` sit next to
DeepSpeed's own calls; the load also reads DeepSpeed's ``global_stepN``
checkpoints written at any DP size, with no conversion step on disk.
"""

from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.integrations.deepspeed.adapter import DeepSpeedAdapter, load_checkpoint, save_checkpoint
from tenplex_megatron.integrations.deepspeed.zero import DeepSpeedStateError

__all__ = ["DeepSpeedAdapter", "DeepSpeedStateError", "LoadResult", "load_checkpoint", "save_checkpoint"]
