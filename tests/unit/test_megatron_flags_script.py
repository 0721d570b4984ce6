"""``scripts/megatron_flags.py`` reads a checkout's flags from its parser (a missing third-party import stood in
for), falls back to its ``add_argument`` calls read with ``ast`` when the import fails, and names the release line;
on small fake checkouts, each read in a fresh interpreter as the script does."""

from __future__ import annotations

import pathlib

from scripts import megatron_flags as script
from tenplex_megatron.plan import megatron_flag_snapshot as snap

PARSER = """
def add_megatron_arguments(parser):
    g = parser.add_argument_group(title='network size')
    g.add_argument('--num-layers', type=int, default=None)
    g.add_argument('--no-masked-softmax-fusion', action='store_false', dest='masked_softmax_fusion')
    g.add_argument('--disable-bias-linear', '--no-bias-linear', action='store_false', dest='add_bias_linear')
    return parser
"""


def _checkout(tmp: pathlib.Path, first_line: str) -> str:
    (tmp / "megatron" / "core").mkdir(parents=True)
    (tmp / "megatron" / "training").mkdir(parents=True)
    (tmp / "megatron" / "post_training").mkdir(parents=True)
    for pkg in ("megatron", "megatron/core", "megatron/training"):
        (tmp / pkg / "__init__.py").write_text("")
    (tmp / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 17\nPATCH = 1\nPRE_RELEASE = ''\n")
    (tmp / "megatron" / "training" / "arguments.py").write_text(first_line + "\n" + PARSER)
    (tmp / "megatron" / "post_training" / "arguments.py").write_text(
        "def add_modelopt_args(parser):\n    parser.add_argument('--modelopt-enabled', action='store_true')\n"
        "    return parser\n")
    return str(tmp)


def test_the_parser_is_imported_with_a_missing_module_stood_in_for(tmp_path) -> None:
    line = script.read_checkout(_checkout(tmp_path, "import a_module_nobody_installed\nimport six"), "core_v0.17.1")
    assert (line.name, line.tag, line.package_version, line.read_by) == ("core_v0.17", "core_v0.17.1", "0.17.1",
                                                                         "import")
    assert line.flags == (snap.Flag("add_bias_linear", ("--disable-bias-linear", "--no-bias-linear")),
                          snap.Flag("help", ("--help", "-h")),
                          snap.Flag("masked_softmax_fusion", ("--no-masked-softmax-fusion",)),
                          snap.Flag("modelopt_enabled", ("--modelopt-enabled",), "modelopt"),
                          snap.Flag("num_layers", ("--num-layers",)))


def test_an_import_that_fails_falls_back_to_the_add_argument_calls(tmp_path) -> None:
    line = script.read_checkout(_checkout(tmp_path, "raise RuntimeError('needs a GPU')"))
    assert line.read_by == "ast" and line.tag is None
    assert [f.dest for f in line.flags] == ["add_bias_linear", "help", "masked_softmax_fusion", "modelopt_enabled",
                                            "num_layers"]
    assert line.flags[0].options == ("--disable-bias-linear", "--no-bias-linear")
