"""``backend="triton"`` in a Megatron model: a tree-packed step whose core attention runs our Triton
kernels (in Triton's interpreter) against Megatron's stock GPTModel on each sequence alone. Kept
apart from the kernel tests (tests/test_triton_attention.py) because it loads Megatron-Core, so it
runs on every Megatron stack."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="backend='triton' needs the triton package")

from harness.models import VOCAB, branching_sequences, pack
from harness.triton import interpreted_kernels
from megatron_tree.core.mask import tree_attention_mask


@pytest.fixture(scope="module")
def interpreter():
    yield from interpreted_kernels()


@pytest.mark.slow  # ~20 s: two layers' kernels forward and backward in the interpreter
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU suite; run with CUDA_VISIBLE_DEVICES= on CUDA machines"
)
@pytest.mark.usefixtures("world")
def test_model_step_matches_unpacked_reference(interpreter):
    """A tree-packed step of a Megatron GPTModel whose core attention is backend="triton" (fp32,
    GQA 4/2, layer 1 with a depth window of 7, layer 2 full, learnable sinks) against Megatron's
    stock GPTModel on each sequence alone: per-token log-probs and every parameter gradient of a
    weighted log-prob loss."""
    from harness.models import build_gpt_model, small_gpt_config
    from megatron_tree.testing.reference import gradient_errors, parameter_grads
    from megatron_tree.testing.tolerances import GRAD_RTOL, LOGP_TOL

    config = small_gpt_config(
        window_size=(7, 0), window_attn_skip_freq=2, softmax_type="learnable", init_method_std=0.15
    )
    model = build_gpt_model(config, tree=True, vocab_size=VOCAB, backend="triton", block_size=16)
    stock = build_gpt_model(config, tree=False, vocab_size=VOCAB)
    with torch.no_grad():  # sinks that matter (Megatron initializes them near 0)
        for i, layer in enumerate(model.decoder.layers):
            layer.self_attention.core_attention.softmax_offset.copy_(
                torch.tensor([1.0, -1.0, 0.5, 2.0]) + 0.1 * i
            )
    stock.load_state_dict(model.state_dict())
    seqs = branching_sequences()[:6] + branching_sequences()[6:9]
    weights = torch.linspace(0.5, 1.5, len(seqs))

    def logprobs(logits, ids):
        return torch.log_softmax(logits.float(), -1)[:-1].gather(1, ids[1:, None])[:, 0]

    want, loss = {}, 0.0
    for i, s in enumerate(seqs):
        want[i] = logprobs(stock(s[None], torch.arange(len(s))[None], attention_mask=None)[0], s)
        loss = loss + weights[i] * want[i].sum()
    loss.backward()
    (mb,) = pack(seqs, max_tokens=1024)
    tree = mb["tree"]
    logits = model(mb["input_ids"], mb["position_ids"], attention_mask=tree_attention_mask(tree))
    logp = torch.log_softmax(logits[0].float(), -1)
    got, loss = {}, 0.0
    for j in range(tree.num_sequences):
        idx, i = tree.sequence_token_index(j), int(tree.sequence_ids[j])
        got[i] = logp[idx[:-1], tree.input_ids[idx[1:]]]
        loss = loss + weights[i] * got[i].sum()
    loss.backward()
    from megatron_tree.testing.tolerances import max_abs_error, worst_error

    err = worst_error(max_abs_error(got[i], want[i]) for i in want)
    rel = gradient_errors(
        parameter_grads(model, require_all=True), parameter_grads(stock, require_all=True)
    )
    worst = max(rel.values())
    print(f"PARITY model step N={tree.padded_length}: logprob {err:.2e} grad_rel {worst:.2e}")
    assert err <= LOGP_TOL
    assert max(rel.values()) <= GRAD_RTOL, max(rel.items(), key=lambda kv: kv[1])
    assert "decoder.layers.0.self_attention.core_attention.softmax_offset" in rel
