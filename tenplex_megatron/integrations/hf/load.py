"""Start a megatron-core job at any TP/PP/DP from a Hugging Face transformers checkpoint (``--tenplex-init-from-hf``).

Collective. Every rank checks the directory whole and the config against the
run's model before any rank's state is touched (the engine's phase runner
raises any rank's error on all), then plans and copies only its own slice of
the weights, through the same planner and executor as a tenplex load. The
optimizer's fp32 main weights (bf16 runs) are refreshed from the loaded
weights by megatron-core itself; the optimizer otherwise starts fresh.
"""

from __future__ import annotations

from typing import Any

from tenplex_megatron.engine.load import ChunksLoaded, load_chunks
from tenplex_megatron.integrations.hf.source import open_hf
from tenplex_megatron.integrations.megatron_core.optimizer import sub_optimizers
from tenplex_megatron.integrations.megatron_core.sharded import model_chunks
from tenplex_megatron.plan.hf_map import ModelFacts
from tenplex_megatron.storage.source import Metadata


def init_from_hf(job: Any, hf_dir: str, run: ModelFacts) -> ChunksLoaded:
    """Collective: fill ``job``'s model weights from ``hf_dir``; ``run`` (the flags' model) must match its config."""

    def restore(metadata: Metadata) -> None:
        for opt in sub_optimizers(job.optimizer):
            opt.reload_model_params()  # main (fp32) weights from the loaded model weights, as megatron does

    return load_chunks(hf_dir, None, lambda meta: model_chunks(job), restore, strict=True, verify=False,
                       opener=lambda: open_hf(hf_dir, run))
