"""tenplex-megatron: elastic re-sharding of megatron-core checkpoints (Tenplex's PTC as a library)."""

from setuptools import find_packages, setup

setup(
    name="tenplex-megatron",
    version="0.1.0",
    description="Resume megatron-core GPT training on a different TP/PP/DP layout from the same checkpoint",
    packages=find_packages(include=["tenplex_megatron", "tenplex_megatron.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "megatron-core==0.16.1", "safetensors>=0.4", "psutil", "numpy", "isal>=1.6"],
    entry_points={"console_scripts": ["tenplex-megatron=tenplex_megatron.cli:main"]},
)
