"""A Megatron-LM checkout for the runs of Megatron-LM's own ``pretrain_gpt.py`` (the GPU check's ``mlm`` step, the
fault benchmark's Megatron-LM rows): found (``--megatron-lm``, else MEGATRON_LM_PATH, else ``.mlm/``), its
megatron-core release read, its top-level scripts copied with our patch for that release. Standard library only:
the GPU check imports it before any wheel is installed."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: what a checkout must hold: the script, and the training code beside it
MLM_NEEDS = ("pretrain_gpt.py", os.path.join("megatron", "training"), os.path.join("megatron", "legacy"))


def mlm_checkout(given: str | None, environ: dict[str, str]) -> tuple[str | None, str | None]:
    """The Megatron-LM checkout the mlm step runs (``--megatron-lm``, else MEGATRON_LM_PATH, else ``.mlm/``), or
    None and why not: the first one named must hold ``pretrain_gpt.py``, ``megatron/training`` and
    ``megatron/legacy``."""
    for where, path in (("--megatron-lm", given), ("MEGATRON_LM_PATH", environ.get("MEGATRON_LM_PATH")),
                        (".mlm/", os.path.join(ROOT, ".mlm"))):
        if not path:
            continue
        if where == ".mlm/" and not os.path.isdir(path):
            break
        missing = [n for n in MLM_NEEDS if not os.path.exists(os.path.join(path, n))]
        if missing:
            return None, f"{where} {path} lacks {', '.join(missing)}"
        return os.path.abspath(path), None
    return None, ("no Megatron-LM checkout: pass --megatron-lm DIR or set MEGATRON_LM_PATH, or carry .mlm/ "
                  "(make gpu-mlm)")


def mlm_release(checkout: str) -> tuple[int, int] | None:
    """megatron-core's release (major, minor) as the checkout's script will import it: the checkout's own
    ``megatron/core`` where it has one, else the installed distribution."""
    info = os.path.join(checkout, "megatron", "core", "package_info.py")
    text = None
    if os.path.isfile(info):
        with open(info) as f:
            found = dict(re.findall(r"^(MAJOR|MINOR)\s*=\s*(\d+)", f.read(), re.M))
        text = f"{found.get('MAJOR')}.{found.get('MINOR')}" if len(found) == 2 else None
    if text is None:
        try:
            text = importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            return None
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def mlm_patched_copy(checkout: str, release: tuple[int, int] | None, script_dir: str) -> str | None:
    """The checkout's top-level scripts copied into ``script_dir`` with our patch for its release applied; the path
    of the copy's ``pretrain_gpt.py``, or None where patches/ has none for that release."""
    patch = os.path.join(ROOT, "patches", f"megatron-lm-core_v{release[0]}.{release[1]}.x.patch") if release else ""
    if not os.path.isfile(patch):
        return None
    os.makedirs(script_dir, exist_ok=True)
    for name in os.listdir(checkout):
        if name.endswith(".py"):
            shutil.copy(os.path.join(checkout, name), script_dir)
    subprocess.run(["git", "apply", patch], cwd=script_dir, check=True)
    return os.path.join(script_dir, "pretrain_gpt.py")
