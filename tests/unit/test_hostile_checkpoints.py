"""A hostile or damaged checkpoint never runs code, hangs, eats memory, or silently restarts training from scratch.

The variants of the hostile-checkpoint probe (findings 1, 2 and 4): Transformer Engine's pickled ``_extra_state``
carrying code; ``metadata.json`` as a link to ``/dev/zero`` or to a file outside, a sparse giant, a FIFO; the tracker
and a rank file as FIFOs; a damaged ``metadata.json`` (truncated, not JSON, nested past the parser, without fields,
an integer of 5000 digits) in the only copy and in the newest one. Checkpoints are written by the real
``save_chunks``, damaged on disk, then ``verify``, ``inspect``, ``plan`` and a real load (the front doors' copy choice
and fallback, ``storage/copies.py`` and ``memory/fallback.py``, around the engine's ``load_chunks``) run on each in
one child process (tests/unit/hostile_run.py) with an address-space limit, each case under a time limit, so a hang
or a read without bound fails its case instead of the machine. The trainer's own load of such copies rides
tests/multiproc/test_bad_input.py's launches.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.save import save_chunks
from tenplex_megatron.integrations.megatron_core.extra_state import REWARMS
from tenplex_megatron.plan.ptc import Chunk, TensorMeta
from tests.harness import ROOT

RUNNER = os.path.join(ROOT, "tests", "unit", "hostile_run.py")
LIMIT_S = 30  # each case (a few seconds at most here); a hang is interrupted at this
LIMIT_AS = 2 * 1024**3  # the child's address space: torch imports in 1.5 GB; a read without bound passes 2 GB
W = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
HALVES = [Chunk("w", (0, 0), (32, 32)), Chunk("w", (32, 0), (32, 32))]
I2, I4 = "iter_0000002", "iter_0000004"
TRACKER = "latest_checkpointed_iteration.txt"


def _save(save: str, it: int) -> str:
    chunks = [LocalChunk(TensorMeta("w", (64, 32), "float32"), c,
                         W[c.offsets[0]: c.offsets[0] + c.shape[0]].reshape(-1).clone(), True) for c in HALVES]
    return save_chunks(chunks, save, it, {"tp": 1}, {}, lambda infos: {}).path


def _mkfifo(path: str) -> None:
    os.remove(path)
    os.mkfifo(path)


def _link(path: str, target: str) -> None:
    os.remove(path)
    os.symlink(target, path)


def _write(path: str, edit: Callable[[str], str]) -> None:
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(edit(text))


def _sparse(path: str) -> None:
    os.truncate(path, 0)
    os.truncate(path, 500 * 1024**2)  # 500 MB, none of it on disk


#: damage to metadata.json: edit of its text, and what the error says
DAMAGE: dict[str, tuple[Callable[[str], str], str]] = {
    "truncated": (lambda text: text[: len(text) // 2], "malformed JSON"),
    "not-json": (lambda text: "this is not JSON", "malformed JSON"),
    "nested": (lambda text: "[" * 200_000 + "]" * 200_000, "malformed JSON"),
    "no-fields": (lambda text: "{}", "not a tenplex-megatron metadata file"),
    "digits": (lambda text: text.replace('"iteration": 4', '"iteration": 4' + "0" * 5000, 1), "malformed JSON"),
}


def _damage_variants(root: str) -> dict[str, Callable[[str], None]]:
    """Variant name -> what it does to a copy of the good directory (iterations 2 and 4)."""
    meta = f"{I4}/metadata.json"
    outside = os.path.join(root, "outside.json")
    v: dict[str, Callable[[str], None]] = {
        "devzero": lambda d: _link(os.path.join(d, meta), "/dev/zero"),
        "outside": lambda d: _link(os.path.join(d, meta), outside),
        "sparse": lambda d: _sparse(os.path.join(d, meta)),
        "mfifo": lambda d: _mkfifo(os.path.join(d, meta)),
        "rfifo": lambda d: _mkfifo(os.path.join(d, I4, "rank_00000.safetensors")),
    }
    for kind, (edit, _) in DAMAGE.items():
        v[kind] = lambda d, edit=edit: _write(os.path.join(d, meta), edit)
    return v


@dataclass(frozen=True)
class Hostile:
    root: str
    good: str
    results: dict[str, dict]

    def dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def __getitem__(self, name: str) -> dict:
        return self.results[name]


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Hostile:
    """Every variant, each as the only copy (``only-X``: iteration 2 removed) and as the newest one (``newest-X``),
    run through the load, ``verify``, ``inspect`` and ``plan`` in one child process."""
    root = str(tmp_path_factory.mktemp("hostile"))
    good = os.path.join(root, "base")
    _save(good, 2)
    _save(good, 4)
    subprocess.run(["cp", os.path.join(good, I4, "metadata.json"), os.path.join(root, "outside.json")], check=True)
    tasks: list[dict] = []

    def case(name: str, damage: Callable[[str], None] | None, *, only: bool, cli: bool = True) -> None:
        d = os.path.join(root, name)
        subprocess.run(["cp", "-a", good, d], check=True)
        if only:
            subprocess.run(["rm", "-rf", os.path.join(d, I2)], check=True)
        if damage is not None:
            damage(d)
        tasks.append({"name": name, "kind": "load", "args": [d]})
        if cli:
            tasks.extend({"name": f"{name}:{cmd[0]}", "kind": "cli", "args": cmd}
                         for cmd in (["verify", d], ["inspect", d], ["plan", d, "--to", "tp=1,pp=1,dp=2"]))

    case("good", None, only=False)
    for name, damage in _damage_variants(root).items():
        case(f"only-{name}", damage, only=True)
        case(f"newest-{name}", damage, only=False, cli=False)
    case("tfifo", lambda d: _mkfifo(os.path.join(d, TRACKER)), only=False)

    def newer(d: str) -> None:  # the probe's: the tracker names 8, whose metadata is damaged
        subprocess.run(["cp", "-a", os.path.join(d, I4), os.path.join(d, "iter_0000008")], check=True)
        _write(os.path.join(d, "iter_0000008", "metadata.json"), lambda text: "{\n")
        _write(os.path.join(d, TRACKER), lambda text: "8")

    case("newer", newer, only=False, cli=False)
    case("tracker-missing", lambda d: _write(os.path.join(d, TRACKER), lambda text: "9"), only=False, cli=False)
    os.makedirs(os.path.join(root, "nothing", "iter_0000002.tenplex-partial"))
    tasks.append({"name": "nothing", "kind": "load", "args": [os.path.join(root, "nothing")]})
    for what in ("evil", "storage", "te"):
        tasks.append({"name": f"te-{what}", "kind": "te", "args": [os.path.join(root, f"te-{what}"), what, "check"]})
    tasks.append({"name": "te-trusted", "kind": "te", "args": [os.path.join(root, "te-trusted"), "evil", "trust"]})
    with open(os.path.join(root, "tasks.json"), "w") as f:
        json.dump(tasks, f)
    out = os.path.join(root, "results.json")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HOSTILE_LIMIT_S=str(LIMIT_S))
    p = subprocess.run([sys.executable, RUNNER, os.path.join(root, "tasks.json"), out], capture_output=True,
                       text=True, env=env, timeout=120 + LIMIT_S * len(tasks), preexec_fn=_limits)
    assert p.returncode == 0 and os.path.exists(out), p.stdout[-3000:] + p.stderr[-3000:]
    with open(out) as f:
        return Hostile(root, good, json.load(f))


def _fails_naming(got: dict, *needles: str) -> None:
    """The load stops at start, naming the copy and why (never a fresh start over it)."""
    assert got.get("error", "").startswith("NoGoodCopyError: "), got
    for n in needles:
        assert n in got["error"], (n, got["error"])


def _falls_back_to_2(got: dict, *needles: str) -> None:
    """The newest copy is skipped with the one warning naming it and why; iteration 2 loads exactly."""
    assert got.get("iteration") == 2 and got["path"].endswith(I2) and got["equal"], got
    assert len(got["skipped"]) == 1 and all(n in got["skipped"][0] for n in needles), got["skipped"]
    assert "skipping a damaged copy" in got["err"] and I4 in got["err"], got["err"][-2000:]


def _cli_refuses(h: Hostile, name: str, *needles: str) -> None:
    """``verify`` reports the copy DAMAGED (status 1); ``inspect`` and ``plan`` fail with a one-line error (status 2)."""
    v = h[f"{name}:verify"]
    assert v["code"] == 1 and "DAMAGED" in v["out"] and "error" not in v, v
    for cmd in ("inspect", "plan"):
        r = h[f"{name}:{cmd}"]
        assert r["code"] == 2 and "error" not in r and "no loadable copy" in r["err"], r
    for n in needles:
        assert n in v["out"] and n in h[f"{name}:inspect"]["err"], (n, v, h[f"{name}:inspect"])


def _cli_reads(h: Hostile, name: str) -> None:
    """``verify`` and ``inspect`` succeed; ``plan`` finishes in time (this test checkpoint records no model, which
    ``plan`` needs: its error is not this file's subject)."""
    assert all(h[f"{name}:{c}"]["code"] == 0 for c in ("verify", "inspect")), h.results
    assert not h[f"{name}:plan"].get("error", "").startswith("Hang"), h[f"{name}:plan"]


def test_a_good_directory_loads_its_newest_copy(hostile: Hostile) -> None:
    got = hostile["good"]
    assert got["iteration"] == 4 and got["equal"] and got["skipped"] == [], got
    _cli_reads(hostile, "good")


def test_a_directory_without_copies_is_a_fresh_start(hostile: Hostile) -> None:
    """Nothing committed (no tracker, no iteration directory; a partial save's left-over): a fresh start."""
    assert hostile["nothing"].get("fresh") is True, hostile["nothing"]


# --- finding 2: metadata.json neither confined nor capped; FIFOs hang

LINK_OUT = "through a symbolic link, outside the checkpoint directory"
NOT_REGULAR = {"mfifo": "metadata.json: is a FIFO, not a regular file",
               "rfifo": "rank_00000.safetensors: is a FIFO, not a regular file"}


def test_metadata_linked_to_dev_zero_is_refused_without_reading(hostile: Hostile) -> None:
    why = f"resolves to /dev/zero {LINK_OUT}"
    _fails_naming(hostile["only-devzero"], os.path.join(hostile.dir("only-devzero"), I4), why)
    _cli_refuses(hostile, "only-devzero", why)
    _falls_back_to_2(hostile["newest-devzero"], why)


def test_metadata_linked_to_a_file_outside_is_refused(hostile: Hostile) -> None:
    why = f"resolves to {os.path.join(hostile.root, 'outside.json')} {LINK_OUT}"
    _fails_naming(hostile["only-outside"], why)
    _cli_refuses(hostile, "only-outside", why)
    _falls_back_to_2(hostile["newest-outside"], why)


def test_sparse_giant_metadata_is_refused_naming_the_cap(hostile: Hostile) -> None:
    cap = "524288000 bytes, over the cap of 268435456 bytes for this file (set TENPLEX_METADATA_MAX_MB to raise it)"
    _fails_naming(hostile["only-sparse"], cap)
    _cli_refuses(hostile, "only-sparse", cap)
    _falls_back_to_2(hostile["newest-sparse"], cap)


def test_metadata_fifo_is_refused_without_waiting(hostile: Hostile) -> None:
    _fails_naming(hostile["only-mfifo"], NOT_REGULAR["mfifo"])
    _cli_refuses(hostile, "only-mfifo", "is a FIFO, not a regular file")
    _falls_back_to_2(hostile["newest-mfifo"], NOT_REGULAR["mfifo"])


def test_rank_file_fifo_is_refused_without_waiting(hostile: Hostile) -> None:
    """Its metadata reads: the load finds the FIFO when it opens the rank files, and the fallback takes over."""
    got = hostile["only-rfifo"]
    assert got.get("error", "").startswith("NoGoodCopyError: ") and NOT_REGULAR["rfifo"] in got["error"], got
    v = hostile["only-rfifo:verify"]
    assert v["code"] == 1 and "rank_00000.safetensors: not a regular file" in v["out"], v
    assert hostile["only-rfifo:inspect"]["code"] == 0  # it reads the metadata only
    assert not hostile["only-rfifo:plan"].get("error", "").startswith("Hang")
    _falls_back_to_2(hostile["newest-rfifo"], NOT_REGULAR["rfifo"])


def test_tracker_fifo_is_refused_without_waiting(hostile: Hostile) -> None:
    """The tracker cannot be read: the iteration directories are still copies, the newest loads, and the warning
    names the tracker."""
    got = hostile["tfifo"]
    assert got.get("iteration") == 4 and got["equal"], got
    assert len(got["skipped"]) == 1 and f"{TRACKER}: is a FIFO" in got["skipped"][0], got["skipped"]
    _cli_reads(hostile, "tfifo")


# --- finding 4: a damaged metadata.json is never a fresh start


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_metadata_is_never_a_fresh_start(hostile: Hostile, kind: str) -> None:
    why = DAMAGE[kind][1]
    _fails_naming(hostile[f"only-{kind}"], os.path.join(hostile.dir(f"only-{kind}"), I4), why)
    _cli_refuses(hostile, f"only-{kind}", why)
    _falls_back_to_2(hostile[f"newest-{kind}"], why)


def test_tracker_naming_a_damaged_iteration_falls_back_with_the_warning(hostile: Hostile) -> None:
    """The probe's "newer": the tracker names iteration 8, whose metadata is damaged: iteration 4 loads, and the
    warning names 8 (before, 4 loaded with no warning)."""
    got = hostile["newer"]
    assert got.get("iteration") == 4 and got["equal"], got
    assert len(got["skipped"]) == 1 and "iter_0000008" in got["skipped"][0], got["skipped"]
    assert "malformed JSON" in got["skipped"][0] and "skipping a damaged copy" in got["err"], got


def test_tracker_naming_a_missing_iteration_is_named(hostile: Hostile) -> None:
    got = hostile["tracker-missing"]
    assert got.get("iteration") == 4 and len(got["skipped"]) == 1, got
    assert "names iteration 9, which is missing" in got["skipped"][0]


# --- finding 1: Transformer Engine's extra state reaches pickle.loads


@pytest.mark.parametrize("what", ["evil", "storage"])
def test_te_extra_state_carrying_code_is_dropped_with_the_one_warning(hostile: Hostile, what: str) -> None:
    """The payload in the pickle itself, or in a tensor's storage inside it (torch.save'd bytes torch would load
    with ``weights_only=False``): the module gets nothing, nothing runs, one warning says why and what re-warms."""
    got = hostile[f"te-{what}"]
    assert "error" not in got and not got["ran"] and not got["handed_over"], got
    warn = [line for line in got["err"].splitlines() if "is not restored" in line]
    assert len(warn) == 1 and "posix.system" in warn[0] and "--tenplex-trust-pickles" in warn[0], got["err"]
    assert REWARMS in warn[0]


def test_te_extra_state_as_te_pickles_it_is_restored_exactly(hostile: Hostile) -> None:
    """What TE really stores (a dict of CPU tensors, numbers and strings, pickled with its tensors' storages) passes
    the restricted unpickler and reaches the module unchanged."""
    got = hostile["te-te"]
    assert "error" not in got and got["handed_over"] and got["restored"] and not got["ran"], got
    assert "is not restored" not in got["err"], got["err"]


def test_te_extra_state_is_handed_over_unchecked_when_trusted(hostile: Hostile) -> None:
    """``--tenplex-trust-pickles``: the module unpickles what the checkpoint holds, as it would from Megatron's."""
    got = hostile["te-trusted"]
    assert "error" not in got and got["handed_over"] and got["ran"], got
