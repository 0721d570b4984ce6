"""The host-memory tier (``--tenplex-memory``): snapshots in node memory, replicated to peers' memory and persisted
in the background; a restart at any layout loads the newest one whole in the live nodes' memory.

One job per module, in the order a snapshot meets them:

- ``settings``: :class:`~settings.MemorySettings`, the tier's configuration, frozen and validated once.
- ``state``: :class:`~state.MemoryTier`, one process's runtime state (its node, what is under way), opened
  collectively by :func:`~state.open_tier`; the nodes' helper processes started and stopped.
- ``snapshot``: the collective snapshot into node memory (``shm_write`` writes a rank file).
- ``replication``: which node sends which file to which, at what rate.
- ``background``: the job's side of the helpers' work (progress, durable commit, drain, finish).
- ``helper``: the helper process of a node and the training side's handle on it; ``protocol``: their typed,
  versioned messages; ``direct_copy``: the ``O_DIRECT`` persist copy.
- ``node_dir``: a node's memory directory (node id, listing, retention, spares, cleaning); ``mounts``: the
  filesystem under it.
- ``restart``: the snapshot to restart from (the pure rule: ``plan/restart_policy.py``) and its load at any layout;
  ``peers``: the byte ranges ranks send each other (the pure schedule: ``plan/peer_schedule.py``).

Nothing is imported here: the helper process imports only what it runs.
"""
