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

from harness.models import VOCAB, hf_logprobs, make_hf_checkpoint
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

NUM_GENERATIONS = 4


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
    from harness.trl import trl_inputs

    return trl_inputs(prompts, completions, num_generations=NUM_GENERATIONS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("trl") / "qwen3")
    make_hf_checkpoint("qwen3", path)
    return path


def _rollout(prompts: list[str], trainer) -> dict:
    """TRL's ``rollout_func`` hook in place of generation: prompt "p<i>" gets the i-th prompt of
    :func:`_sequences` and its completions in turn (deterministic, whatever the sampler's order)."""
    seq_prompts, seq_completions = _sequences()
    trainer.rollout_attention.append(trainer.model.config._attn_implementation)
    served = {}
    prompt_ids, completion_ids = [], []
    for text in prompts:
        group = int(text[1:])
        k = served.get(group, 0)
        served[group] = k + 1
        prompt_ids.append(seq_prompts[group * NUM_GENERATIONS].tolist())
        completion_ids.append(seq_completions[group * NUM_GENERATIONS + k].tolist())
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def _reward(completions, completion_ids, **kwargs) -> list[float]:
    return [float(sum(ids) % 7) for ids in completion_ids]


def _trainer(path: str, tmp_path, *, tree: bool, **config):
    from harness.trl import grpo_trainer

    trainer = grpo_trainer(
        path,
        str(tmp_path / ("tree" if tree else "stock")),
        tree=tree,
        prompts=["p0", "p1"],
        num_generations=NUM_GENERATIONS,
        reward=_reward,
        rollout_func=_rollout,
        tree_options=_options() if tree else None,
        **config,
    )
    trainer.rollout_attention = []  # the attention selected while each rollout ran
    return trainer


def _options():
    from megatron_tree.integrations.transformers import TreeAttentionOptions

    return TreeAttentionOptions(block_size=16)


def _logps(trainer, inputs: dict):
    from harness.trl import prompt_completion

    ids, mask, keep = prompt_completion(inputs)
    with torch.no_grad():
        logps, ent, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, keep, compute_entropy=True
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
    assert tree.model.config._attn_implementation == "megatron_tree"
    assert tree.generation_attention == stock.model.config._attn_implementation == "sdpa"
    # Micro-batches of 32 unique tokens: the 8 rows in several tries, the same log-probs.
    tree.tree_max_tokens_per_mb = 32
    lp_small, _ = _logps(tree, inputs)
    tree.tree_max_tokens_per_mb = None
    assert float((lp_small - lp_stock).abs().max()) <= LOGP_TOL

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


def test_grpo_train_step(checkpoint, tmp_path):
    """One step of TRL's own ``train()`` (rollouts from ``rollout_func``, rewards, advantages, the
    old log-probs of ``num_iterations=2`` under no_grad, the loss, the backward with TRL's default
    gradient checkpointing, SGD at lr 1 so the update is the clipped gradient): the same update and
    logged loss as TRL's stock trainer."""
    config = dict(
        max_steps=1, num_iterations=2, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant"
    )
    updates, losses = {}, {}
    for tree in (False, True):
        trainer = _trainer(checkpoint, tmp_path, tree=tree, **config)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        updates[tree] = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}
        losses[tree] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert trainer.rollout_attention == ["sdpa"]
    assert len(losses[True]) == len(losses[False]) == 1 and losses[False][0] != 0
    # transformers logs the loss rounded to 4 decimals (the exact loss: the test above)
    assert abs(losses[True][0] - losses[False][0]) <= 1e-4
    assert all(float(u.norm()) > 0 for u in updates[False].values())
    errors = gradient_errors(updates[True], updates[False])
    assert max(errors.values()) <= GRAD_RTOL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    # TRL's own generation (model.generate) runs on the tree trainer's model, with sdpa.
    trainer.rollout_func = None
    completion_ids = trainer._generate(["t3 t4 t5"] * NUM_GENERATIONS)[1]
    assert len(completion_ids) == NUM_GENERATIONS and all(len(c) > 0 for c in completion_ids)
    assert trainer.model.config._attn_implementation == "megatron_tree"


def test_grpo_refusals(checkpoint, tmp_path):
    from megatron_tree.integrations.trl import TreeGRPOTrainer, check_capacity

    with pytest.raises(ValueError, match="tree_max_tokens_per_mb"):
        TreeGRPOTrainer(model=checkpoint, tree_max_tokens_per_mb=100)
    with pytest.raises(ValueError, match="sharded over 2 processes"):
        check_capacity(128, num_processes=2, sharded=True)
    check_capacity(None, num_processes=2, sharded=True)
    check_capacity(128, num_processes=2, sharded=False)  # DDP: one reduction per backward
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
