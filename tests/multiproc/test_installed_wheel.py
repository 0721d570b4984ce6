"""The package as a user gets it: sdist and wheel built, the wheel installed into a fresh venv outside the checkout.

``python -m build`` makes the sdist and, from it, the wheel (from a copy of the
checkout: nothing is written into it). A new virtual environment in a temporary
directory gets the wheel by ``pip install`` with no index, no ``PYTHONPATH`` and
the working directory outside the checkout; every command below runs there,
importing only what the wheel installed (checked: ``tenplex_megatron.__file__``
lies in the new environment's site-packages and no ``sys.path`` entry holds
another copy, such as an editable install of the checkout).

Dependencies (``TENPLEX_WHEEL_TEST_DEPS``):

- ``linked`` (default): the wheel's core requirements, resolved transitively
  (torch, megatron-core, numpy, psutil, isal and theirs, nothing else), are
  linked from this interpreter's pinned install into a directory the new
  environment reads through a ``.pth`` file; pip, with no index and no
  configuration, must then find every requirement satisfied and install the
  wheel alone. No torch is unpacked again.
- ``pip``: pip resolves and installs everything from the machine's own pip
  configuration, constrained to the pinned set (torch at this interpreter's
  version: the CPU wheel, as ``make venv`` installs it).

Either way DeepSpeed, transformers and matplotlib are absent, as for a user who
installs the core only. Checks: ``--version`` (console script and ``python
-m``), the missing-extra errors, ``plan --model gpt3-175b``, a two-process
``--tenplex`` job (``torchrun -m tenplex_megatron.training.pretrain``) at TP=2
restarted at DP=2 from its step-2 checkpoint (losses equal the uninterrupted
run's), and ``inspect`` / ``plan --to`` / ``verify`` on its checkpoints; every CLI report
equals the checkout's for the same command. ``verify`` has no CLI command yet.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import tenplex_megatron
from tenplex_megatron.storage.directory import iter_dir_name
from tests.harness import ROOT, TINY_GPT, layout_flags, metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # builds and installs the wheel: make test-bench

DEPS_MODE = os.environ.get("TENPLEX_WHEEL_TEST_DEPS", "linked")
MODEL_PLAN = ["--model", "gpt3-175b", "--from", "tp=8,pp=16,dp=8", "--to", "tp=8,pp=8,dp=16", "--gpus-per-node", "8"]
TRAIN_ITERS, SAVE_AT = 4, 2
MODEL = [*TINY_GPT, "--vocab-size", "96", "--use-distributed-optimizer", "--train-iters", str(TRAIN_ITERS)]
LOSS_RTOL = 2e-6  # as in test_reshard_matrix.py: only the order of fp32 reductions changes with the layout
SKIP_FROM_CHECKOUT = (".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", "out", ".hypothesis",
                      ".ruff_cache", ".pytest_cache", "*.whl")


@dataclass(frozen=True)
class Installed:
    """A fresh environment holding the installed wheel, and where to run in it."""

    python: str
    bin_dir: str
    site: str
    cwd: str
    env: dict[str, str]
    wheel: str
    sdist: str
    install_seconds: float

    def run(self, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def cli(self, args: list[str]) -> dict:
        p = self.run([os.path.join(self.bin_dir, "tenplex-megatron"), *args, "--json"])
        assert p.returncode == 0, p.stdout + p.stderr
        return json.loads(p.stdout)


def _clean_env(extra_path: str) -> dict[str, str]:
    """This process's environment with no PYTHON* or virtualenv variable: nothing points into the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{extra_path}{os.pathsep}{env.get('PATH', '')}", PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    return env


def _checkout_cli(args: list[str]) -> dict:
    """The same CLI command from the checkout (PYTHONPATH), for comparison."""
    p = subprocess.run([sys.executable, "-m", "tenplex_megatron", *args, "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout)


def _untimed(report: dict) -> dict:
    return {k: v for k, v in report.items() if not k.endswith("_seconds")}


def _build(src: str, out: str) -> tuple[str, str]:
    """``python -m build``: the sdist, then the wheel built from it (no isolation: the pinned setuptools)."""
    p = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, src], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, "python -m build failed (is `build` installed? it is pinned in requirements.txt)\n" + \
        p.stdout[-3000:] + p.stderr[-3000:]
    names = sorted(os.listdir(out))
    wheels = [n for n in names if n.endswith(".whl")]
    sdists = [n for n in names if n.endswith(".tar.gz")]
    assert len(wheels) == 1 and len(sdists) == 1, names
    return os.path.join(out, wheels[0]), os.path.join(out, sdists[0])


def _core_closure(wheel: str) -> list[importlib.metadata.Distribution]:
    """This interpreter's distributions that the wheel's core requirements need, transitively (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    todo = [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")]
    found: dict[str, importlib.metadata.Distribution] = {}
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in found:
            continue
        dist = importlib.metadata.distribution(req.name)  # PackageNotFoundError: the pinned set lacks a core dependency
        assert req.specifier.contains(dist.version, prereleases=True), (str(req), dist.version)
        found[name] = dist
        todo += [Requirement(r) for r in dist.requires or []]
    return list(found.values())


def _link_core_deps(wheel: str, site: str, view: str) -> list[str]:
    """Link the core closure's top-level files into ``view`` and put ``view`` on the new environment's path."""
    os.makedirs(view)
    names = []
    for dist in _core_closure(wheel):
        assert dist.files is not None, f"{dist.metadata['Name']}: no RECORD, cannot tell its files"
        names.append(f"{dist.metadata['Name']}=={dist.version}")
        for top in sorted({f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}):
            target = str(dist.locate_file(top))
            if os.path.exists(target) and not os.path.lexists(os.path.join(view, top)):
                os.symlink(target, os.path.join(view, top))
    with open(os.path.join(site, "tenplex-core-deps.pth"), "w") as f:
        f.write(view + "\n")
    return sorted(names)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    tmp = tmp_path_factory.mktemp("installed")
    assert not str(tmp.resolve()).startswith(os.path.realpath(ROOT) + os.sep), "the fresh environment must be outside"
    src, dist, venv, work = (str(tmp / n) for n in ("src", "dist", "venv", "work"))
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*SKIP_FROM_CHECKOUT))
    wheel, sdist = _build(src, dist)
    os.makedirs(work)
    t0 = time.perf_counter()
    no_pip = ["--without-pip"] if DEPS_MODE == "linked" else []  # its own setuptools would shadow torch's pinned one
    subprocess.run([sys.executable, "-m", "venv", *no_pip, venv], check=True, timeout=300)
    venv_seconds = time.perf_counter() - t0
    python = os.path.join(venv, "bin", "python")
    env = _clean_env(os.path.dirname(python))
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=env, cwd=work).stdout.strip()
    t0 = time.perf_counter()
    if DEPS_MODE == "linked":
        linked = _link_core_deps(wheel, site, str(tmp / "core-deps"))
        pip_env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
        pip_env["PIP_CONFIG_FILE"] = os.devnull  # no find-links, no index: the wheel alone
        cmd = [sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "--disable-pip-version-check",
               wheel]  # this interpreter's pip, installing into the new environment
        p = subprocess.run(cmd, cwd=work, env=pip_env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        # every requirement was already satisfied: the wheel alone was installed
        assert f"Successfully installed tenplex-megatron-{tenplex_megatron.__version__}" in p.stdout.splitlines(), p.stdout
    elif DEPS_MODE == "pip":
        constraints = os.path.join(work, "constraints.txt")
        with open(os.path.join(ROOT, "requirements.txt")) as f, open(constraints, "w") as c:
            c.write(f"torch=={torch.__version__}\n" + f.read())
        p = subprocess.run([python, "-m", "pip", "install", "-q", "-c", constraints, wheel], cwd=work, env=env,
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stdout + p.stderr
        linked = []
    else:
        raise AssertionError(f"TENPLEX_WHEEL_TEST_DEPS={DEPS_MODE!r}: use 'linked' or 'pip'")
    install_seconds = time.perf_counter() - t0
    print(f"\n[installed wheel] {os.path.basename(wheel)} {os.path.getsize(wheel):,} bytes, "
          f"{os.path.basename(sdist)} {os.path.getsize(sdist):,} bytes; venv {venv_seconds:.1f} s, "
          f"install ({DEPS_MODE}) {install_seconds:.1f} s" + (f"; core deps linked: {', '.join(linked)}" if linked else ""))
    yield Installed(python, os.path.dirname(python), site, work, env, wheel, sdist, install_seconds)


def test_wheel_and_sdist_contents(installed: Installed) -> None:
    """The catalogue is package data in both; the wheel declares the console script and the extras."""
    with zipfile.ZipFile(installed.wheel) as z:
        names = set(z.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = z.read(f"{info}/METADATA").decode()
        entry = z.read(f"{info}/entry_points.txt").decode()
    assert "tenplex_megatron/plan/sim/models.json" in names
    assert not any(n.startswith(("tests/", "scripts/", "benchmarks/")) for n in names), "only the package goes into the wheel"
    assert "tenplex-megatron = tenplex_megatron.cli:main" in entry
    assert f"Version: {tenplex_megatron.__version__}\n" in meta
    for extra in ("deepspeed", "hf", "megatron-lm", "bench", "test"):
        assert f"Provides-Extra: {extra}\n" in meta
    with tarfile.open(installed.sdist) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "README.md", "tenplex_megatron/plan/sim/models.json", "tenplex_megatron/cli.py"} <= members


def test_imports_only_the_installed_copy(installed: Installed) -> None:
    code = ("import json, os, sys, importlib.metadata as m, tenplex_megatron as t; "
            "print(json.dumps({'file': t.__file__, 'version': m.version('tenplex-megatron'), 'path': sys.path, "
            "'direct_url': m.distribution('tenplex-megatron').read_text('direct_url.json')}))")
    p = installed.run([installed.python, "-c", code])
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    site = os.path.realpath(installed.site)
    assert os.path.realpath(got["file"]) == os.path.join(site, "tenplex_megatron", "__init__.py")
    assert got["version"] == tenplex_megatron.__version__
    assert '"editable": true' not in (got["direct_url"] or ""), got["direct_url"]  # a wheel install, not -e
    path = [os.path.realpath(os.path.join(installed.cwd, d)) for d in got["path"]]  # '' is the working directory
    others = [d for d in path if d != site and os.path.exists(os.path.join(d, "tenplex_megatron", "__init__.py"))]
    assert not others, f"another copy of the package is importable: {others}"
    root = os.path.realpath(ROOT)
    assert not [d for d in path if d == root or d.startswith(root + os.sep)], path


def test_version(installed: Installed) -> None:
    want = f"tenplex-megatron {tenplex_megatron.__version__}"
    for cmd in ([os.path.join(installed.bin_dir, "tenplex-megatron"), "--version"],
                [installed.python, "-m", "tenplex_megatron", "--version"]):
        p = installed.run(cmd)
        assert p.returncode == 0 and p.stdout.strip() == want, (cmd, p.stdout, p.stderr)


MISSING_EXTRAS = r"""
import json, sys
from tenplex_megatron._optional import require
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = None
    except ImportError as e:
        out[name] = f"{type(e).__name__}: {e}"
attempt("deepspeed itself", lambda: __import__("deepspeed"))
attempt("deepspeed", lambda: __import__("tenplex_megatron.deepspeed"))
attempt("deepspeed adapter", lambda: __import__("tenplex_megatron.integrations.deepspeed"))
attempt("megatron-lm", lambda: __import__("tenplex_megatron.frontdoor.megatron_lm", fromlist=["x"]).install())
attempt("hf", lambda: require("transformers", "hf"))
attempt("bench", lambda: require("matplotlib.pyplot", "bench"))
attempt("megatron-core", lambda: __import__("tenplex_megatron.integrations.megatron_core.adapter"))
print(json.dumps(out))
"""


def test_missing_extras_are_named(installed: Installed) -> None:
    """The core alone is installed: each optional integration fails with the extra that provides it."""
    p = installed.run([installed.python, "-c", MISSING_EXTRAS])
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["deepspeed itself"] == "ModuleNotFoundError: No module named 'deepspeed'"  # a core-only environment
    for extra in ("deepspeed", "megatron-lm", "hf", "bench"):
        assert got[extra] is not None and got[extra].startswith("MissingExtraError: "), (extra, got[extra])
        assert f"pip install 'tenplex-megatron[{extra}]'" in got[extra], got[extra]
    assert got["deepspeed"].startswith("MissingExtraError: tenplex_megatron.deepspeed needs deepspeed"), got
    assert got["deepspeed adapter"].startswith("MissingExtraError: tenplex_megatron.integrations.deepspeed needs"), got
    assert got["megatron-core"] is None  # the megatron-core integration needs no extra


def test_plan_named_model(installed: Installed) -> None:
    """The packaged model catalogue: the same dry run as from the checkout."""
    got = installed.cli(["plan", *MODEL_PLAN])
    assert got["model"] == "gpt3-175b" and got["from"]["pp"] == 16 and got["to"]["dp"] == 16
    assert got["state_bytes"] > 0 and got["bytes_cross_node"] is not None
    assert _untimed(got) == _untimed(_checkout_cli(["plan", *MODEL_PLAN]))


@dataclass(frozen=True)
class Trained:
    ckpt: str
    resumed_ckpt: str
    first_log: str
    resumed_log: str
    first_metrics: list[dict]
    resumed_metrics: list[dict]


@pytest.fixture(scope="module")
def trained(installed: Installed) -> Trained:
    """TP=2 for 4 steps saving at 2 and 4; then DP=2 resumed from step 2, saving elsewhere."""
    ckpt, resumed = os.path.join(installed.cwd, "ckpt"), os.path.join(installed.cwd, "ckpt_dp2")
    logs, runs = [], [
        (layout_flags(2, 1) + ["--save", ckpt, "--save-interval", str(SAVE_AT)], "first.jsonl"),
        (layout_flags(1, 1) + ["--load", os.path.join(ckpt, iter_dir_name(SAVE_AT)), "--save", resumed], "resumed.jsonl"),
    ]
    for flags, metrics_file in runs:
        cmd = [installed.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "tenplex_megatron.training.pretrain", *MODEL,
               "--tenplex-metrics", os.path.join(installed.cwd, metrics_file), *flags]
        p = installed.run(cmd, timeout=400)
        log = p.stdout + p.stderr
        assert p.returncode == 0, log[-4000:]
        logs.append(log)
    return Trained(ckpt, resumed, logs[0], logs[1], metrics(os.path.join(installed.cwd, "first.jsonl")),
                   metrics(os.path.join(installed.cwd, "resumed.jsonl")))


def test_tenplex_restart_from_installed_package(trained: Trained) -> None:
    """The resumed DP=2 job continues the TP=2 job's loss curve exactly where its step-2 checkpoint left it."""
    assert "layout tp=2,pp=1,dp=1" in trained.first_log
    assert f"> tenplex: loaded iteration {SAVE_AT} from" in trained.resumed_log
    assert "layout tp=2,pp=1,dp=1 -> tp=1,pp=1,dp=2" in trained.resumed_log
    ref = {m["iteration"]: m for m in trained.first_metrics}
    assert sorted(ref) == list(range(1, TRAIN_ITERS + 1))
    assert [m["iteration"] for m in trained.resumed_metrics] == list(range(SAVE_AT + 1, TRAIN_ITERS + 1))
    for m in trained.resumed_metrics:
        r = ref[m["iteration"]]
        assert m["samples"] == r["samples"] and m["lr"] == pytest.approx(r["lr"], rel=1e-12)
        assert m["loss"] == pytest.approx(r["loss"], rel=LOSS_RTOL), (m["iteration"], m["loss"], r["loss"])


def test_inspect_and_plan_its_checkpoints(installed: Installed, trained: Trained) -> None:
    """``inspect`` and ``plan --to`` on checkpoints the installed package wrote: as from the checkout."""
    first = installed.cli(["inspect", trained.ckpt])
    assert first["iteration"] == TRAIN_ITERS and first["layout"] == {"tp": 2, "pp": 1, "dp": 1}
    assert first["tensors"] > 0 and first["bytes"] > 0
    assert first == _checkout_cli(["inspect", trained.ckpt])
    resumed = installed.cli(["inspect", trained.resumed_ckpt])
    assert resumed["iteration"] == TRAIN_ITERS and resumed["layout"] == {"tp": 1, "pp": 1, "dp": 2}
    assert resumed["model_parameters"] == first["model_parameters"]
    at_save = os.path.join(trained.ckpt, iter_dir_name(SAVE_AT))
    plan = installed.cli(["plan", at_save, "--to", "tp=1,pp=1,dp=2"])
    assert plan["to"] == {"tp": 1, "pp": 1, "dp": 2} and sorted(plan["bytes_per_rank"]) == ["0", "1"]
    assert plan["bytes_total"] >= plan["state_bytes"] // 2  # each DP rank reads at least its share
    assert _untimed(plan) == _untimed(_checkout_cli(["plan", at_save, "--to", "tp=1,pp=1,dp=2"]))


def test_verify_its_checkpoints(installed: Installed, trained: Trained) -> None:
    """``verify --all`` from the installed package reads and checks every stored byte of every checkpoint it wrote."""
    got = installed.cli(["verify", trained.ckpt, "--all"])
    assert got["ok"] and len(got["checkpoints"]) == 2  # iterations 2 and 4
    for r in got["checkpoints"]:
        assert r["ok"] and r["bytes_checked"] == r["bytes_stored"] > 0 and r["damage"] == []
