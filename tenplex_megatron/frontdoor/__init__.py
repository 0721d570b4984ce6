"""Every front door and what they share: the reference trainer (``training/``), the Megatron-LM hook
(``megatron_lm.py``), the public megatron-core API (``api.py``) and DeepSpeed's calls (``deepspeed.py``) build one
:class:`~tenplex_megatron.frontdoor.checkpointer.Checkpointer` per job from a frozen ``JobConfig``, with the same
``--tenplex*`` flags (rows of ``tenplex_megatron/flags.py``), checks, leases, host-memory tier and the one resume
order (``resume.py``), so they cannot drift apart.
"""
