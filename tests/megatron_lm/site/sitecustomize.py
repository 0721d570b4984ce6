"""What Megatron-LM core_v0.18+ need beside this project's venv, in every process of a ``run_megatron_lm.py`` launch.

The runner executes this file in its own process and puts this folder first on ``PYTHONPATH``, so the processes
Megatron-LM starts with the spawn method (fresh interpreters that import the script again; core_v0.19's
``torch_dist`` save starts one) get the same at start-up:

- ``typing.override`` (Python 3.12's marker, which only sets ``__override__``) on 3.11, from
  ``typing_extensions``: core_v0.18+ import it; Megatron-LM itself declares Python >= 3.12.
- ``TENPLEX_TEST_HIDE_NVRX=1`` (set by the tests from core_v0.17.1 when the installed nvidia-resiliency-ext is
  older than 0.6): that package is not importable, as in an environment without the ``[inprocess]`` extra. From
  core_v0.17.1 ``megatron.core``'s import asserts nvidia-resiliency-ext >= 0.6 whenever one is installed, and the
  extra pins 0.4.1 (the newest with a Python 3.11 wheel); the in-process tests, which need it, skip there.
"""

import os
import sys
import typing

if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override

if os.environ.get("TENPLEX_TEST_HIDE_NVRX") == "1":
    sys.modules["nvidia_resiliency_ext"] = None  # type: ignore[assignment]  # `import` raises ImportError
