"""tenplex-megatron: resume megatron-core GPT training at any new TP/PP/DP layout (Tenplex's PTC as a library).

- ``tenplex_megatron.plan``: pure planning (no torch): layouts, the PTC, the re-sharding planner.
- ``tenplex_megatron.storage``: the checkpoint format on disk (safetensors + versioned JSON, atomic commit).
- ``tenplex_megatron.execute``: torch execution of plans and collectives.
- ``tenplex_megatron.integrations``: megatron-core (``checkpoint.save_checkpoint`` / ``load_checkpoint``),
  the ``--tenplex`` pre-training script's loop.
"""

__version__ = "0.1.0"
