"""GPT pre-training on megatron-core with Megatron-LM's flags and --tenplex (run under torchrun)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tenplex_megatron.engine.orphan import die_with_agent  # noqa: E402

if __name__ == "__main__":  # a worker: armed before torch's imports (seconds), so that one whose agent dies goes
    die_with_agent()

from tenplex_megatron.training.pretrain import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
