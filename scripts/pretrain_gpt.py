"""GPT pre-training on megatron-core with Megatron-LM's flags and --tenplex (run under torchrun).

Megatron-LM's ``torchrun pretrain_gpt.py ...`` for the reference trainer (``python -m
tenplex_megatron.training.pretrain`` without the orphan guard); ``tenplex_megatron`` must be importable: installed
(``pip install -e .``) or the checkout on ``PYTHONPATH``.
"""

import sys

from tenplex_megatron.engine.orphan import die_with_agent

if __name__ == "__main__":  # a worker: armed before torch's imports (seconds), so that one whose agent dies goes
    die_with_agent()

from tenplex_megatron.training.pretrain import main  # noqa: E402 (after the guard)

if __name__ == "__main__":
    sys.exit(main())
