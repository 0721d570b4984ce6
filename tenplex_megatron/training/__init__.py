"""The reference trainer behind scripts/pretrain_gpt.py: refuses an unsupported megatron-core before importing it."""

from tenplex_megatron.mcore_versions import check_supported

check_supported()
