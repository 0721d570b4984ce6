"""Entry point for ``python -m tenplex_megatron``."""

import sys

from tenplex_megatron.cli import main

sys.exit(main())
