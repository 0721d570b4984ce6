"""GPT pre-training on megatron-core with Megatron-LM's flags and --tenplex (run under torchrun)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tenplex_megatron.training.pretrain import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
