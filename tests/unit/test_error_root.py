"""Every exception class the package defines sits under ``TenplexError``, so a caller can catch the plugin's errors
as one; each keeps its other bases (``ValueError``...), so narrower ``except`` clauses keep working. And the package
raises its own classes: a ``raise`` of a built-in exception class (read from the source with ``ast``) is allowed only
where :data:`BUILTIN_RAISES_ALLOWED` says why."""

from __future__ import annotations

import ast
import builtins
import glob
import os

from tenplex_megatron import TenplexError
from tenplex_megatron.error_reference import defined_subclasses

PKG = os.path.join(os.path.dirname(__file__), "..", "..", "tenplex_megatron")


def _exception_classes() -> list[type[BaseException]]:
    """Every exception class defined (not merely imported) in a module of the package."""
    return defined_subclasses(BaseException)


def test_every_exception_class_of_the_package_is_a_tenplex_error() -> None:
    classes = _exception_classes()
    names = {c.__name__ for c in classes}
    assert {"PTCError", "CheckpointFileError", "RankFailure", "CLIError"} <= names  # the walk really found them
    outside = sorted(f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, TenplexError))
    assert not outside, "not under TenplexError: " + ", ".join(outside)


def test_the_error_classes_keep_their_other_bases() -> None:
    from tenplex_megatron._optional import MissingExtraError
    from tenplex_megatron.plan.ptc import PTCError
    from tenplex_megatron.storage.lease import FencedError

    assert issubclass(PTCError, ValueError) and issubclass(MissingExtraError, ImportError)
    assert issubclass(FencedError, RuntimeError)
    try:
        raise PTCError("bad chunk")
    except TenplexError as e:
        assert str(e) == "bad chunk"


def test_the_classes_that_replaced_built_in_raises_keep_the_built_in_base() -> None:
    """An ``except FileNotFoundError`` (or ``KeyError``...) written for the old raise still catches the new one."""
    from tenplex_megatron.flags import FlagError
    from tenplex_megatron.integrations.hf.export import OutputDirError
    from tenplex_megatron.memory.direct_copy import ShortCopyError
    from tenplex_megatron.plan.sim.gpt_catalogue import UnknownModelError
    from tenplex_megatron.storage.files import CheckpointFileError, CheckpointNotFoundError
    from tenplex_megatron.training.dataset_builder import MissingInputError
    from tenplex_megatron.training.dataset_files import DatasetError

    for cls, builtin in ((FlagError, ValueError), (CheckpointNotFoundError, FileNotFoundError),
                         (CheckpointNotFoundError, CheckpointFileError), (OutputDirError, FileExistsError),
                         (UnknownModelError, KeyError), (ShortCopyError, OSError),
                         (MissingInputError, FileNotFoundError), (MissingInputError, DatasetError)):
        assert issubclass(cls, TenplexError) and issubclass(cls, builtin), (cls, builtin)
    assert str(CheckpointNotFoundError("/ckpt: missing")) == "/ckpt: missing"  # one argument: no errno
    assert str(ShortCopyError("f: short copy at byte 4 of 8")) == "f: short copy at byte 4 of 8"


#: raises of a built-in exception class that stay built-in: (file under tenplex_megatron/, enclosing function or
#: method, class) -> why. Everything else a user can meet is a TenplexError subclass naming the input.
BUILTIN_RAISES_ALLOWED = {
    # a protocol or an imitation: the built-in class is the point
    ("__init__.py", "__getattr__", "AttributeError"):
        "PEP 562: a module's __getattr__ answers an unknown name with AttributeError, as getattr/hasattr expect",
    ("integrations/deepspeed/__init__.py", "__getattr__", "AttributeError"):
        "PEP 562, as the package's own: a moved call is named with its new import path",
    ("training/tokenizer.py", "HuggingFaceTokenizer.pad", "AttributeError"):
        "an absent property, by Python's protocol: megatron-core reads the pad id with a fallback on AttributeError",
    ("storage/faults.py", "fail", "OSError"): "an injected fault imitates a failure the package does not raise itself: "
                                              "the operating system's full disk, EIO, EPERM",
    ("storage/faults.py", "fail", "TypeError"): "an injected fault imitates an unexpected type from a callback",
    ("storage/faults.py", "fail", "RuntimeError"):
        "an injected fault imitates a foreign failure (tests match its words)",
    ("training/cpu_grouped_gemm.py", "_check", "ValueError"):
        "the CPU stand-in of the grouped_gemm package raises what that package's own argument checks raise",
    ("engine/orphan.py", "die_with_agent", "OSError"):
        "raised and caught in the same try: prctl's refusal takes the same polling fallback as its absence",
    # programming errors: no flag, file or argument of a user's reaches them
    ("cli_options.py", "add_job_options", "ValueError"): "the package's own parsers name the shared options",
    ("error_reference.py", "summary", "ValueError"):
        "a class of the package without a docstring, a developer's error (test_error_reference.py catches it)",
    ("frontdoor/megatron_lm.py", "installed", "RuntimeError"): "only the wrappers install() puts in place call it",
    ("memory/restart.py", "_metadata", "ValueError"): "choose() reads the snapshot's metadata before it returns it",
    ("plan/staging.py", "split_piece", "ValueError"): "stage_batches passes at least one element per buffer",
    ("plan/staging.py", "stage_batches", "ValueError"):
        "staging buffers are never below storage/staging.py's MIN_BYTES, which is ALIGN",
    ("plan/verify_share.py", "share_blocks", "ValueError"): "the block intervals come from the ranks' own plans",
    ("storage/faults.py", "fault_kind", "ValueError"):
        "the point is a name in the package's code (a TENPLEX_FAULT naming an unknown one is a FlagError)",
    ("storage/faults.py", "maybe_fail", "ValueError"):
        "the point is a name in the package's code (a TENPLEX_FAULT naming an unknown one is a FlagError)",
    ("storage/safetensors_io.py", "write_safetensors", "ValueError"):
        "the save passes its own block size (engine/save.py's BLOCK_BYTES)",
    ("storage/staging.py", "StagingRing._check_open", "RuntimeError"):
        "the package's own staging ring used after close",
    ("training/cpu_shim.py", "install", "RuntimeError"): "its callers install it only where CUDA is unavailable",
    ("storage/parallel_read.py", "_place_boxes", "AssertionError"):
        "the reader's own planning: every byte a piece reads lies in a run it planned",
    ("storage/parallel_read.py", "_place_blocks", "AssertionError"):
        "the reader's own planning: a checksum block is never split across the reads it planned",
}

#: files another change is splitting: their built-in raises are converted once it is merged (not checked until then)
SPLIT_ELSEWHERE: tuple[str, ...] = ()

#: the built-in exception classes a raise is checked for: every Exception subclass (SystemExit, which ends a
#: program with its message or status, and KeyboardInterrupt are BaseException's alone and not errors to catch)
BUILTIN_ERRORS = frozenset(n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, Exception))


def builtin_raises(source: str) -> list[tuple[str, str, int]]:
    """(enclosing function or method, built-in class, line) of every ``raise`` of a built-in exception class in
    ``source`` (``raise ValueError(...)`` or ``raise ValueError``; a re-raise of a caught error is not one)."""
    found = []

    def walk(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(child, (*scope, child.name))
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id in BUILTIN_ERRORS:
                    found.append((".".join(scope), exc.id, child.lineno))
            walk(child, scope)

    walk(ast.parse(source), ())
    return found


def _package_raises() -> list[tuple[str, str, str, int]]:
    """(file under tenplex_megatron/, function, class, line) of every built-in raise in the package's source."""
    out = []
    for path in sorted(glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, PKG).replace(os.sep, "/")
        with open(path, encoding="utf-8") as f:
            out += [(rel, fn, cls, line) for fn, cls, line in builtin_raises(f.read())]
    return out


def test_no_raise_of_a_built_in_exception_class_beyond_the_allow_list() -> None:
    raises = _package_raises()
    unexplained = sorted(f"tenplex_megatron/{rel}:{line}: raise {cls} in {fn or 'the module'}"
                         for rel, fn, cls, line in raises
                         if rel not in SPLIT_ELSEWHERE and (rel, fn, cls) not in BUILTIN_RAISES_ALLOWED)
    assert not unexplained, ("raise a TenplexError subclass naming the input (keep the built-in as its other base), "
                             "or add to BUILTIN_RAISES_ALLOWED with why:\n" + "\n".join(unexplained))
    stale = set(BUILTIN_RAISES_ALLOWED) - {(rel, fn, cls) for rel, fn, cls, _ in raises}
    assert not stale, f"stale BUILTIN_RAISES_ALLOWED entries: {sorted(stale)}"
    assert all(os.path.isfile(os.path.join(PKG, rel)) for rel in SPLIT_ELSEWHERE), "stale SPLIT_ELSEWHERE entry"


def test_the_raise_check_finds_a_built_in_raise() -> None:
    """The check itself: a built-in raised by call or by name is found with its scope; a re-raise, a package class,
    an argparse error and SystemExit are not."""
    source = '''
def parse(x):
    if x < 0:
        raise ValueError(f"x must be >= 0, got {x}")
    raise KeyError

class Ring:
    def close(self):
        try:
            pass
        except OSError as e:
            raise e
        raise RuntimeError("closed") from None

def main():
    raise SystemExit("usage")

def other():
    raise FlagError("--x") from argparse.ArgumentTypeError("y")
'''
    assert builtin_raises(source) == [("parse", "ValueError", 4), ("parse", "KeyError", 5),
                                      ("Ring.close", "RuntimeError", 13)]
