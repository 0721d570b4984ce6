"""Measurement code shared by ``scripts/bench_reshard.py``, ``scripts/bench_deepspeed.py`` and ``scripts/bench_elastic.py``.

One way to measure each thing, so the benchmarks' figures mean the same: ``memory`` (peak RSS and anonymous
memory), ``disk`` (directory sizes, fsync, page-cache eviction, read()/write() byte counters), ``measure`` (a
timed call between barriers, gathered over ranks), ``launch`` (torchrun workers and their JSON), ``stats``
(medians and summaries over repetitions and ranks), ``report`` (the table printer and the RATIO lines), ``plots``
(matplotlib), ``limits`` (physical read/copy limits), ``central`` (the centralized baseline), ``agents``
(torchrun elastic agents as nodes, started and lost) and ``elastic_analysis`` (a replayed trace's progress,
throughput, change breakdowns and loss deviation). The jobs being
measured: ``gpt_job`` (megatron-core GPT) and ``ds_engine`` (DeepSpeed ZeRO GPT-2). Only the worker-side
modules (``measure``, ``central``, ``gpt_job``, ``ds_engine``) import torch, megatron-core or DeepSpeed.
"""
