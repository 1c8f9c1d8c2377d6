"""TRL 1.16's ``GRPOTrainer`` as a test and benchmark fixture: a trainer (stock or
:class:`~megatron_tree.integrations.trl.TreeGRPOTrainer`) over an HF checkpoint on the CPU, and a
batch in TRL's prepared-input layout. Generation is not needed: the log-prob and loss methods take
the prepared batch, and ``train()`` takes rollouts from TRL's ``rollout_func`` hook."""

from __future__ import annotations

from collections.abc import Callable

import torch


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over ids ``t0 .. t<vocab_size - 1>`` (pad ``t0``, unk ``t1``, eos
    ``t2``), built in memory: TRL needs one, the tiny checkpoints have none."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1"
    )


def trl_inputs(
    prompts: list[torch.Tensor],
    completions: list[torch.Tensor],
    *,
    num_generations: int,
    pad_token_id: int = 0,
    seed: int = 1,
) -> dict:
    """TRL's prepared-input layout of rows (prompt b, completion b): ``prompt_ids`` /
    ``prompt_mask`` [B, P] left-padded, ``completion_ids`` / ``completion_mask`` [B, C]
    right-padded, ``advantages`` [B] (rewards drawn from N(0, 1) with ``seed``, normalized within
    each group of ``num_generations`` consecutive rows), ``num_items_in_batch``."""
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    rows = len(prompts)
    prompt_ids = torch.full((rows, width_p), pad_token_id)
    prompt_mask = torch.zeros(rows, width_p, dtype=torch.long)
    completion_ids = torch.full((rows, width_c), pad_token_id)
    completion_mask = torch.zeros(rows, width_c, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        prompt_ids[b, width_p - len(p) :], prompt_mask[b, width_p - len(p) :] = p, 1
        completion_ids[b, : len(c)], completion_mask[b, : len(c)] = c, 1
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(rows, generator=g).view(-1, num_generations)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages.reshape(-1),
        "num_items_in_batch": completion_mask.sum(),
    }


def prompt_completion(inputs: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids [B, P + C], attention_mask [B, P + C], C): what TRL's loss hands
    ``_get_per_token_logps_and_entropies``."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    return ids, mask, inputs["completion_ids"].shape[1]


def grpo_trainer(
    path: str,
    output_dir: str,
    *,
    tree: bool,
    prompts: list[str],
    num_generations: int,
    reward: Callable,
    rollout_func: Callable | None = None,
    tree_options=None,
    vocab_size: int = 128,
    **config,
):
    """TRL's ``GRPOTrainer`` (``tree``: ``TreeGRPOTrainer``) on the fp32 HF checkpoint at ``path``,
    CPU, one process: ``GRPOConfig`` with a batch of ``num_generations`` rows per prompt of
    ``prompts`` (the dataset), temperature 0.7, ``loss_type="dapo"``, ``beta=0``, no logging or
    saving; ``config`` replaces any field."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from megatron_tree.integrations.trl import TreeGRPOTrainer

    fields = dict(
        output_dir=output_dir,
        per_device_train_batch_size=len(prompts) * num_generations,
        num_generations=num_generations,
        max_completion_length=16,
        temperature=0.7,
        loss_type="dapo",
        beta=0.0,
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    fields.update(config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    extra = {"tree_options": tree_options} if tree else {}
    return (TreeGRPOTrainer if tree else GRPOTrainer)(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**fields),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=word_tokenizer(vocab_size),
        rollout_func=rollout_func,
        **extra,
    )
