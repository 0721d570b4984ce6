"""What the two front doors share: the reference trainer (``training/``) and the Megatron-LM hook
(``frontdoor/megatron_lm.py``) read the same ``--tenplex*`` flags (rows of ``tenplex_megatron/flags.py``) with
the same checks, leases, host-memory tier, model dimensions and load-source order, from here, so the two cannot
drift apart.
"""
