"""Test helpers: tiny random HuggingFace checkpoints, branching tries, references.

Weights are re-drawn larger than HF's default init (std 0.02) so that logits are far from uniform
and attention far from flat: a wrong rotary angle or a leaked key then moves log-probs visibly.
"""

from __future__ import annotations

import math

import torch

from megatron_tree.packing import build_packed_tree_batch
from megatron_tree.synthetic import pad_sequences

VOCAB = 128

ARCHS = ("qwen2", "qwen3", "llama")


def make_hf_checkpoint(arch: str, path: str, *, seed: int = 0) -> None:
    """Save a tiny random ``arch`` model (hidden 64, 2 layers, 4 heads, 2 KV heads) to ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    if arch == "qwen3":
        common["head_dim"] = 16
    config = AutoConfig.for_model(arch, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.6, 1.4)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.15)
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)


def branching_sequences(seed: int = 0) -> list[torch.Tensor]:
    """A shared prompt with 6 responses, a multi-turn chain branching at several depths, and
    sequences that are prefixes of others (including an exact duplicate)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(1, VOCAB, (n,), generator=g)

    prompt = rand(24)
    seqs = [torch.cat([prompt, rand(n)]) for n in (9, 17, 5, 12, 1, 20)]
    turn1 = torch.cat([rand(10), rand(8)])
    turn2 = torch.cat([turn1, rand(7)])
    turn3a = torch.cat([turn2, rand(11)])
    turn3b = torch.cat([turn2, rand(6)])
    branch_early = torch.cat([turn1[:5], rand(13)])
    seqs += [turn1, turn2, turn3a, turn3b, branch_early]
    seqs += [prompt[:15].clone(), seqs[0].clone()]  # prefix of the prompt group; duplicate
    return seqs


def pack(seqs: list[torch.Tensor], *, block_size: int = 16, max_tokens: int = 512) -> list[dict]:
    batch = pad_sequences(seqs)
    return list(build_packed_tree_batch(batch, max_tokens_per_mb=max_tokens, block_size=block_size, pad_to_max=False))


def packed_logprobs(logits: torch.Tensor, micro_batch: dict) -> dict[int, torch.Tensor]:
    """Per-sequence next-token log-probs [L_i - 1] from packed logits [1, N, V], by batch index."""
    tree = micro_batch["tree"]
    logp = torch.log_softmax(logits[0].float(), dim=-1)
    out = {}
    for i in range(tree.num_sequences):
        idx = tree.sequence_token_index(i)
        out[int(tree.sequence_ids[i])] = logp[idx[:-1], tree.input_ids[idx[1:]]]
    return out


def max_err(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> float:
    """Largest absolute difference between two {sequence: log-probs} maps over the same sequences."""
    assert a.keys() == b.keys()
    return max(float((a[i] - b[i]).abs().max()) for i in a)


def hf_logprobs(path: str, seqs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Reference: HuggingFace on each sequence alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    out = {}
    with torch.no_grad():
        for i, s in enumerate(seqs):
            logits = model(s[None]).logits[0]
            out[i] = torch.log_softmax(logits.float(), -1)[:-1].gather(1, s[1:, None])[:, 0]
    return out


def attention_reference(q, k, v, masked):
    """Brute force: repeat KV groups, scores, -inf on masked pairs, softmax. [N, b, np*hn]."""
    n, b, heads, dim = q.shape
    rep = heads // k.shape[2]
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, kk) / math.sqrt(dim)
    probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, vv).reshape(n, b, heads * dim)
