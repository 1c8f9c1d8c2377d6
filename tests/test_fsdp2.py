"""HF models under FSDP2 with trees: a 2-rank gloo world on the CPU, each rank packing its share.

A tiny Qwen3 is prepared (tree attention) and sharded with ``fully_shard`` per decoder layer and at
the root; :func:`~megatron_tree.integrations.fsdp.pack_rank_share` partitions a branching batch
(prompt groups whole) and packs each rank's part; ``packed_logprobs`` runs it, a weighted token
loss normalized by the GLOBAL token count goes backward, FSDP2 reduce-scatters (averaging, so the
loss is scaled by the rank count), and one AdamW step follows. The reference is plain HF (no FSDP,
eager attention) on each sequence of the whole batch alone, with the same loss and optimizer.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tree.testing.tolerances import GRAD_RTOL, LOGP_TOL, OPTIMIZER_STEP_RTOL

transformers = pytest.importorskip("transformers")

WORLD = 2
LR = 1e-3


def _batch():
    """Two branching batches and one large GRPO group (16 responses to one prompt), shuffled: 5
    prompt groups labelled by their first token; per-sequence weights (advantages); the global
    count of predicted tokens. Balancing alone would cut the large group across the ranks."""
    from harness.models import VOCAB, branching_sequences

    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(1, VOCAB, (24,), generator=g)
    grpo = [torch.cat([prompt, torch.randint(1, VOCAB, (20,), generator=g)]) for _ in range(16)]
    seqs = [s for seed in range(2) for s in branching_sequences(seed=seed)] + grpo
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(2)).tolist()
    seqs = [seqs[i] for i in order]  # groups interleaved in the batch
    firsts = sorted({int(s[0]) for s in seqs})
    labels = [firsts.index(int(s[0])) for s in seqs]
    weights = torch.randn(len(seqs), generator=torch.Generator().manual_seed(3))
    tokens = sum(len(s) - 1 for s in seqs)
    return seqs, labels, weights, tokens


def _loss(logprobs, weights, indices, tokens):
    """sum over sequences of -w_b * sum_t logp_b[t], / the global token count (the last entry of
    each sequence is the 0 pad of the rolled layout)."""
    total = 0.0
    for lp, i in zip(logprobs, indices):
        total = total - weights[i] * lp[:-1].sum()
    return total / tokens


def _fsdp_rank(rank: int, ckpt: str, seqs, labels, weights, tokens) -> dict:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from megatron_tree.integrations.fsdp import pack_rank_share
    from megatron_tree.integrations.transformers import packed_logprobs, prepare_model

    torch.manual_seed(0)
    model = prepare_model(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    # Small trees: several micro-batches per rank, in different numbers before the fill-ins.
    share = pack_rank_share({"input_ids": seqs}, max_tokens_per_mb=64, block_size=16, groups=labels)
    out = packed_logprobs(model, share.batch).logprobs  # list of [L_b]
    loss = _loss(out, weights, share.indices.tolist(), tokens)
    # The loss is normalized globally and FSDP2's reduce-scatter averages over the ranks: scale by
    # their number (set_gradient_divide_factor(1.0) does the same on NCCL; gloo has no PREMUL_SUM).
    (loss * WORLD).backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=LR).step()
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {
        "parts": [p.tolist() for p in share.parts],
        "indices": share.indices.tolist(),
        "logprobs": [lp.detach() for lp in out],
        "micro_batches": len(share.batch),
        "dummy_trees": share.batch.num_dummy_trees,
        "tree_token_ratio": share.batch.tree_token_ratio,
        "loss": float(loss.detach()),
        "grads": grads,
        "params": params,
    }


def _reference(ckpt: str, seqs, weights, tokens) -> dict:
    """Plain HF, eager attention, each sequence alone; the same loss over the whole batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    )
    logprobs = []
    for s in seqs:
        logits = model(s[None]).logits[0].float()
        lp = torch.log_softmax(logits, -1)[:-1].gather(1, s[1:, None])[:, 0]
        logprobs.append(torch.cat([lp, lp.new_zeros(1)]))  # the rolled layout's last entry
    loss = _loss(logprobs, weights, range(len(seqs)), tokens)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=LR).step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"logprobs": [lp.detach() for lp in logprobs], "grads": grads, "params": params}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def test_fsdp2_tree_matches_hf_per_sequence(tmp_path):
    from harness.dist import run_spawned
    from harness.models import make_hf_checkpoint

    ckpt = str(tmp_path / "qwen3")
    make_hf_checkpoint("qwen3", ckpt)
    seqs, labels, weights, tokens = _batch()
    ranks = run_spawned(_fsdp_rank, WORLD, ckpt, seqs, labels, weights, tokens, megatron=False)
    ref = _reference(ckpt, seqs, weights, tokens)

    # The partition: every sample on exactly one rank, no prompt group split.
    parts = ranks[0]["parts"]
    assert parts == ranks[1]["parts"] and [r["indices"] for r in ranks] == parts
    assert sorted(i for p in parts for i in p) == list(range(len(seqs)))
    assert len(set(labels)) == 5
    for label in set(labels):
        holders = {r for r, p in enumerate(parts) if any(labels[i] == label for i in p)}
        assert len(holders) == 1, f"prompt group {label} split across ranks {holders}"
    # Several trees per rank, equal counts (fill-ins where needed), prefixes shared.
    assert ranks[0]["micro_batches"] == ranks[1]["micro_batches"] > 1
    assert all(r["tree_token_ratio"] < 0.8 for r in ranks)

    # Log-probs per sequence against HF on it alone.
    from megatron_tree.testing.tolerances import max_abs_error, worst_error

    err = worst_error(
        max_abs_error(lp, ref["logprobs"][i])
        for r in ranks
        for lp, i in zip(r["logprobs"], r["indices"])
    )
    assert err <= LOGP_TOL, err
    # Full gradients after the reduce-scatter (identical on both ranks), and after one AdamW step.
    for name, want in ref["grads"].items():
        for r in ranks:
            assert _rel(r["grads"][name], want) <= GRAD_RTOL, name
    for name, want in ref["params"].items():
        for r in ranks:
            assert _rel(r["params"][name], want) <= OPTIMIZER_STEP_RTOL, name


def test_trunk_reuse_and_ulysses_refused():
    """The HF engine runs whole trees: a batch packed with trunk reuse, and a Ulysses sequence
    parallel size, are refused with messages that name the argument to change."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.models import branching_sequences
    from megatron_tree import build_packed_tree_batch
    from megatron_tree.integrations.fsdp import pack_rank_share
    from megatron_tree.integrations.transformers import packed_logprobs, prepare_model

    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = prepare_model(AutoModelForCausalLM.from_config(config))
    seqs = branching_sequences()
    # Capacity below the prompt group: its trie runs with trunk reuse.
    trunked = build_packed_tree_batch(
        {"input_ids": seqs}, max_tokens_per_mb=32, block_size=16, share_trunks=True
    )
    assert not all(mb.rows.is_whole for mb in trunked)
    with pytest.raises(ValueError, match="share_trunks=False"):
        packed_logprobs(model, trunked)
    data = {"input_ids": seqs}
    with pytest.raises(ValueError, match="share_trunks=False"):
        pack_rank_share(data, max_tokens_per_mb=64, share_trunks=True)
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2"):
        pack_rank_share(data, max_tokens_per_mb=64, ulysses_sequence_parallel_size=2)
