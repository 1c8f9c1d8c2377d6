"""One GRPO step inside verl's own Megatron engine, with tree training switched on by
``VERL_ENGINE_VENDOR=megatron_tree`` (no verl code changed).

    MEGATRON_TREE_BRIDGE=verl scripts/setup_env.sh   # the verl stack (Python 3.12), once
    .venv-python3.12-0.19.2-verl/bin/python examples/verl_grpo_step.py

A tiny random Qwen3, 4 prompts x 4 samples: verl's engine computes the old log-probs
(``infer_batch``), the advantages are group-normalized random rewards (GRPO), and one
``train_batch`` with verl's ``ppo_loss`` updates the actor. On a CPU machine the test harness's CPU
stand-ins are applied first (a GPU machine needs none of them).
"""

from __future__ import annotations

import os
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

# The test harness (tests/harness: tiny models, spawned worlds, engine fixtures) is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(prompts: int = 4, samples: int = 4) -> dict:
    from harness import verl as harness
    from harness.models import make_hf_checkpoint

    if not torch.cuda.is_available():
        harness.setup_cpu()
    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    path = os.path.join(tempfile.mkdtemp(prefix="verl_grpo_"), "qwen3")
    make_hf_checkpoint("qwen3", path)
    engine, model_config = harness.build_engine(path, vendor="megatron_tree")
    padded, seqs = harness.rollout_batch(
        model_config.hf_config.vocab_size, prompts=prompts, samples=samples
    )
    data = harness.engine_batch(padded)
    with engine.eval_mode():
        old = (
            no_padding_2_padding(engine.infer_batch(data)["model_output"]["log_probs"], data)
            .detach()
            .float()
        )
    rewards = torch.rand(prompts, samples, generator=torch.Generator().manual_seed(0))
    scores = (
        (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    ).reshape(-1)
    advantages = scores[:, None] * padded["response_mask"]
    train = harness.engine_batch(
        dict(padded, old_log_probs=old, advantages=advantages), global_batch_size=len(seqs)
    )
    config = McoreActorConfig(
        strategy="megatron",
        rollout_n=samples,
        ppo_mini_batch_size=len(seqs),
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
    )
    with engine.train_mode():
        result = engine.train_batch(train, loss_function=partial(ppo_loss, config=config))
    summary = {
        "engine": type(engine).__name__,
        "loss": float(sum(result["loss"])),
        **engine.tree_stats,
    }
    print(
        "[verl_grpo_step]",
        " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()
        ),
    )
    return summary


if __name__ == "__main__":
    main()
