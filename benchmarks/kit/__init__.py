"""The benchmarks' shared kit: one way to launch, time, measure and report, so every benchmark's figures mean the
same thing. A benchmark imports what it needs as ``from benchmarks.kit import launch, stats`` or
``from benchmarks.kit.report import ratio_line``.

How a benchmark uses it. The driver (the benchmark run with ``python -m benchmarks.NAME``) starts its workers with
:func:`launch.torchrun` (``torchrun --standalone`` of its own module, ``-m``: pass ``__spec__.name``) or
:func:`launch.run`; each worker times every call with :func:`measure.timed` (freed heap returned to the OS,
barriers either side, peak memory and I/O bytes), collects the ranks' records with :func:`measure.gathered` and
writes them with :func:`launch.write_json`; the driver reads them back, reduces them with :mod:`stats` (a
repetition's time is the max over ranks, a figure the median over repetitions) and prints a :class:`report.Table`
and ``RATIO <metric> <case> tenplex/<peer> = X.XX`` lines (:func:`report.ratio_key`, :func:`report.ratio_line`;
below 1, tenplex is better), with :func:`report.machine` describing where it ran.

Driver side (no torch):
  launch            workers' environment (one thread, the checkout on ``PYTHONPATH``), torchrun or one process,
                    a failure stopping the benchmark with the log's tail; JSON in and out
  stats             per-repetition and per-rank reductions, medians and worst ranks, bandwidths, ratios
  report            fixed-width tables, RATIO lines, the machine a run was measured on
  plots             matplotlib (the ``[bench]`` extra), optional: no plot without it
  disk              directory sizes, fsync of a tree, page-cache eviction and residency, read()/write() counters
  memory            peak RSS and anonymous memory of a block, sampled by a thread, for a process or its tree
  agents            torchrun elastic agents standing for nodes: started, SIGKILLed, their workers watched
  inplace           in-process launchers standing for nodes (the elastic benchmark's in-place policy)
  etcd              a real etcd server for torchrun's ``etcd-v2`` rendezvous (also used by a cluster-safety test)
  slurm             a real local Slurm (scripts/slurm/start.sh) and the batch scripts of docs/slurm.md: submitted,
                    followed, their logs read (also used by the Slurm tests)
  fault_rows        the fault benchmark's row, and the survivors and timeouts read from an in-place run's logs
  faults_mlm        the fault benchmark's Megatron-LM rows: its own script's process restart and in-place runs
  faults_reform     the fault benchmark's planned changes: a node joining or leaving on notice in place (--reform)
                    beside torchrun's agents restarting every process for the same change
  mlm_checkout      a Megatron-LM checkout found, its release read, its scripts copied with our patch (also the
                    GPU check's mlm step; standard library only)
  elastic_analysis  what a replayed trace did: progress, throughput, each change's breakdown, loss deviation
  elastic_sim       the simulator (``plan/simulate.py``) fed a replay's measurements, to predict its time to target
Worker side (import torch, megatron-core or DeepSpeed; imported inside the worker functions, so a driver does not
pay for them):
  measure           the timed call between barriers, the ranks' records gathered, the systems' order rotated
  limits            physical limits timed like the loads: a cold sequential read, page-cache reads, a memory copy
  central           the Tenplex paper's centralized baseline: everything through rank 0 and one file
  gpt_job           the megatron-core GPT job: built, zeroed, and checked after a load against the saved losses
  ds_engine         the DeepSpeed ZeRO GPT-2 engine: one step, its state hashed by DeepSpeed's own accessors
"""
