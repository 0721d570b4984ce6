"""Run a Megatron-LM checkout's (patched) pretrain_gpt.py; on a CPU-only machine, under a CPU shim first.

Usage: torchrun ... tests/megatron_lm/run_megatron_lm.py <checkout>/pretrain_gpt.py [Megatron-LM flags]

On a GPU nothing is redirected. On a CPU-only machine (tests and CI here), the
checkout is not edited; instead, before ``pretrain_gpt.py`` runs, megatron-core's
CPU shim (``tenplex_megatron.training.cpu_shim``) is installed plus the few
things Megatron-LM's training loop itself needs (each listed in ``_install``).
Pass ``--distributed-backend gloo`` (a Megatron-LM flag) for the CPU.

With ``TENPLEX_TEST_SAMPLES=FILE`` every sample Megatron-LM's ``GPTDataset``
hands out on global rank 0 is appended to FILE (JSON lines: ``idx``, ``tokens``,
``labels``, ``loss_mask``; another rank's to FILE.rank<N>), so a test can recompute a loss on the very batch
(use ``--num-workers 0``: data-loader workers would write from other processes).
"""

import json
import os
import runpy
import sys

import torch

# site/sitecustomize.py: Python 3.12's typing.override on 3.11 (core_v0.18+ import it) and, where the tests ask,
# no nvidia-resiliency-ext (core_v0.17.1+ assert >= 0.6 when one is installed). Run here for this process, and first
# on PYTHONPATH for the processes Megatron-LM spawns (fresh interpreters: core_v0.19's torch_dist save starts one).
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
runpy.run_path(os.path.join(SITE, "sitecustomize.py"))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)


def _install() -> None:
    from tenplex_megatron.training import cpu_shim

    cpu_shim.install()
    import megatron.training.training as training

    # initialize_megatron asserts torch.cuda.is_available() unless allow_no_cuda (its own escape hatch);
    # pass that instead of making is_available lie to torch itself.
    init = training.initialize_megatron
    training.initialize_megatron = lambda *a, **k: init(*a, **{**k, "allow_no_cuda": True})
    # _initialize_distributed sets up the model-parallel groups only when device_count() > 0,
    # after set_device(local_rank).
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    # validate_args reads the device's compute capability (get_device_arch_version) to choose between
    # pre-Blackwell and Blackwell behaviour: answer as a pre-Blackwell device.
    import megatron.training.arguments as arguments
    import megatron.training.utils as utils

    arguments.get_device_arch_version = utils.get_device_arch_version = lambda: 9
    _load_with_torch_adam_state()
    # Up to core_v0.16, _compile_dependencies calls the legacy fused_kernels.load(), which only runs
    # `$CUDA_HOME/bin/nvcc -V` (there is no CUDA toolkit) and compiles nothing; core_v0.17 removed both.
    try:
        from megatron.legacy import fused_kernels
    except ImportError:
        return
    fused_kernels.load = lambda *a, **k: None


def _load_with_torch_adam_state() -> None:
    """Megatron-LM's own load of a torch_dist checkpoint with the distributed optimizer, on the CPU: torch's AdamW
    (no apex or Transformer Engine here) has no state before its first step, and the distributed optimizer's
    state_dict asserts one step, so the state is allocated first, as the reference trainer's megatron-core path does
    (``training/mcore_dist_ckpt.py``, with its two other torch-AdamW fixes); a GPU's fused Adam needs none of this.
    Only when the load directory has a tracker: a fresh start is left as it is."""
    import megatron.training.checkpointing as checkpointing
    import megatron.training.training as training

    from tenplex_megatron.integrations.megatron_core.optimizer import allocate_state
    from tenplex_megatron.training import mcore_dist_ckpt

    load = checkpointing.load_checkpoint

    def load_checkpoint(model, optimizer, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202 - Megatron-LM's signature
        from megatron.training import get_args

        tracker = os.path.join(get_args().load or "", "latest_checkpointed_iteration.txt")
        fix = optimizer is not None and os.path.isfile(tracker)
        if fix:
            allocate_state(optimizer)
            mcore_dist_ckpt.tolerate_missing_step()
        out = load(model, optimizer, *a, **k)
        if fix:
            mcore_dist_ckpt.unshare_steps(optimizer)
        return out

    checkpointing.load_checkpoint = training.load_checkpoint = load_checkpoint


def _record_samples(path: str) -> None:
    from megatron.core.datasets.gpt_dataset import GPTDataset

    getitem = GPTDataset.__getitem__

    def recorded(self: GPTDataset, idx: int | None) -> dict:
        sample = getitem(self, idx)
        rank = os.environ.get("RANK", "0")
        with open(path if rank == "0" else f"{path}.rank{rank}", "a") as f:
            f.write(json.dumps({"idx": None if idx is None else int(idx), **{
                k: sample[k].tolist() for k in ("tokens", "labels", "loss_mask")}}) + "\n")
        return sample

    GPTDataset.__getitem__ = recorded


def _helpers_from_the_wheel() -> None:
    """megatron-core's wheel ships its dataset helpers compiled (``helpers_cpp``) and no Makefile, yet Megatron-LM's
    initialize runs ``make`` there on rank 0 and exits when it fails (the GPU check's carried ``.mlm/`` copy on the
    wheel): where the compiled module imports and no Makefile is beside it, that step is skipped."""
    import megatron.core.datasets.utils as dutils

    here = os.path.dirname(os.path.abspath(dutils.__file__))
    if os.path.exists(os.path.join(here, "Makefile")):
        return
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    dutils.compile_helpers = lambda: None


_helpers_from_the_wheel()
if not torch.cuda.is_available():
    _install()
if os.environ.get("TENPLEX_TEST_SAMPLES"):
    _record_samples(os.environ["TENPLEX_TEST_SAMPLES"])

script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
