"""TRL 1.16's ``GRPOTrainer`` with and without trees (:class:`TreeGRPOTrainer`), tiny random Qwen3
on the CPU, fp32: TRL's own ``_get_per_token_logps_and_entropies`` and ``compute_loss`` (its GRPO
loss, clipping and token normalization) on a prepared batch of two prompts x four completions that
share prefixes (no generation). References: TRL's stock trainer on the same batch, and HF eager on
each sequence alone. Runs on the TRL stack (``MEGATRON_TREE_BRIDGE=trl``); skipped elsewhere."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_tree.testing.models import VOCAB, hf_logprobs, make_hf_checkpoint
from megatron_tree.testing.reference import gradient_errors, parameter_grads
from megatron_tree.testing.tolerances import GRAD_RTOL, LOGP_TOL, LOSS_RTOL

ON_TRL_STACK = os.environ.get("MEGATRON_TREE_BRIDGE") == "trl"
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("trl") is None and not ON_TRL_STACK,
        reason="TRL is not installed (the TRL stack: MEGATRON_TREE_BRIDGE=trl)",
    ),
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="CPU suite; run with CUDA_VISIBLE_DEVICES= on CUDA machines",
    ),
]

PAD = 0
NUM_GENERATIONS = 4


def _tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary, built in memory (TRL needs one)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1"
    )


def _sequences(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two prompts (12 and 7 tokens) with 4 completions each: shared prefixes, a completion that is
    a prefix of another, an exact duplicate, a one-token completion."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(3, VOCAB, (n,), generator=g)

    prompts, completions = [rand(12), rand(7)], []
    stem = rand(6)
    completions += [torch.cat([stem, rand(5)]), torch.cat([stem, rand(3)]), stem[:4], rand(9)]
    stem = rand(3)
    completions += [torch.cat([stem, rand(8)]), rand(1), torch.cat([stem, rand(2)])]
    completions.append(completions[-1].clone())
    return [p for p in prompts for _ in range(NUM_GENERATIONS)], completions


def _trl_inputs(prompts: list[torch.Tensor], completions: list[torch.Tensor]) -> dict:
    """TRL's prepared-input layout: prompts left-padded, completions right-padded, advantages per
    group, old log-probs drawn near the policy's later (so the ratio is clipped on some tokens)."""
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    rows = len(prompts)
    prompt_ids = torch.full((rows, width_p), PAD)
    prompt_mask = torch.zeros(rows, width_p, dtype=torch.long)
    completion_ids = torch.full((rows, width_c), PAD)
    completion_mask = torch.zeros(rows, width_c, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        prompt_ids[b, width_p - len(p) :], prompt_mask[b, width_p - len(p) :] = p, 1
        completion_ids[b, : len(c)], completion_mask[b, : len(c)] = c, 1
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(rows, generator=g).view(-1, NUM_GENERATIONS)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages.reshape(-1),
        "num_items_in_batch": completion_mask.sum(),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("trl") / "qwen3")
    make_hf_checkpoint("qwen3", path)
    return path


def _trainer(path: str, tmp_path, *, tree: bool):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from megatron_tree.integrations.trl import TreeGRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(tmp_path / ("tree" if tree else "stock")),
        per_device_train_batch_size=2 * NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS,
        max_completion_length=16,
        temperature=0.7,
        loss_type="dapo",
        beta=0.0,
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
    )
    dataset = Dataset.from_dict({"prompt": ["t3 t4", "t5"]})
    cls, extra = (TreeGRPOTrainer, {"tree_options": _options()}) if tree else (GRPOTrainer, {})
    return cls(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=dataset,
        processing_class=_tokenizer(),
        **extra,
    )


def _options():
    from megatron_tree.integrations.transformers import TreeAttentionOptions

    return TreeAttentionOptions(block_size=16)


def _logps(trainer, inputs: dict):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, ent, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, inputs["completion_ids"].shape[1], compute_entropy=True
        )
    return logps, ent


def _loss_and_grads(trainer, inputs: dict):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), parameter_grads(trainer.model, require_all=True)


def test_grpo_logprobs_loss_and_gradients(checkpoint, tmp_path):
    prompts, completions = _sequences()
    inputs = _trl_inputs(prompts, completions)
    stock = _trainer(checkpoint, tmp_path, tree=False)
    tree = _trainer(checkpoint, tmp_path, tree=True)

    lp_stock, ent_stock = _logps(stock, inputs)
    lp_tree, ent_tree = _logps(tree, inputs)
    assert lp_tree.shape == lp_stock.shape == inputs["completion_ids"].shape
    assert float((lp_tree - lp_stock).abs().max()) <= LOGP_TOL
    assert float((ent_tree - ent_stock).abs().max()) <= LOGP_TOL
    # The tree attention is selected only around the log-prob forward (generation keeps sdpa).
    assert tree.model.config._attn_implementation == stock.model.config._attn_implementation

    # Independent of TRL: HF eager on each sequence alone, at temperature 1 (the trainer's 0.7
    # scales the logits; here the tree path's own function at temperature 1 is compared).
    from megatron_tree.integrations.trl import completion_logprobs, tree_attention_selected

    seqs = [torch.cat([p, c]) for p, c in zip(prompts, completions)]
    hf = hf_logprobs(checkpoint, seqs)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad(), tree_attention_selected(tree.model):
        lp_t1, _ = completion_logprobs(
            tree.model, ids, mask, inputs["completion_ids"].shape[1], options=_options()
        )
    for b, (p, c) in enumerate(zip(prompts, completions)):
        want = hf[b][len(p) - 1 :]  # entry t scores token t + 1: the completion's tokens
        assert float((lp_t1[b, : len(c)] - want).abs().max()) <= LOGP_TOL
        assert torch.all(lp_t1[b, len(c) :] == 0)

    # TRL's loss (dapo, clipped ratio against old log-probs) and its gradients.
    g = torch.Generator().manual_seed(2)
    noise = 0.3 * torch.randn(lp_stock.shape, generator=g)
    inputs["old_per_token_logps"] = (lp_stock + noise) * inputs["completion_mask"]
    loss_stock, grads_stock = _loss_and_grads(stock, inputs)
    loss_tree, grads_tree = _loss_and_grads(tree, inputs)
    assert abs(float(loss_tree - loss_stock)) <= LOSS_RTOL * abs(float(loss_stock))
    errors = gradient_errors(grads_tree, grads_stock)
    assert max(errors.values()) <= GRAD_RTOL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_grpo_refusals(checkpoint, tmp_path):
    from megatron_tree.integrations.trl import TreeGRPOTrainer

    with pytest.raises(ValueError, match="tree_max_tokens_per_mb"):
        TreeGRPOTrainer(model=checkpoint, tree_max_tokens_per_mb=100)
    tree = _trainer(checkpoint, tmp_path, tree=True)
    ids = torch.randint(3, VOCAB, (2, 6))
    holes = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="contiguous"):
        tree._get_per_token_logps_and_entropies(tree.model, ids, holes, 3)
    no_prompt = torch.tensor([[0, 0, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="prompt token"):
        tree._get_per_token_logps_and_entropies(tree.model, ids, no_prompt, 3)
    with pytest.raises(ValueError, match="pixel_values"):
        tree._get_per_token_logps_and_entropies(
            tree.model, ids, torch.ones_like(ids), 3, pixel_values=torch.zeros(1)
        )
    with pytest.raises(ValueError, match="output_router_logits"):
        tree._get_per_token_logps_and_entropies(
            tree.model, ids, torch.ones_like(ids), 3, compute_aux_loss=True
        )
