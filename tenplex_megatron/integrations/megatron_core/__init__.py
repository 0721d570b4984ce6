"""megatron-core adapter: a GPTModel with DDP and a distributed or plain optimizer, described from its own
``sharded_state_dict`` metadata (``sharded.py``), saved and loaded at any TP/PP/DP (``adapter.py``)."""

from tenplex_megatron.mcore_versions import check_supported

check_supported()  # one clear error naming both versions, before any megatron-core module runs
