#!/usr/bin/env bash
# A second venv for `make test-compat`: the pinned set (requirements.txt) with another megatron-core in place of
# the pinned one. Usage: scripts/compat_venv.sh VENV_DIR MEGATRON_CORE_VERSION
# torch first, pinned (the CPU wheel: an unpinned torch pulls a multi-GB CUDA build); then the core and test pins
# of requirements.txt minus megatron-core (no DeepSpeed, Hugging Face, plots or docs: test-compat runs none);
# then megatron-core itself with --no-deps (0.17+ declare Python >= 3.12 but install and run on 3.11 from their
# sdist: --ignore-requires-python; 0.15.x declare numpy<2 and need it: their fully parallel torch_dist save calls
# np.product, gone in numpy 2, so there numpy<2 replaces the pinned numpy), plus triton (0.17+
# import it from their MoE ops) and packaging; and the [megatron-lm] extra's six, regex and pyyaml, so that the
# opt-in suite (MEGATRON_LM_PATH=... VENV/bin/python -m pytest -m megatron_lm tests/megatron_lm) runs in it too.
set -euo pipefail
venv=${1:?venv directory}
version=${2:?megatron-core version}
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
here=$(cd "$(dirname "$0")/.." && pwd)
pip_q=(-q --disable-pip-version-check)
test -x "$venv/bin/python" || "$python" -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install "${pip_q[@]}" "$torch_spec"
pins=()
for name in numpy psutil isal safetensors pytest pytest-xdist hypothesis triton packaging pybind11 six regex \
    pyyaml; do
  line=$(grep -i -E "^${name}==" "$here/requirements.txt" || true)
  case "$name:$version" in numpy:0.15.*) line="numpy<2" ;; esac
  pins+=("${line:-$name}")
done
"$py" -m pip install "${pip_q[@]}" "$torch_spec" "${pins[@]}"
"$py" -m pip install "${pip_q[@]}" --no-deps --ignore-requires-python "megatron-core==$version"
"$py" -c "import megatron.core as m; print('megatron-core', m.__version__, 'in', '$venv')"
touch "$venv/.installed"
