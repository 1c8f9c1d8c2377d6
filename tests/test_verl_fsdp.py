"""verl's own FSDP engine with and without ``VERL_ENGINE_VENDOR=megatron_tree``, driven by verl's
code (``infer_batch`` / ``train_batch`` with its ``ppo_loss`` and ``value_loss``) on a GRPO-style
batch whose samples share their prompts: tiny random Qwen3, FSDP2 over two gloo ranks, fp32 on the
CPU (verl's registry looked up for "cuda", as on a GPU node). Runs on the verl stack; skipped
elsewhere."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from harness.dist import run_spawned
from megatron_tree.testing.reference import gradient_errors
from megatron_tree.testing.tolerances import GRAD_RTOL, LOGP_TOL, LOSS_RTOL

ON_VERL_STACK = os.environ.get("MEGATRON_TREE_BRIDGE") in ("verl", "verl-megatron-bridge")
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("verl") is None and not ON_VERL_STACK,
        reason="verl is not installed (the verl stack: MEGATRON_TREE_BRIDGE=verl)",
    ),
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="CPU suite; run with CUDA_VISIBLE_DEVICES= on CUDA machines",
    ),
]


def _full_grads(module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (FSDP2 keeps a DTensor shard per rank), by name."""
    grads = {}
    for name, param in module.named_parameters():
        assert param.grad is not None, name
        grad = param.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
    return grads


def _actor_run(path: str, vendor: str | None, padded: dict, **engine_kwargs) -> dict:
    """verl's ``infer_batch`` (log-probs, entropy) then ``train_batch`` (its ppo_loss) through the
    FSDP engine of ``vendor`` (None: verl's own) on the rollout batch ``padded``."""
    from functools import partial

    from verl.workers.config.actor import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from harness import verl as harness
    from harness.verl_fsdp import build_fsdp_engine

    size = padded["input_ids"].shape[0] * torch.distributed.get_world_size()
    engine, _ = build_fsdp_engine(path, vendor=vendor, clip_grad=1e9, **engine_kwargs)
    data = harness.engine_batch(padded, calculate_entropy=True)
    with engine.eval_mode():
        model_output = engine.infer_batch(data)["model_output"]
    old = no_padding_2_padding(model_output["log_probs"], data).detach().float()
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    advantages = torch.randn(old.shape, generator=g) * padded["response_mask"]
    train = harness.engine_batch(
        dict(padded, old_log_probs=old, advantages=advantages),
        global_batch_size=size,
        calculate_entropy=False,
    )
    config = FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=2,
        ppo_mini_batch_size=size,
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
    )
    with engine.train_mode():
        result = engine.train_batch(train, loss_function=partial(ppo_loss, config=config))
        grads = _full_grads(engine.module)
    return {
        "engine": type(engine).__name__,
        "attention": engine.module.config._attn_implementation,
        "checkpointing": engine.module.is_gradient_checkpointing,
        "log_probs": [t.clone() for t in model_output["log_probs"].unbind()],
        "entropy": [t.clone() for t in model_output["entropy"].unbind()],
        "loss": float(sum(result["loss"])),
        "grads": grads,
        "stats": getattr(engine, "tree_stats", None),
    }


def _critic_run(path: str, vendor: str | None, padded: dict) -> dict:
    """verl's value ``infer_batch`` then ``train_batch`` (its value_loss) through the FSDP critic
    of ``vendor``."""
    from functools import partial

    from verl.workers.config.critic import FSDPCriticConfig
    from verl.workers.utils.losses import value_loss

    from harness import verl as harness
    from harness.verl_fsdp import build_fsdp_engine

    engine, _ = build_fsdp_engine(path, vendor=vendor, model_type="value_model", clip_grad=1e9)
    with engine.eval_mode():
        values = engine.infer_batch(harness.engine_batch(padded))["model_output"]["values"]
    g = torch.Generator().manual_seed(2)
    mask = padded["response_mask"]
    extra = {
        "values": torch.randn(mask.shape, generator=g) * mask,
        "returns": torch.randn(mask.shape, generator=g) * mask,
    }
    train = harness.engine_batch(dict(padded, **extra), global_batch_size=len(mask))
    config = FSDPCriticConfig(
        strategy="fsdp2",
        rollout_n=2,
        ppo_mini_batch_size=len(mask),
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
    )
    with engine.train_mode():
        result = engine.train_batch(train, loss_function=partial(value_loss, config=config))
        grads = _full_grads(engine.module)
    return {
        "engine": type(engine).__name__,
        "values": [t.clone() for t in values.unbind()],
        "loss": float(sum(result["loss"])),
        "grads": grads,
    }


def _refusal(fn) -> str:
    try:
        fn()
    except ValueError as error:
        return str(error)
    return "ran"


def _engines_worker(rank: int, path: str) -> dict:
    """Two gloo ranks, each with its own prompt groups (3 prompts x 2 samples): rank 0 long prompts
    (a tree of at most 64 tokens each), rank 1 short ones (one tree for all)."""
    from transformers import AutoConfig
    from verl.workers.engine import EngineRegistry

    from harness import verl as harness
    from harness.models import hf_logprobs
    from harness.verl_fsdp import build_fsdp_engine, setup_fsdp_cpu

    setup_fsdp_cpu()
    out = {"lookup": {}}
    # Found through the "verl.plugins" entry point (installed with megatron_tree), looked up for
    # the device "cuda" (VERL_ENGINE_DEVICE, as verl's platform reports it on a GPU node).
    for vendor in (None, "megatron_tree"):
        if vendor:
            os.environ["VERL_ENGINE_VENDOR"] = vendor
        else:
            os.environ.pop("VERL_ENGINE_VENDOR", None)
        for model_type in ("language_model", "value_model"):
            for backend in ("fsdp", "fsdp2"):
                cls = EngineRegistry.get_engine_cls(model_type, backend)
                out["lookup"][vendor, model_type, backend] = cls.__name__
    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompt_tokens = (40, 48) if rank == 0 else (5, 12)
    padded, seqs = harness.rollout_batch(vocab, seed=rank, prompt_tokens=prompt_tokens)
    for vendor in (None, "megatron_tree"):
        out[vendor or "stock"] = _actor_run(path, vendor, padded, tree_max_tokens=64)
        out["critic", vendor or "stock"] = _critic_run(path, vendor, padded)
    out["hf"] = hf_logprobs(path, seqs)
    for vendor in (None, "megatron_tree"):  # verl's LoRA: the model is a peft wrapper
        engine, _ = build_fsdp_engine(path, vendor=vendor, lora_rank=8)
        with engine.eval_mode():
            output = engine.infer_batch(harness.engine_batch(padded))["model_output"]
        module = type(engine.module).__name__
        out["lora", vendor or "stock"] = (module, output["log_probs"].unbind())

    # Refusals, by name (on both ranks alike, before any collective).
    out["ulysses"] = _refusal(lambda: build_fsdp_engine(path, vendor="megatron_tree", ulysses=2))
    engine, _ = build_fsdp_engine(path, vendor="megatron_tree")
    temperature = torch.tensor([1.0, 0.5] * (len(seqs) // 2))
    with engine.eval_mode():
        out["temperature"] = _refusal(
            lambda: engine.infer_batch(harness.engine_batch(padded, temperature=temperature))
        )
        out["sum_pi_squared"] = _refusal(
            lambda: engine.infer_batch(harness.engine_batch(padded, calculate_sum_pi_squared=True))
        )
    # Every rank's embedding shard NaN (an unloaded parameter): infer_batch raises on each rank,
    # after all its micro-batches (so no rank leaves FSDP's collectives early).
    with torch.no_grad():
        weight = engine.module.get_input_embeddings().weight
        (weight.to_local() if hasattr(weight, "to_local") else weight).fill_(float("nan"))
    try:
        with engine.eval_mode():
            engine.infer_batch(harness.engine_batch(padded))
        out["non_finite"] = "ran"
    except FloatingPointError as error:
        out["non_finite"] = f"{type(error).__name__}: {error}"
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from harness.models import make_hf_checkpoint

    path = str(tmp_path_factory.mktemp("verl_fsdp") / "qwen3")
    make_hf_checkpoint("qwen3", path)
    return run_spawned(_engines_worker, 2, path, megatron=False)


def _check_gradients(tree: dict, stock: dict) -> float:
    assert set(tree) == set(stock)
    assert all(float(g.abs().max()) > 0 for g in stock.values()), "a zero gradient"
    errors = gradient_errors(tree, stock)
    assert max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])
    return max(errors.values())


def test_vendor_selects_the_tree_engine_for_fsdp_and_fsdp2(ranks):
    """With the vendor set, the lookup for "cuda" returns the tree engines, never verl's (which the
    same lookup returns without it)."""
    for backend in ("fsdp", "fsdp2"):
        for model_type, tree, stock in (
            ("language_model", "TreeFSDPEngineWithLMHead", "FSDPEngineWithLMHead"),
            ("value_model", "TreeFSDPEngineWithValueHead", "FSDPEngineWithValueHead"),
        ):
            assert ranks[0]["lookup"]["megatron_tree", model_type, backend] == tree
            assert ranks[0]["lookup"][None, model_type, backend] == stock


def test_tree_actor_equals_verls_fsdp_engine_and_hf(ranks):
    """FSDP2 over two ranks: each rank's log-probs and entropy (infer_batch) and verl's ppo_loss,
    and the reduced gradients (train_batch), against verl's stock FSDP2 engine on the same batches;
    log-probs against HF on each sequence alone. Rank 1 runs fewer trees than rank 0."""
    # Rank 0: three prompt groups of 45-60 tokens, a tree each; rank 1 fewer trees, then
    # all-padding ones (FSDP's collectives run as often on both ranks).
    stats = [r["megatron_tree"]["stats"] for r in ranks]
    assert [s["micro_batches"] for s in stats] == [3, 3]
    assert stats[0]["empty_micro_batches"] == 0 and stats[1]["empty_micro_batches"] > 0, stats
    for out in ranks:
        stock, tree = out["stock"], out["megatron_tree"]
        assert (stock["engine"], tree["engine"]) == (
            "FSDPEngineWithLMHead",
            "TreeFSDPEngineWithLMHead",
        )
        assert (stock["attention"], tree["attention"]) == ("sdpa", "megatron_tree")
        # verl's default: HF recomputes each layer in the backward (the tree mask rides along)
        assert stock["checkpointing"] and tree["checkpointing"]
        from megatron_tree.testing.tolerances import max_abs_error, worst_error

        errors = {"logp": 0.0, "entropy": 0.0, "hf": 0.0}
        for i, (want, got) in enumerate(zip(stock["log_probs"], tree["log_probs"])):
            # The last entry predicts nothing (verl's losses skip it): verl reads the next
            # sample's first token there, the tree 0. (max() keeps max_abs_error's inf on NaN.)
            assert got.shape == want.shape
            errors["logp"] = max(errors["logp"], max_abs_error(got[:-1], want[:-1]))
            entropy = max_abs_error(tree["entropy"][i], stock["entropy"][i])
            errors["entropy"] = max(errors["entropy"], entropy)
            errors["hf"] = max(errors["hf"], max_abs_error(got[:-1], out["hf"][i]))
        assert worst_error(errors.values()) <= LOGP_TOL, errors
        assert tree["loss"] == pytest.approx(stock["loss"], rel=LOSS_RTOL)
        errors["loss"] = abs(tree["loss"] - stock["loss"]) / abs(stock["loss"])
        errors["grad"] = _check_gradients(tree["grads"], stock["grads"])
        # Two samples per prompt: each prompt computed once.
        stats = tree["stats"]
        assert stats["tokens_unpacked"] == sum(len(s) for s in stock["log_probs"])
        assert stats["tree_token_ratio"] < 0.8, stats
        print("verl FSDP tree engine vs verl's:", errors, stats)


def test_tree_critic_equals_verls_fsdp_critic(ranks):
    for out in ranks:
        stock, tree = out["critic", "stock"], out["critic", "megatron_tree"]
        assert (stock["engine"], tree["engine"]) == (
            "FSDPEngineWithValueHead",
            "TreeFSDPEngineWithValueHead",
        )
        from megatron_tree.testing.tolerances import max_abs_error

        errors = {"values": 0.0}
        for want, got in zip(stock["values"], tree["values"]):
            assert got.shape == want.shape
            errors["values"] = max(errors["values"], max_abs_error(got, want))  # inf on NaN
        assert errors["values"] <= LOGP_TOL, errors
        assert tree["loss"] == pytest.approx(stock["loss"], rel=LOSS_RTOL)
        errors["loss"] = abs(tree["loss"] - stock["loss"]) / abs(stock["loss"])
        errors["grad"] = _check_gradients(tree["grads"], stock["grads"])
        print("verl FSDP tree critic vs verl's:", errors)


def test_tree_actor_with_lora_equals_verls(ranks):
    """verl's LoRA (lora_rank > 0): the engines run a peft wrapper of the HF model."""
    for out in ranks:
        (stock_type, stock), (tree_type, tree) = out["lora", "stock"], out["lora", "megatron_tree"]
        assert stock_type == tree_type == "FSDPPeftModelForCausalLM"
        for want, got in zip(stock, tree):
            assert float((got[:-1] - want[:-1]).abs().max()) <= LOGP_TOL


def test_unsupported_settings_are_refused_by_name(ranks):
    for out in ranks:
        assert out["ulysses"].startswith("ulysses_sequence_parallel_size=2")
        assert out["temperature"].startswith("temperature: per-sample temperatures")
        assert out["sum_pi_squared"].startswith("calculate_sum_pi_squared=True")


def test_a_failed_import_refuses_the_fsdp_keys_instead_of_falling_back():
    """verl swallows entry-point import errors and would then run its stock FSDP engine under
    VERL_ENGINE_VENDOR=megatron_tree; the plugin registers a refusal on the FSDP keys, and the
    Megatron engines (imported separately) stay registered."""
    code = "\n".join(
        [
            "import sys",
            "sys.modules['megatron_tree.integrations.verl_fsdp'] = None  # its import fails",
            "import verl",
            "from verl.workers.engine import EngineRegistry",
            "engines = EngineRegistry._engines",
            "print('MEGATRON', engines['language_model']['megatron'][('cuda', 'megatron_tree')]"
            ".__name__)",
            "for model_type in ('language_model', 'value_model'):",
            "    for backend in ('fsdp', 'fsdp2'):",
            "        for device in ('cuda', 'npu', 'cpu'):",
            "            cls = engines[model_type][backend][(device, 'megatron_tree')]",
            "            try:",
            "                cls()",
            "            except ValueError as error:",
            "                print('REFUSED', model_type, backend, device, error)",
        ]
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "MEGATRON TreeMegatronEngineWithLMHead" in run.stdout, run.stderr[-2000:]
    refused = [line for line in run.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 12, run.stdout + run.stderr[-2000:]
    assert all("megatron_tree's verl engines failed to import (verl_fsdp:" in r for r in refused)
    assert "could not be registered" in run.stderr


def test_without_megatron_core_the_fsdp_engines_register_and_other_strategies_refuse():
    """An FSDP-only install (megatron-core not importable): ``import verl`` registers the FSDP tree
    engines, refuses the Megatron keys (their import failed) and every verl backend without a tree
    engine (verl's ``fsdp_turbo``), and installs the prompt-group balancing hook, all under
    ``VERL_ENGINE_VENDOR=megatron_tree``."""
    code = "\n".join(
        [
            "import sys",
            "sys.modules['megatron'] = None  # megatron-core not installed",
            "import verl",
            "from verl.workers.engine import EngineRegistry",
            "from megatron_tree.integrations.verl_balance import _AfterImport",
            "engines = EngineRegistry._engines['language_model']",
            "print('FSDP2', engines['fsdp2'][('cuda', 'megatron_tree')].__name__)",
            "print('HOOK', any(isinstance(f, _AfterImport) for f in sys.meta_path))",
            "for backend in ('megatron', 'fsdp_turbo'):",
            "    try:",
            "        engines[backend][('cuda', 'megatron_tree')]()",
            "    except ValueError as error:",
            "        print('REFUSED', backend, error)",
        ]
    )
    env = {**os.environ, "VERL_ENGINE_VENDOR": "megatron_tree"}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    out = run.stdout + run.stderr[-2000:]
    assert "FSDP2 TreeFSDPEngineWithLMHead" in run.stdout, out
    assert "HOOK True" in run.stdout, out
    assert "REFUSED megatron VERL_ENGINE_VENDOR=megatron_tree, but" in run.stdout, out
    assert "REFUSED fsdp_turbo VERL_ENGINE_VENDOR=megatron_tree has engines for" in run.stdout, out


def test_non_finite_log_probs_raise_naming_the_micro_batch(ranks):
    """A NaN parameter gives NaN log-probs: the tree engine's infer_batch raises (one flag read
    with the loss verl reads anyway), naming the micro-batch and its batch rows, on every rank."""
    for out in ranks:
        assert out["non_finite"].startswith("NonFiniteOutputError: verl FSDP tree engine: "), out[
            "non_finite"
        ]
        assert "micro-batch 0 has non-finite outputs: logprobs" in out["non_finite"]
        assert "batch rows) [" in out["non_finite"]
