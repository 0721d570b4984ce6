"""DeepSpeed's offline route, several checkpoints in one process: ``ds_to_universal`` on each given ``global_stepN``.

Each conversion parses exactly the command line ``python -m deepspeed.checkpoint.ds_to_universal`` would get
(DeepSpeed's own argument parser and defaults) and calls the module's ``main``; output goes to
``<input>_universal``. One process saves a Python start-up and a DeepSpeed import per checkpoint.
"""

from __future__ import annotations

import sys

from deepspeed.checkpoint import ds_to_universal


def convert(step_dir: str) -> None:
    argv = ["ds_to_universal", "--input_folder", step_dir, "--output_folder", f"{step_dir}_universal",
            "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
    saved, sys.argv = sys.argv, argv
    try:
        args = ds_to_universal.parse_arguments()
    finally:
        sys.argv = saved
    ds_to_universal.main(args)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: ds_convert.py GLOBAL_STEP_DIR [GLOBAL_STEP_DIR ...]")
    for step_dir in sys.argv[1:]:
        convert(step_dir)


if __name__ == "__main__":
    main()
