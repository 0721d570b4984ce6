"""Every ``--tenplex-*`` flag and every ``TENPLEX_*`` environment variable, defined once.

Two front doors take the flags: the reference trainer (``scripts/pretrain_gpt.py``, ``training/pretrain.py``)
and the Megatron-LM hook (``frontdoor/megatron_lm.py``). Both add them with :func:`add_flags` from the one
table :data:`FLAGS` (name, help, argparse settings and which front doors take it), so a flag means the same
thing, with the same help text, wherever it is given. :data:`ENV_VARS` lists every environment variable the
package, its scripts and its tests read. ``python -m tenplex_megatron.docs_reference`` writes both tables
into ``docs/reference.md``; ``tests/unit/test_flag_reference.py`` fails when that page is stale, when a parser
has a ``--tenplex*`` flag the table does not, or when the code reads a ``TENPLEX_*`` variable the registry
does not list.

To add a flag: one :class:`Flag` row in :data:`FLAGS` (in the group it belongs to), then
``python -m tenplex_megatron.docs_reference``. This module imports nothing heavy: no torch, no training code.
"""

from __future__ import annotations

import argparse
import getpass
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tenplex_megatron.errors import TenplexError

TRAINER = "pretrain_gpt.py"  # scripts/pretrain_gpt.py and `torchrun -m tenplex_megatron.training.pretrain`
HOOK = "Megatron-LM"  # a Megatron-LM checkout patched with patches/, through frontdoor/megatron_lm.py
BOTH = (TRAINER, HOOK)

# Groups, in the order the reference lists them: (key, title, the docs page that explains them, its title)
GROUPS = (
    ("checkpoints", "Checkpoints", "megatron-lm.md", "Megatron-LM"),
    ("layout", "Layout choice and elastic restarts", "elastic.md", "Elastic training"),
    ("memory", "Host-memory checkpoints", "host-memory.md", "Host-memory checkpoints"),
    ("lease", "One writer per checkpoint directory", "cluster-safety.md", "Safety at cluster scale"),
    ("trainer", "Reference trainer only", "trainer.md", "The reference trainer"),
)

MEMORY_DIR_DEFAULT = "/dev/shm/tenplex-$USER"  # how the docs write _memory_dir()


class FlagError(TenplexError, ValueError):
    """A flag, its API argument or a ``TENPLEX_*`` variable: missing, out of range or contradicting another."""


def replication_rate_arg(value: str) -> float | str:
    """``--tenplex-replication-rate``: MB/s, or ``auto``."""
    if value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MB/s or auto, got {value!r}") from None


@dataclass(frozen=True)
class Flag:
    """One ``--tenplex*`` flag: what argparse gets, and what the reference says about it."""

    name: str
    help: str
    group: str
    doors: tuple[str, ...] = BOTH
    action: str | None = None  # "store_true" for a switch
    type: Callable[[str], Any] | None = None
    default: Any = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    nargs: str | None = None
    const: Any = None  # with nargs="?"; MEMORY_DIR_DEFAULT stands for the user's memory directory
    doc_default: str | None = None  # the default as the reference writes it, where the value alone says too little

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``add_argument``."""
        kw: dict[str, Any] = {"help": self.help}
        if self.action is not None:
            kw["action"] = self.action
            return kw
        kw["default"] = self.default
        for key in ("type", "metavar", "nargs"):
            if getattr(self, key) is not None:
                kw[key] = getattr(self, key)
        if self.choices is not None:
            kw["choices"] = list(self.choices)
        if self.nargs == "?":
            kw["const"] = _memory_dir() if self.const == MEMORY_DIR_DEFAULT else self.const
        return kw

    def usage(self) -> str:
        """``--name METAVAR`` as the reference shows it."""
        if self.action == "store_true":
            return self.name
        if self.choices is not None:
            return f"{self.name} {{{','.join(self.choices)}}}"
        metavar = self.metavar or self.name.lstrip("-").upper().replace("-", "_")
        return f"{self.name} [{metavar}]" if self.nargs == "?" else f"{self.name} {metavar}"

    def default_text(self) -> str:
        if self.doc_default is not None:
            return self.doc_default
        if self.action == "store_true":
            return "off"
        if self.default is None:
            return "none"
        return str(self.default)


def _memory_dir() -> str:
    """``--tenplex-memory``'s directory when given bare: per user under /dev/shm (node-local shared memory)."""
    return os.path.join("/dev/shm", f"tenplex-{getpass.getuser()}")


FLAGS: tuple[Flag, ...] = (
    # --- checkpoints
    Flag("--tenplex", "save and load through tenplex (re-shard on restart)", "checkpoints", action="store_true"),
    Flag("--tenplex-keep", "keep only the newest N complete tenplex checkpoints", "checkpoints", type=int,
         metavar="N", doc_default="all"),
    Flag("--tenplex-no-verify", "skip checksum verification at load", "checkpoints", action="store_true"),
    Flag("--tenplex-vocab-padding",
         "keep: on restart keep the checkpoint's padded vocabulary when the new TP divides it (exact loss "
         "continuation); megatron: always pad to make-vocab-size-divisible-by x TP (new padding rows are zero)",
         "checkpoints", choices=("keep", "megatron"), default="keep"),
    Flag("--tenplex-init-from-hf",
         "start from a Hugging Face transformers checkpoint (GPT-2, Llama or Mixtral) at this run's layout, each rank "
         "reading only its slice; its config must match the model flags. A tenplex checkpoint under --load (a "
         "restart) takes precedence; under Megatron-LM give --load too (empty on the first start)",
         "checkpoints", metavar="DIR"),
    Flag("--tenplex-trust-pickles",
         "trust the checkpoint's pickles: adopting Megatron's own checkpoint, unpickle its files fully (default: "
         "only plain classes); a tenplex checkpoint's Transformer Engine extra state, hand it to the modules (which "
         "unpickle it) without the restricted check (default: left out, with a warning, when it names anything but "
         "tensors, numbers, strings, containers and TE's recipe classes)",
         "checkpoints", action="store_true"),
    # --- layout choice and elastic restarts
    Flag("--tenplex-layout",
         "choose TP, PP, DP and the micro-batch size (a mixture of experts' EP and expert TP too) for the world "
         "size of every (re)start: auto (legal layouts that fit memory, ranked by a throughput model), measure "
         "(pretrain_gpt.py only: also time the best 3 in this job the first time at a world size; the times are "
         "kept in the checkpoint directory) or a user's table (FILE.json); --tensor/--pipeline/--expert-model-"
         "parallel-size, --expert-tensor-parallel-size and --micro-batch-size given on the command line still win",
         "layout", metavar="auto|measure|FILE.json", doc_default="off (the layout flags as given)"),
    Flag("--tenplex-memory-budget", "per-rank memory for --tenplex-layout auto (default: the GPU's memory; none "
         "on the CPU)", "layout", type=float, metavar="GB", doc_default="the GPU's memory"),
    Flag("--tenplex-no-save-on-signal",
         "with --tenplex, SIGTERM makes every rank save at the next iteration boundary and exit 0; this turns that "
         "off (under Megatron-LM, its own --exit-signal-handler does the same)",
         "layout", doors=(TRAINER,), action="store_true"),
    Flag("--tenplex-inprocess",
         "train inside NVIDIA Resiliency Extension's in-process restart: after a rank is lost the survivors continue "
         "in the same processes at the largest world size with a legal layout (the rest wait as spares), restoring "
         "from --tenplex-memory; start it with python -m tenplex_megatron.frontdoor.launch (needs the [inprocess] "
         "extra)", "layout", doors=(TRAINER,), action="store_true"),
    Flag("--tenplex-inprocess-timeout",
         "with --tenplex-inprocess (under Megatron-LM: --inprocess-restart with --tenplex): seconds a collective "
         "waits on a peer (gloo/NCCL timeout) before the fault is declared; NVRx's soft and hard progress timeouts "
         "are 1.5x and 2x it", "layout", doors=BOTH,
         type=float, default=60.0, metavar="SECONDS"),
    # --- host-memory checkpoints
    Flag("--tenplex-memory",
         "host-memory checkpoints: each save is a snapshot into this node-local directory (default "
         f"{MEMORY_DIR_DEFAULT}), replicated to peers' memory and persisted to --save in the background; a restart "
         "loads the newest snapshot complete in the live nodes' memory",
         "memory", nargs="?", const=MEMORY_DIR_DEFAULT, metavar="DIR",
         doc_default=f"off ({MEMORY_DIR_DEFAULT} when given without DIR)"),
    Flag("--tenplex-persist-interval", "with --tenplex-memory: persist every Nth snapshot to --save in the "
         "background (default 1)", "memory", type=int, default=1, metavar="N"),
    Flag("--tenplex-replicas", "with --tenplex-memory: copies of each snapshot in distinct nodes' memory, the first "
         "included (default 2: losing one node loses no snapshot)", "memory", type=int, default=2, metavar="K"),
    Flag("--tenplex-replication-rate",
         "with --tenplex-memory: most bytes per second a node's helper sends replicas at, so that replication "
         "leaves training its CPU and network; auto: paced to take half the time between two snapshots (default "
         "0: as fast as it can)", "memory", type=replication_rate_arg, default=0.0, metavar="MB/s|auto",
         doc_default="0 (unlimited)"),
    Flag("--tenplex-memory-keep", "with --tenplex-memory: snapshots kept per node, besides the one being written "
         "(default 1)", "memory", type=int, default=1, metavar="N"),
    Flag("--tenplex-memory-limit", "with --tenplex-memory: most memory a node's snapshots may use (default: what "
         "is free)", "memory", type=float, metavar="GB", doc_default="what the filesystem has free"),
    Flag("--tenplex-memory-fallback", "with --tenplex-memory: a snapshot that does not fit is saved to --save "
         "instead of failing", "memory", action="store_true"),
    # --- one writer per directory (storage/lease.py; the default TTL is lease.DEFAULT_TTL, checked by a test)
    Flag("--tenplex-job-id", "this job's identity for the checkpoint directories' leases (default: the Slurm job, "
         "slurm-SLURM_JOB_ID@SLURM_CLUSTER_NAME, the same after each requeue; else torchrun's run id unless it is "
         "'none'; else, under torchrun, a token its agents' store keeps for the launch; else MASTER_ADDR:MASTER_PORT; "
         "else host:pid). A job with another id is refused a directory while its holder lives", "lease",
         metavar="ID", doc_default="the launch's id"),
    Flag("--tenplex-take-over", "take the leases of --save and --tenplex-memory over at once, even from a job whose "
         "heartbeat is fresh (that job is known to be gone); it cannot commit there any more", "lease",
         action="store_true"),
    Flag("--tenplex-lease-ttl", "a holder silent this long is gone: another job may take its directories over (a "
         "holder on the same host that died is gone at once)", "lease", type=float, default=15.0,
         metavar="SECONDS"),
    # --- the reference trainer only
    Flag("--tenplex-metrics", "append per-step loss and sample indices as JSON lines", "trainer", doors=(TRAINER,),
         metavar="FILE"),
    Flag("--tenplex-resave", "after loading, save the loaded state to this directory", "trainer",
         doors=(TRAINER,), metavar="DIR"),
)


def flags_for(door: str, groups: Iterable[str] | None = None) -> list[Flag]:
    """The flags ``door`` takes (in the table's order), of ``groups`` if given."""
    assert door in BOTH, door
    wanted = None if groups is None else set(groups)
    return [f for f in FLAGS if door in f.doors and (wanted is None or f.group in wanted)]


def add_flags(parser: Any, door: str, groups: Iterable[str] | None = None) -> Any:
    """Add ``door``'s ``--tenplex*`` flags to ``parser`` (a parser or an argument group); returns it."""
    for f in flags_for(door, groups):
        parser.add_argument(f.name, **f.kwargs())
    return parser


@dataclass(frozen=True)
class EnvVar:
    """One ``TENPLEX_*`` environment variable that the package, its scripts or its tests read."""

    name: str
    values: str
    default: str
    help: str
    audience: str  # "user": tuning and diagnosis; "tests": the test suite; "internal": set by the package itself


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("TENPLEX_STAGING", "`auto`, `parallel`, `serial`, `copy`, `direct`", "`auto`",
           "how a load reads and a save writes: reader (writer) threads with `preadv` (`pwrite`) through one ring "
           "of slots, checking each block as it is read (`auto` = `parallel`, on any device, pinned on a GPU); "
           "`serial`: one host thread, through a ring of staging buffers on a GPU (`copy`) and by one strided copy "
           "per piece from the file's map on the CPU (`direct`), a load verifying every block before it copies "
           "one", "user"),
    EnvVar("TENPLEX_STAGING_MB", "MB (fractions allowed)", "256",
           "the staging budget of one load or save, the ring's buffers together; on a GPU the same again in device "
           "memory", "user"),
    EnvVar("TENPLEX_METADATA_MAX_MB", "MB (fractions allowed)", "256",
           "the largest `metadata.json` a load, `verify`, `inspect` or `plan` reads (a bigger one is refused, naming "
           "the file and the cap): raise it only for a checkpoint of more chunks than that holds (about 30 MB per "
           "100,000 chunks)", "user"),
    EnvVar("TENPLEX_READ_THREADS", "an integer >= 1", "the CPUs available / local ranks, 1-16",
           "reader threads of the parallel reader (each reads, checks and places merged byte runs of a few MiB)",
           "user"),
    EnvVar("TENPLEX_VERIFY_THREADS", "an integer >= 1", "the CPUs available / local ranks, 1-8",
           "threads that check block checksums at load (`copy` and `direct` modes)", "user"),
    EnvVar("TENPLEX_PREFETCH", "`0`, `1`", "`1`",
           "`0` turns off the read-ahead hints (`MADV_WILLNEED`, `POSIX_FADV_WILLNEED`) for the byte ranges a load reads", "user"),
    EnvVar("TENPLEX_PERSIST_DIRECT", "`0`, `1`", "`1`",
           "`0`: the host-memory helper copies snapshots to `--save` through the page cache instead of with "
           "`O_DIRECT`", "user"),
    EnvVar("TENPLEX_HELPER_SCHED_IDLE", "`0`, `1`", "`1`",
           "`0` leaves the host-memory helper at nice 19 instead of the idle CPU class (`SCHED_IDLE`)", "user"),
    EnvVar("TENPLEX_ORPHAN_EXIT", "`0`, `1`", "`1`",
           "`0` lets a torchrun worker outlive its agent (by default it dies with it: parent-death signal)", "user"),
    EnvVar("TENPLEX_FAULT", "`POINT[@RANK][#ITERATION][:KIND]`, several separated by commas", "unset",
           "make a rank fail at a named point of a save or load (kinds `kill`, `stop`, `enospc`, `eperm`, `eio`, "
           "`short`, `error`, `typeerror`; points in `storage/faults.py`): the crash-safety tests' tool", "tests"),
    EnvVar("TENPLEX_FAULT_ONCE", "a file path", "unset",
           "with `TENPLEX_FAULT`: the fault fires once, in whichever process reaches it first (it creates the file)",
           "tests"),
    EnvVar("TENPLEX_OPEN_LOG", "a file path", "unset",
           "append every path a process opens in a memory directory (the node tests check none is another node's)",
           "tests"),
    EnvVar("TENPLEX_TEST_CPU", "a file path", "unset",
           "append each test's wall time and the CPU seconds of the processes it started (JSON lines)", "tests"),
    EnvVar("TENPLEX_TEST_SAMPLES", "a file path", "unset",
           "the Megatron-LM runner records every sample Megatron-LM's dataset hands out", "tests"),
    EnvVar("TENPLEX_TEST_SECONDS_PER_ITERATION", "seconds", "unset",
           "tests/site paces the reference trainer's iterations (a first Slurm run, so that the tiny model is still "
           "training when Slurm's signal or a lost node comes)", "tests"),
    EnvVar("TENPLEX_TEST_HIDE_NVRX", "`1`", "unset",
           "the Megatron-LM runner's sitecustomize makes nvidia-resiliency-ext unimportable (the opt-in suite sets it "
           "from core_v0.17.1, whose megatron.core does not import beside nvidia-resiliency-ext older than 0.6)",
           "tests"),
    EnvVar("TENPLEX_TEST_NVRX_PATH", "paths, `:`-separated", "unset",
           "the multi-process tests put these on their processes' PYTHONPATH ahead of site-packages: another "
           "nvidia-resiliency-ext than the venv's, e.g. 0.7.0's wheel unpacked with httpx, pydantic and defusedxml "
           "(its in-process module is pure Python and runs on 3.11; the opt-in Megatron-LM tests keep the caller's "
           "PYTHONPATH instead)", "tests"),
    EnvVar("TENPLEX_CROSS_PYTHON", "a Python interpreter's path", "`.venv/bin/python`",
           "the cross-version test (tests/multiproc/test_cross_version.py) writes and resumes checkpoints with this "
           "interpreter's megatron-core as the other version; `make test-compat` sets it to the pinned venv's",
           "tests"),
    EnvVar("TENPLEX_WHEEL_TEST_DEPS", "`linked`, `pip`", "`linked`",
           "the installed-wheel test links the pinned dependencies into its fresh venv, or has pip install them",
           "tests"),
    EnvVar("TENPLEX_INPROCESS_STORE", "`HOST:PORT`", "set by the in-process launcher",
           "the job's store served outside the ranks (`python -m tenplex_megatron.frontdoor.launch`); NVRx's own "
           "store listens on the next port. `--tenplex-inprocess` is refused without it", "internal"),
    EnvVar("TENPLEX_REFORM", "`run`, `join`", "set by the in-process launcher",
           "the launcher's `--reform` (`run`) or `--join` (`join`): the reference trainer re-forms in place on plan "
           "(newcomers join, ranks leave on notice) on the job's store, without NVRx", "internal"),
    EnvVar("TENPLEX_REFORM_LEAVE_ON_SIGTERM", "`1`", "set by the in-process launcher",
           "for the ranks of a `--reform` launcher that does not serve the stores: they ignore SIGTERM (Slurm signals "
           "every process of a step) and their launcher turns its own into their leave notice", "internal"),
    EnvVar("TENPLEX_INPROCESS_LOGDIR", "a directory", "unset",
           "with `--tenplex-inprocess`: NVRx's monitor processes write their logs here (made if missing)", "user"),
    EnvVar("TENPLEX_HELPER_PARENT", "a process id", "set by the package",
           "the training process a host-memory helper belongs to (the helper exits when it is gone)", "internal"),
    EnvVar("TENPLEX_AGENT_IGNORES_SIGTERM", "`1`", "set by `python -m tenplex_megatron.frontdoor.slurm`",
           "its torchrun agent ignores SIGTERM (Slurm signals every process of a step); a worker takes SIGTERM's "
           "default back at start", "internal"),
)
