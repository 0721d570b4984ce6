"""Every exception class the package defines sits under ``TenplexError``, so a caller can catch the plugin's errors
as one; each keeps its other bases (``ValueError``...), so narrower ``except`` clauses keep working."""

from __future__ import annotations

from tenplex_megatron import TenplexError
from tenplex_megatron.error_reference import defined_subclasses


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
