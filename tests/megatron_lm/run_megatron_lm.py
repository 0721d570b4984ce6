"""Run a Megatron-LM checkout's (patched) pretrain_gpt.py; on a CPU-only machine, under the CPU shim first.

Usage: torchrun ... tests/megatron_lm/run_megatron_lm.py <checkout>/pretrain_gpt.py [Megatron-LM flags]
"""

import os
import runpy
import sys

import torch

if not torch.cuda.is_available():
    from tenplex_megatron.integrations import cpu_shim

    cpu_shim.install()
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 1

script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
