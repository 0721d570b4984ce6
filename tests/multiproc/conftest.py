"""The multi-process suite loads through the staged path in copy mode, with small buffers, unless told otherwise.

Copy mode is what a GPU runs (``execute/staged.py``); on the CPU ``auto`` would
pick per-piece copies, so the launches inherit ``TENPLEX_STAGING=copy`` and a
0.25 MB staging budget (pieces split, buffers reused), and every matrix oracle
(bit-exact re-save, loss continuation) checks the GPU algorithm's indexing.
"""

from __future__ import annotations

import os

os.environ.setdefault("TENPLEX_STAGING", "copy")
os.environ.setdefault("TENPLEX_STAGING_MB", "0.25")
