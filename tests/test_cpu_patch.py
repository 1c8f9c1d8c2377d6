"""The CPU runtime patch for Megatron-Core: a tiny GPTModel trains on gloo, and undo restores
all."""

from __future__ import annotations

import pytest
import torch

from harness.dist import run_spawned, single_process_world
from megatron_tree.patches import megatron_cpu

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU patch is a no-op on CUDA machines"
)


def _current_targets() -> list[object]:
    out = []
    for module_name, attr_path in megatron_cpu._TARGETS:
        owner, name = megatron_cpu._resolve(module_name, attr_path)
        out.append(vars(owner)[name] if name in vars(owner) else getattr(owner, name))
    return out


def _tiny_gpt(tp_size: int = 1, **config_overrides):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from harness.models import small_gpt_config

    config = small_gpt_config(tensor_model_parallel_size=tp_size, **config_overrides)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=128,
        max_sequence_length=64,
        position_embedding_type="rope",
    )


def _forward_backward(model, seq_len: int = 16) -> tuple[torch.Tensor, float]:
    """Causal LM step on the default causal mask (attention_mask=None exercises the patched
    get_default_causal_mask). Returns the logits and the squared gradient norm of this rank."""
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 128, (1, seq_len), generator=gen)
    position_ids = torch.arange(seq_len).unsqueeze(0)
    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
    logits.float().square().mean().backward()
    grad_sq = sum(float(p.grad.square().sum()) for p in model.parameters() if p.grad is not None)
    return logits.detach(), grad_sq


def test_apply_undo_restore_originals_and_are_idempotent():
    assert not megatron_cpu.is_applied()
    originals = _current_targets()
    assert megatron_cpu.apply() is True
    patched = _current_targets()
    assert all(p is not o for p, o in zip(patched, originals))
    assert torch.cuda.current_device() == torch.device("cpu")
    assert megatron_cpu.apply() is True  # idempotent: nothing is patched twice
    assert _current_targets() == patched
    megatron_cpu.undo()
    megatron_cpu.undo()
    assert not megatron_cpu.is_applied()
    assert all(a is b for a, b in zip(_current_targets(), originals))


def test_context_manager_restores_on_exception_and_nests():
    originals = _current_targets()
    with pytest.raises(KeyError), megatron_cpu.megatron_cpu_patch() as active:
        assert active
        with megatron_cpu.megatron_cpu_patch():
            pass
        assert megatron_cpu.is_applied()  # the inner block did not undo the outer one
        raise KeyError("boom")
    assert not megatron_cpu.is_applied()
    assert all(a is b for a, b in zip(_current_targets(), originals))


def test_missing_symbol_raises_clear_error(monkeypatch):
    monkeypatch.setattr(
        megatron_cpu, "_TARGETS", megatron_cpu._TARGETS + (("megatron.core.utils", "no_such"),)
    )
    with pytest.raises(RuntimeError, match="megatron.core.utils.no_such"):
        megatron_cpu.apply()
    assert not megatron_cpu.is_applied()


def test_gpt_forward_backward_single_process():
    """World size 1 in this process: the CPU RNG tracker seeds, a GPTModel builds, runs forward
    and backward (also under full activation recompute, which saves/restores the RNG states)."""
    try:
        single_process_world()
        from megatron.core.tensor_parallel import random as mp_random

        from harness.models import recompute_fields

        torch.manual_seed(0)
        model = _tiny_gpt()
        logits, grad_sq = _forward_backward(model)
        assert logits.shape == (1, 16, 128) and torch.isfinite(logits).all()
        assert grad_sq > 0

        mp_random.model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(0)
        recompute = _tiny_gpt(**recompute_fields("full"))
        recompute.load_state_dict(model.state_dict())
        model.zero_grad()
        logits_ref, _ = _forward_backward(model)
        logits_rc, _ = _forward_backward(recompute)
        assert torch.equal(logits_ref, logits_rc)
        for (name, p), q in zip(model.named_parameters(), recompute.parameters()):
            assert torch.equal(p.grad, q.grad), name
    finally:
        megatron_cpu.undo()


def _tp_worker(rank: int) -> tuple[torch.Tensor, float]:
    from megatron.core import tensor_parallel

    torch.manual_seed(0)
    model = _tiny_gpt(tp_size=2)
    logits, grad_sq = _forward_backward(model)
    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return full, grad_sq


def test_gpt_forward_backward_tp2_spawned():
    """TP=2 on a spawned gloo world: each rank's gathered logits equal the TP=1 model's (CPU
    initialization draws the same full weights at any TP size), and every rank gets gradients."""
    ranks = run_spawned(_tp_worker, 2)
    single_process_world()
    try:
        torch.manual_seed(0)
        want_logits, want_grad_sq = _forward_backward(_tiny_gpt())
    finally:
        megatron_cpu.undo()
    for logits, _ in ranks:
        # fp32, reordered sums of a 2-layer model: ~1e-6 of O(1) logits.
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert all(g > 0 for _, g in ranks)


def test_torch_norms_allow_sequence_parallel_and_mark_their_parameters():
    """The local spec's torch norms build under sequence parallelism while the patch is applied,
    their parameters marked for finalize_model_grads' TP sum; every other upstream assertion holds,
    and undo brings the refusal back."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from harness.models import small_gpt_config

    configs = {
        norm: small_gpt_config(
            normalization=norm, tensor_model_parallel_size=2, sequence_parallel=True
        )
        for norm in ("RMSNorm", "LayerNorm")
    }
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(configs["RMSNorm"], 64)
    try:
        megatron_cpu.apply()
        for norm, config in configs.items():
            module = WrappedTorchNorm(config, 64, eps=1e-6)
            assert type(module).__name__ == norm and module.eps == 1e-6
            assert config.sequence_parallel  # the model's config is not changed
            params = list(module.parameters())
            assert len(params) == (2 if norm == "LayerNorm" else 1)
            assert all(p.sequence_parallel is True for p in params)
            # Per token: the norm of a sequence shard is the shard of the norm (fp32 defaults;
            # the same per-row arithmetic, so equal up to vectorization order).
            x = torch.randn(8, 1, 64)
            torch.testing.assert_close(module(x[4:]), module(x)[4:])
        unmarked = WrappedTorchNorm(small_gpt_config(), 64)
        assert unmarked.weight.sequence_parallel is False
        configs["RMSNorm"].persist_layer_norm = True
        with pytest.raises(AssertionError, match="persist_layer_norm not supported"):
            WrappedTorchNorm(configs["RMSNorm"], 64)
    finally:
        megatron_cpu.undo()
    configs["RMSNorm"].persist_layer_norm = False
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(configs["RMSNorm"], 64)


def test_moe_router_and_alltoall_dispatcher_on_cpu():
    """megatron-core 0.16.1 without transformer-engine never defines ``te_general_gemm``, which its
    router reads (NameError); the patch defines it as None only where it is missing and undo
    deletes it again. The alltoall dispatcher builds (no CUDA stream) and routes on the CPU; its
    class-level stream is None again after undo."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from harness.models import build_gpt_model, small_moe_config

    had_gemm = hasattr(moe_utils, "te_general_gemm")
    stream = MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    try:
        single_process_world()
        assert moe_utils.te_general_gemm is None
        model = build_gpt_model(small_moe_config(dispatcher="alltoall"), tree=False, vocab_size=128)
        assert type(model.decoder.layers[0].mlp.token_dispatcher) is MoEAlltoAllTokenDispatcher
        logits, grad_sq = _forward_backward(model)
        assert torch.isfinite(logits).all() and grad_sq > 0
    finally:
        megatron_cpu.undo()
    assert hasattr(moe_utils, "te_general_gemm") == had_gemm
    assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is stream
