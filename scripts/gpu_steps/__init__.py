"""The GPU check's steps (``scripts/gpu_check.py``), one module each: its run and its lines of the report's table.

  wheels        the carried wheels installed offline
  env           what the steps run with, probed by the Python and path they get
  pytest_gpu    ``pytest -m gpu tests/gpu``
  torch_checks  ``identity`` and ``snapshot`` (``scripts/gpu_check_steps.py`` in a process of its own)
  resume        tiny checkpoints made on the CPU, resumed on the device and on the CPU
  gpu_bench     the ``bench`` step: ``benchmarks.gpu_reshard`` on the device
  mlm           Megatron-LM's own ``pretrain_gpt.py`` saving on the CPU, resumed on the device

What they share: ``launch`` (the clock, process groups stopped on it, their outcome), ``losses`` (the resume
schedule, tolerances and loss comparison) and ``cells`` (a table cell's text). Standard library only, as the check
runs before its wheels are installed; the steps' own processes import the rest.
"""
