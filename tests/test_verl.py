"""verl's own Megatron engine with and without ``VERL_ENGINE_VENDOR=megatron_tree``, driven by
verl's code (``infer_batch`` / ``train_batch`` with its ``ppo_loss``) on a GRPO-style batch whose
samples share their prompts, tiny random Qwen3, fp32 on the CPU. Runs on the verl stack (verl
installed); skipped elsewhere."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from harness.dist import installed, run_spawned
from megatron_tree.testing.reference import gradient_errors, parameter_grads
from megatron_tree.testing.tolerances import GRAD_RTOL, LOGP_TOL, LOSS_RTOL

# On the verl stacks (MEGATRON_TREE_BRIDGE=verl or verl-megatron-bridge) a missing verl is a
# failure,
# not a skip; on verl-megatron-bridge a missing Megatron-Bridge too.
ON_VERL_STACK = os.environ.get("MEGATRON_TREE_BRIDGE") in ("verl", "verl-megatron-bridge")
ON_VERL_MEGATRON_BRIDGE_STACK = os.environ.get("MEGATRON_TREE_BRIDGE") == "verl-megatron-bridge"
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


def _check_gradients(tree: dict, stock: dict) -> None:
    """The engines' DDP gradient buffers (``main_grad``, after verl's step: clipped by the same
    factor in both), read inside ``engine.train_mode()``: leaving it zeroes them."""
    assert set(tree) == set(stock)
    assert all(float(g.abs().max()) > 0 for g in stock.values()), (
        "a zero gradient: nothing compared"
    )
    errors = gradient_errors(tree, stock)
    assert max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])


def _actor_run(
    path: str, vendor: str | None, padded: dict, seqs: list, **engine_kwargs
) -> tuple[object, dict]:
    """verl's ``infer_batch`` (log-probs, entropy) then ``train_batch`` (its ppo_loss) through the
    engine of ``vendor`` (None: verl's own) on the rollout batch ``padded``."""
    from functools import partial

    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from harness import verl as harness

    engine, _ = harness.build_engine(path, vendor=vendor, **engine_kwargs)
    data = harness.engine_batch(padded, calculate_entropy=True)
    with engine.eval_mode():
        model_output = engine.infer_batch(data)["model_output"]
    old = no_padding_2_padding(model_output["log_probs"], data).detach().float()
    advantages = (
        torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * padded["response_mask"]
    )
    train = harness.engine_batch(
        dict(padded, old_log_probs=old, advantages=advantages),
        global_batch_size=len(seqs),
        calculate_entropy=False,
    )
    config = McoreActorConfig(
        strategy="megatron",
        rollout_n=2,
        ppo_mini_batch_size=len(seqs),
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
    )
    with engine.train_mode():
        result = engine.train_batch(train, loss_function=partial(ppo_loss, config=config))
        grads = parameter_grads(engine.module[0], main_grad=True, require_all=True)
    return engine, {
        "engine": type(engine).__name__,
        "model": type(engine.module[0].module).__name__,
        "log_probs": [t.clone() for t in model_output["log_probs"].unbind()],
        "entropy": [t.clone() for t in model_output["entropy"].unbind()],
        "loss": float(sum(result["loss"])),
        "grads": grads,
        "stats": getattr(engine, "tree_stats", None),
        "bridge": type(engine.bridge).__module__ + "." + type(engine.bridge).__name__,
    }


def _check_actor(tree: dict, stock: dict) -> None:
    """The tree engine's log-probs, entropy, loss and gradients against verl's engine's."""
    for i in range(len(stock["log_probs"])):
        # The last entry predicts nothing (verl's loss mask excludes it); verl's BSHD path fills its
        # label from the micro-batch's padding, the tree (like verl's THD path) from the sequence.
        assert (
            float((tree["log_probs"][i][:-1] - stock["log_probs"][i][:-1]).abs().max()) <= LOGP_TOL
        )
        assert float((tree["entropy"][i] - stock["entropy"][i]).abs().max()) <= LOGP_TOL
    assert tree["loss"] == pytest.approx(stock["loss"], rel=LOSS_RTOL)
    _check_gradients(tree["grads"], stock["grads"])


def _engines_worker(rank: int, path: str, vanilla_mbridge: bool = True) -> dict:
    from harness import verl as harness
    from harness.models import hf_logprobs

    harness.setup_cpu()
    from verl.workers.engine import EngineRegistry

    # Found through the "verl.plugins" entry point (installed with megatron_tree), nothing imported
    # by hand.
    out = {"registered": sorted(map(str, EngineRegistry._engines["language_model"]["megatron"]))}
    padded, seqs = harness.rollout_batch(_vocab(path))
    for vendor in (None, "megatron_tree"):
        engine, out[vendor or "stock"] = _actor_run(
            path, vendor, padded, seqs, vanilla_mbridge=vanilla_mbridge
        )
    out["hf"] = hf_logprobs(path, seqs)
    return out


def _vocab(path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size


def test_tree_engine_equals_verls_engine_and_hf(tmp_path):
    from harness.models import make_hf_checkpoint

    path = str(tmp_path / "qwen3")
    make_hf_checkpoint("qwen3", path)
    out = run_spawned(_engines_worker, 1, path, megatron=False)[0]
    assert "('cuda', 'megatron_tree')" in out["registered"]
    stock, tree = out["stock"], out["megatron_tree"]
    assert (stock["engine"], stock["model"]) == ("MegatronEngineWithLMHead", "GPTModel")
    assert (tree["engine"], tree["model"]) == ("TreeMegatronEngineWithLMHead", "TreeGPTModel")
    _check_actor(tree, stock)
    for i, reference in out["hf"].items():
        assert float((tree["log_probs"][i][:-1] - reference).abs().max()) <= LOGP_TOL
    # Two samples per prompt: each prompt is computed once. Real tokens, padding excluded.
    stats = tree["stats"]
    assert stats["tokens_unpacked"] == sum(len(s) for s in stock["log_probs"])
    assert stats["tree_token_ratio"] < 0.8, stats
    print("tree engine packing:", stats)


@pytest.mark.skipif(
    not (installed("megatron.bridge") and installed("verl")) and not ON_VERL_MEGATRON_BRIDGE_STACK,
    reason="Megatron-Bridge and verl are not both installed (verl's default model-building path; "
    "the stack: MEGATRON_TREE_BRIDGE=verl-megatron-bridge)",
)
def test_tree_engine_through_megatron_bridge(tmp_path):
    """verl's default model-building path (``vanilla_mbridge=False``: Megatron-Bridge's
    ``AutoBridge.from_hf_pretrained`` + ``to_megatron_provider``): the tree engine builds a
    TreeGPTModel through megatron_tree's Megatron-Bridge patch and equals verl's stock engine (and
    HF) in log-probs, entropy, loss and gradients."""
    from harness.models import make_hf_checkpoint

    path = str(tmp_path / "qwen3")
    make_hf_checkpoint("qwen3", path)
    out = run_spawned(_engines_worker, 1, path, False, megatron=False)[0]
    stock, tree = out["stock"], out["megatron_tree"]
    assert (
        stock["bridge"]
        == tree["bridge"]
        == "megatron.bridge.models.conversion.auto_bridge.AutoBridge"
    )
    assert (stock["engine"], stock["model"]) == ("MegatronEngineWithLMHead", "GPTModel")
    assert (tree["engine"], tree["model"]) == ("TreeMegatronEngineWithLMHead", "TreeGPTModel")
    _check_actor(tree, stock)
    for i, reference in out["hf"].items():
        assert float((tree["log_probs"][i][:-1] - reference).abs().max()) <= LOGP_TOL
    assert tree["stats"]["tree_token_ratio"] < 0.8, tree["stats"]


def _trunk_worker(rank: int, path: str) -> dict:
    from harness import verl as harness

    harness.setup_cpu()
    # 2 prompts of 20-27 tokens x 4 samples, micro-batches of 16 rows: no prompt group fits one, and
    # no sequence either (each runs as a chain of parts); the prompts are trunks computed once.
    padded, seqs = harness.rollout_batch(_vocab(path), prompts=2, samples=4, prompt_tokens=(20, 28))
    return {
        vendor or "stock": _actor_run(path, vendor, padded, seqs, tree_max_tokens=16)[1]
        for vendor in (None, "megatron_tree")
    }


def test_tree_engine_with_trunk_reuse_equals_verls_engine(tmp_path):
    """Prompt groups larger than the tree engine's micro-batch: trunk reuse inside verl (the prompt
    computed once across micro-batches, its gradients from every branch) equals verl's engine."""
    from harness.models import make_hf_checkpoint

    path = str(tmp_path / "qwen3")
    make_hf_checkpoint("qwen3", path)
    out = run_spawned(_trunk_worker, 1, path, megatron=False)[0]
    tree = out["megatron_tree"]
    assert tree["stats"]["trunk_groups"] == 2, tree["stats"]
    _check_actor(tree, out["stock"])
    assert tree["stats"]["tree_token_ratio"] < 0.7, tree["stats"]
    print("trunk reuse in verl:", tree["stats"])


def _critic_worker(rank: int, path: str, trunks: bool) -> dict:
    from functools import partial

    from harness import verl as harness

    harness.setup_cpu()
    from verl.workers.config.critic import McoreCriticConfig
    from verl.workers.utils.losses import value_loss

    out = {}
    for vendor in (None, "megatron_tree"):
        # With trunks: prompts of 20-27 tokens x 4 samples in micro-batches of 16 rows (trunk
        # reuse).
        engine, model_config = harness.build_engine(
            path, vendor=vendor, model_type="value_model", tree_max_tokens=16 if trunks else 128
        )
        padded, seqs = harness.rollout_batch(
            model_config.hf_config.vocab_size,
            **(dict(prompts=2, samples=4, prompt_tokens=(20, 28)) if trunks else {}),
        )
        with engine.eval_mode():
            values = engine.infer_batch(harness.engine_batch(padded))["model_output"]["values"]
        g = torch.Generator().manual_seed(2)
        mask = padded["response_mask"]
        extra = {
            "values": torch.randn(mask.shape, generator=g) * mask,
            "returns": torch.randn(mask.shape, generator=g) * mask,
        }
        train = harness.engine_batch(dict(padded, **extra), global_batch_size=len(seqs))
        config = McoreCriticConfig(
            strategy="megatron",
            rollout_n=2,
            ppo_mini_batch_size=len(seqs),
            ppo_micro_batch_size_per_gpu=2,
            use_dynamic_bsz=False,
        )
        with engine.train_mode():
            result = engine.train_batch(train, loss_function=partial(value_loss, config=config))
            grads = parameter_grads(engine.module[0], main_grad=True, require_all=True)
        out[vendor or "stock"] = {
            "engine": type(engine).__name__,
            "values": [t.clone() for t in values.unbind()],
            "loss": float(sum(result["loss"])),
            "grads": grads,
            "stats": getattr(engine, "tree_stats", None),
        }
    return out


@pytest.mark.parametrize("trunks", [False, True], ids=["trees", "trunk-reuse"])
def test_tree_critic_equals_verls_critic(tmp_path, trunks):
    """The value engine: per-sample values, verl's value_loss and its gradients (whole trees, and
    prompt groups larger than a micro-batch with trunk reuse)."""
    from harness.models import make_hf_checkpoint

    path = str(tmp_path / "qwen3")
    make_hf_checkpoint("qwen3", path)
    out = run_spawned(_critic_worker, 1, path, trunks, megatron=False)[0]
    stock, tree = out["stock"], out["megatron_tree"]
    assert (stock["engine"], tree["engine"]) == (
        "MegatronEngineWithValueHead",
        "TreeMegatronEngineWithValueHead",
    )
    assert tree["stats"]["trunk_groups"] == (2 if trunks else 0), tree["stats"]
    for want, got in zip(stock["values"], tree["values"]):
        assert got.shape == want.shape and float((got - want).abs().max()) <= LOGP_TOL
    assert tree["loss"] == pytest.approx(stock["loss"], rel=LOSS_RTOL)
    _check_gradients(tree["grads"], stock["grads"])


def _example_worker(rank: int) -> dict:
    import importlib.util as util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "verl_grpo_step.py"
    spec = util.spec_from_file_location("verl_grpo_step", path)
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main()


@pytest.mark.slow
def test_verl_grpo_example_runs_with_trees():
    summary = run_spawned(_example_worker, 1, megatron=False)[0]
    assert summary["engine"] == "TreeMegatronEngineWithLMHead"
    assert (
        summary["tokens_computed"] < summary["tokens_unpacked"]
        and summary["loss"] == summary["loss"]
    )  # not NaN


def _data_parallel_worker(rank: int, path: str) -> dict:
    from functools import partial

    from harness import verl as harness

    harness.setup_cpu()
    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    out = {}
    for vendor in (None, "megatron_tree"):
        # Capacity 64: rank 0's batch fits one tree, rank 1's needs two, so rank 0 runs an
        # all-padding tree (an empty verl micro-batch) to keep the ranks' schedules aligned.
        engine, model_config = harness.build_engine(path, vendor=vendor, tree_max_tokens=64)
        padded, seqs = harness.rollout_batch(
            model_config.hf_config.vocab_size, prompts=3 + rank, seed=rank
        )
        data = harness.engine_batch(padded)
        with engine.eval_mode():
            log_probs = engine.infer_batch(data)["model_output"]["log_probs"]
        old = no_padding_2_padding(log_probs, data).detach().float()
        advantages = (
            torch.randn(old.shape, generator=torch.Generator().manual_seed(3 + rank))
            * padded["response_mask"]
        )
        train = harness.engine_batch(
            dict(padded, old_log_probs=old, advantages=advantages), global_batch_size=len(seqs)
        )
        config = McoreActorConfig(
            strategy="megatron",
            rollout_n=2,
            ppo_mini_batch_size=len(seqs),
            ppo_micro_batch_size_per_gpu=2,
            use_dynamic_bsz=False,
        )
        with engine.train_mode():
            engine.train_batch(train, loss_function=partial(ppo_loss, config=config))
            grads = parameter_grads(engine.module[0], main_grad=True, require_all=True)
        out[vendor or "stock"] = {
            "log_probs": [t.clone() for t in log_probs.unbind()],
            "grads": grads,
            "stats": getattr(engine, "tree_stats", None),
        }
    return out


def test_tree_engine_on_two_data_parallel_ranks(tmp_path):
    from harness.models import make_hf_checkpoint

    path = str(tmp_path / "qwen3")
    make_hf_checkpoint("qwen3", path)
    ranks = run_spawned(_data_parallel_worker, 2, path, megatron=False)
    assert [r["megatron_tree"]["stats"]["micro_batches"] for r in ranks] == [
        2,
        2,
    ]  # rank 0: one tree + one all-padding
    for r in ranks:
        stock, tree = r["stock"], r["megatron_tree"]
        for want, got in zip(stock["log_probs"], tree["log_probs"]):
            assert float((got[:-1] - want[:-1]).abs().max()) <= LOGP_TOL
        _check_gradients(tree["grads"], stock["grads"])  # averaged over the two ranks by DDP


# verl's plugin registration and trainer, in fresh processes (~8 s each): nothing of the model path,
# so run once, on the verl stack (mbridge), not again on verl + Megatron-Bridge.
ONE_VERL_STACK = pytest.mark.skipif(
    installed("megatron.bridge"),
    reason="independent of the model-building path: runs on the verl stack "
    "(MEGATRON_TREE_BRIDGE=verl)",
)


@ONE_VERL_STACK
def test_a_failed_plugin_import_refuses_instead_of_falling_back():
    """verl swallows entry-point import errors and would then run its own engine under
    VERL_ENGINE_VENDOR=megatron_tree; the plugin registers a refusal in the adapter's place."""
    import subprocess
    import sys

    code = (
        # the adapter's import fails
        "import sys; sys.modules['megatron_tree.integrations.verl'] = None\nimport verl\nfrom "
        "verl.workers.engine import EngineRegistry\ncls = "
        "EngineRegistry._engines['language_model']['megatron'][('cpu', 'megatron_tree')]\ntry:\n   "
        " cls()\nexcept ValueError as error:\n    print('REFUSED', error)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (
        "REFUSED VERL_ENGINE_VENDOR=megatron_tree, but megatron_tree's verl engines failed to "
        "import" in run.stdout
    ), run.stderr[-2000:]
    assert "could not be registered" in run.stderr


def _trie_nodes(sequences) -> int:
    """Brute force: the distinct prefixes of ``sequences`` (a trie's nodes, i.e. its tokens)."""
    return len({tuple(s[:k]) for s in sequences for k in range(1, len(s) + 1)})


def _verls_balance(trainer, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
    """verl's default ``RayPPOTrainer._balance_batch`` (its own workload and partition functions;
    its trainer module needs verl's rollout stack, not installed here)."""
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    lengths = batch.batch["attention_mask"].sum(-1)
    parts = get_seqlen_balanced_partitions(
        calculate_workload(lengths),
        k_partitions=trainer._get_dp_size(None, "actor"),
        equal_size=True,
    )
    batch.reorder(torch.tensor([i for part in parts for i in part]))


def test_trainer_balancing_keeps_prompt_groups_on_one_rank(caplog):
    """verl's single-controller balancing under ``tree_balance_batch``: every prompt group on one
    data-parallel rank, fewer tree tokens on the costliest rank than verl's sequence-length
    balancing, which splits groups; verl's own where groups cannot fill equal chunks (a warning)."""
    import types

    import numpy as np
    from verl import DataProto

    from megatron_tree.integrations.verl import tree_balance_batch

    g = torch.Generator().manual_seed(0)
    prompts, samples, width = 8, 4, 64
    input_ids, mask, uids = (
        torch.zeros(prompts * samples, width, dtype=torch.long),
        torch.zeros(prompts * samples, width),
        [],
    )
    for p in range(prompts):
        prompt = torch.randint(
            1, 1000, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g
        )
        for s in range(samples):
            seq = torch.cat(
                [
                    prompt,
                    torch.randint(
                        1, 1000, (int(torch.randint(2, 24, (1,), generator=g)),), generator=g
                    ),
                ]
            )
            input_ids[p * samples + s, : len(seq)], mask[p * samples + s, : len(seq)] = seq, 1
            uids.append(f"prompt-{p}")
    order = torch.randperm(prompts * samples, generator=g)  # verl's batch is not grouped in order

    def batch_of(n=prompts * samples, uid=None):
        uid = (
            np.array(uids, dtype=object)[order.numpy()][:n]
            if uid is None
            else np.array(uid, dtype=object)
        )
        return DataProto.from_dict(
            {"input_ids": input_ids[order][:n].clone(), "attention_mask": mask[order][:n].clone()},
            non_tensors={"uid": uid},
        )

    tree_balance = tree_balance_batch(_verls_balance)
    for dp_size in (2, 4):
        trainer = types.SimpleNamespace(
            actor_rollout_wg=None, _get_dp_size=lambda wg, role, dp_size=dp_size: dp_size
        )
        result = {}
        for name, balance in (("verl", _verls_balance), ("tree", tree_balance)):
            batch, metrics = batch_of(), {}
            balance(trainer, batch, metrics)
            chunks = [
                range(r * len(batch) // dp_size, (r + 1) * len(batch) // dp_size)
                for r in range(dp_size)
            ]
            ids, m = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
            result[name] = {
                "groups": [{batch.non_tensor_batch["uid"][i] for i in c} for c in chunks],
                "tokens": [_trie_nodes([ids[i][m[i]].tolist() for i in c]) for c in chunks],
                "metrics": metrics,
            }
        tree, verl = result["tree"], result["verl"]
        assert sum(len(groups) for groups in tree["groups"]) == prompts  # each group on one rank
        assert sum(len(groups) for groups in verl["groups"]) > prompts  # verl splits groups
        assert max(tree["tokens"]) < max(verl["tokens"]) and sum(tree["tokens"]) < sum(
            verl["tokens"]
        )
        assert tree["metrics"]["global_seqlen/tree_tokens_max_rank"] == max(tree["tokens"])
        print(
            f"dp={dp_size}: tree tokens per rank {tree['tokens']} (verl's balancing: "
            f"{verl['tokens']})"
        )
    # 3 samples in one group, 5 in another: no equal chunks with groups whole -> verl's, and a
    # warning.
    trainer = types.SimpleNamespace(actor_rollout_wg=None, _get_dp_size=lambda wg, role: 2)
    uneven, expected = batch_of(8, ["a"] * 3 + ["b"] * 5), batch_of(8, ["a"] * 3 + ["b"] * 5)
    with caplog.at_level("WARNING"):
        tree_balance(trainer, uneven, {})
    _verls_balance(trainer, expected, {})
    assert torch.equal(uneven.batch["input_ids"], expected.batch["input_ids"])
    assert "cannot fill 2 equal data-parallel chunks" in caplog.text


# ---------------------------------------------------------------------------------------------
# Pipeline (and virtual pipeline) and context parallelism inside verl's engine
# ---------------------------------------------------------------------------------------------

# name: (world size, the engines' layout, the reference's layout, HF layers, transformer config
# overrides of every engine). Reference None: verl's stock engine at the same layout (it runs PP on
# the CPU); a layout: the tree engine there at CP=1 (verl's stock CP needs transformer-engine:
# "Context parallelism is only supported by TEDotProductAttention!"), the rest of the world data
# parallel on the same batch. Under VPP, micro-batch groups of 4 (verl's 4 micro-batches; the tree
# schedule's calls hold 2).
LAYOUTS = {
    "pp2": (2, {"pp": 2}, None, 2, {}),
    "pp2-vpp2": (2, {"pp": 2, "vpp": 2}, None, 4, {"microbatch_group_size_per_vp_stage": 4}),
    "cp2": (2, {"cp": 2}, {}, 2, {}),
    "cp2-tp2": (4, {"cp": 2, "tp": 2}, {"tp": 2}, 2, {}),
}
# Tree capacities on the batch of _layout_worker (2 prompts of 20-27 tokens x 4 samples): 64 holds a
# prompt group (whole trees of 64 and 48 rows); 32 holds none, so each prompt runs as a trunk part
# computed once (trunk reuse), its samples in branch micro-batches (rows 16, 32, 32, 32). Trees of
# different lengths: the pipeline runs them unpadded where its stages exchange shapes.
WHOLE_TREES, TRUNK_PARTS = 64, 32


def _layout_worker(
    rank: int,
    path: str,
    parallel: dict,
    reference: dict | None,
    overrides: dict,
    vanilla_mbridge: bool,
) -> dict:
    """verl's ``infer_batch`` and ``train_batch`` (its ppo_loss) on one GRPO batch (2 prompts x 4
    samples) through the reference engine and the tree engine at ``parallel``, with whole trees and
    with trunk reuse; at CP=2 also in verl's per-token mode (``calculate_per_token_loss``). The
    optimizer's learning rate is 0, so one engine runs several packings on the same weights, and
    gradients are compared unclipped."""
    from functools import partial

    from harness import verl as harness
    from harness.models import hf_logprobs

    harness.setup_cpu()
    from megatron.core import parallel_state as mpu
    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    padded, seqs = harness.rollout_batch(
        _vocab(path), prompts=2, samples=4, prompt_tokens=(20, 28), seed=2
    )
    hf = hf_logprobs(path, seqs)
    # Old log-probs: HF's, the same on every rank and for every engine, in verl's response layout.
    rolled = [torch.cat([hf[i], hf[i].new_zeros(1)]) for i in range(len(seqs))]
    old = no_padding_2_padding(
        torch.nested.as_nested_tensor(rolled, layout=torch.jagged), harness.engine_batch(padded)
    ).float()
    advantages = (
        torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * padded["response_mask"]
    )
    config = McoreActorConfig(
        strategy="megatron",
        rollout_n=4,
        ppo_mini_batch_size=len(seqs),
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
    )

    def build(vendor, layout, per_token: bool = False):
        # Gradients not clipped (a uniform scale error would hide in both clipped to one norm).
        return harness.build_engine(
            path,
            vendor=vendor,
            lr=0.0,
            clip_grad=1e9,
            parallel=layout,
            vanilla_mbridge=vanilla_mbridge,
            use_remove_padding=per_token,  # verl's per-token protocol refuses its BSHD path
            override_transformer_config=dict(overrides, calculate_per_token_loss=per_token),
        )[0]

    def run(engine, max_tokens: int | None = None) -> dict:
        budget = {}
        if max_tokens is not None:
            # The tree engine's capacity from verl's token budget, which holds per GPU: a tree of
            # max_tokens rows spans the CP ranks.
            engine.tree_max_tokens = None
            budget["max_token_len_per_gpu"] = max_tokens // mpu.get_context_parallel_world_size()
        with engine.eval_mode():
            output = engine.infer_batch(
                harness.engine_batch(padded, calculate_entropy=True, **budget)
            )
        train = harness.engine_batch(
            dict(padded, old_log_probs=old, advantages=advantages),
            global_batch_size=len(seqs),
            calculate_entropy=False,
            **budget,
        )
        with engine.train_mode():
            result = engine.train_batch(train, loss_function=partial(ppo_loss, config=config))
            grads = harness.engine_grads(engine)
        model_output = output.get("model_output")  # verl's engines: the last stage's ranks only
        return {
            "log_probs": None
            if model_output is None
            else [t.clone() for t in model_output["log_probs"].unbind()],
            "entropy": None
            if model_output is None
            else [t.clone() for t in model_output["entropy"].unbind()],
            "loss": float(sum(result["loss"])) if "loss" in result else None,
            "grads": grads,
            "stats": dict(engine.tree_stats) if getattr(engine, "tree_stats", None) else None,
        }

    out = {"hf": hf}
    if reference is None:
        out["reference"] = run(build(None, parallel))
    else:
        engine = build("megatron_tree", reference)
        out["reference"] = run(engine, WHOLE_TREES)
        harness.reset_model_parallel()
    tree = build("megatron_tree", parallel)
    out["engine"] = type(tree).__name__
    out["bridge"] = type(tree.bridge).__module__
    out["layout"] = {
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "vpp": len(tree.module),
        "cp": mpu.get_context_parallel_world_size(),
    }
    out["overrides"] = {k: getattr(tree.tf_config, k) for k in overrides}
    out["trees"] = run(tree, WHOLE_TREES)
    out["trunks"] = run(tree, TRUNK_PARTS)
    if parallel == {"cp": 2}:  # verl's per-token protocol (its CP setting), on CP alone
        harness.reset_model_parallel()
        tree = build("megatron_tree", parallel, per_token=True)
        out["per_token_config"] = bool(tree.tf_config.calculate_per_token_loss)
        out["per-token"] = run(tree, TRUNK_PARTS)
    return out


def _check_layout_run(run: dict, reference: dict, hf: dict) -> dict:
    """One tree run against the reference (and HF) on one rank; returns the measured errors."""
    errors = {}
    assert (run["log_probs"] is None) == (reference["log_probs"] is None)
    if reference["log_probs"] is not None:
        # The last entry predicts nothing (verl's loss mask excludes it).
        from megatron_tree.testing.tolerances import max_abs_error, worst_error

        errors["logp"] = worst_error(
            max_abs_error(got[:-1], want[:-1])
            for got, want in zip(run["log_probs"], reference["log_probs"])
        )
        errors["logp_hf"] = worst_error(
            max_abs_error(run["log_probs"][i][:-1], want) for i, want in hf.items()
        )
        errors["entropy"] = worst_error(
            max_abs_error(got, want) for got, want in zip(run["entropy"], reference["entropy"])
        )
        assert worst_error([errors["logp"], errors["logp_hf"], errors["entropy"]]) <= LOGP_TOL, (
            errors
        )
        errors["loss"] = abs(run["loss"] - reference["loss"]) / abs(reference["loss"])
        assert errors["loss"] <= LOSS_RTOL, errors
    _check_gradients(run["grads"], reference["grads"])
    errors["grad"] = max(gradient_errors(run["grads"], reference["grads"]).values())
    return errors


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tree_engine_parallel_layouts(tmp_path, layout):
    """The tree engine under pipeline (PP=2, PP=2 x VPP=2) and context parallelism (CP=2,
    CP=2 x TP=2), with whole trees and with trunk reuse, against verl's stock engine at the same
    layout (PP) or the tree engine at CP=1 (CP), and HF: log-probs, entropy, loss and every rank's
    gradients. verl's model path: Megatron-Bridge where it is installed, mbridge otherwise."""
    from harness.models import make_hf_checkpoint

    world, parallel, reference, layers, overrides = LAYOUTS[layout]
    path = str(tmp_path / "qwen3")
    make_hf_checkpoint("qwen3", path, num_hidden_layers=layers)
    vanilla_mbridge = not installed("megatron.bridge")
    ranks = run_spawned(
        _layout_worker, world, path, parallel, reference, overrides, vanilla_mbridge, megatron=False
    )
    runs = ["trees", "trunks"] + (["per-token"] if parallel == {"cp": 2} else [])
    worst = {}
    for out in ranks:
        assert out["engine"] == "TreeMegatronEngineWithLMHead"
        assert out["layout"] == {"tp": 1, "pp": 1, "vpp": 1, "cp": 1, **parallel}, out["layout"]
        assert out["bridge"].startswith("mbridge" if vanilla_mbridge else "megatron.bridge")
        assert out["overrides"] == overrides
        if "per-token" in runs:
            assert out["per_token_config"] is True
        for name in runs:
            run, stats = out[name], out[name]["stats"]
            assert stats["trunk_groups"] == (0 if name == "trees" else 2), stats
            # Trees padded to the capacity only under the virtual pipeline (constant shapes).
            capacity = WHOLE_TREES if name == "trees" else TRUNK_PARTS
            padded = stats["tokens_computed"] == stats["micro_batches"] * capacity
            assert padded == ("vpp" in parallel), stats
            for key, value in _check_layout_run(run, out["reference"], out["hf"]).items():
                worst[(name, key)] = max(worst.get((name, key), 0.0), value)
    # verl's engines return outputs on the last pipeline stage only (ranks world / 2 .. at PP=2).
    with_outputs = [r for r, out in enumerate(ranks) if out["trees"]["log_probs"] is not None]
    assert with_outputs == list(range(world // 2 if "pp" in parallel else 0, world))
    print(f"{layout} ({'mbridge' if vanilla_mbridge else 'Megatron-Bridge'}):", worst)


def test_dynamic_context_parallel_is_refused():
    """verl's dynamic CP schedules its own micro-batches per DPxCP rank, in place of the trees:
    refused with the fix (the tree engine splits trees over verl's static CP ranks)."""
    from types import SimpleNamespace

    from verl.utils import tensordict_utils as tu

    from megatron_tree.integrations.verl import TreeMegatronEngineWithLMHead

    engine = SimpleNamespace(
        engine_config=SimpleNamespace(dynamic_context_parallel=True), enable_routing_replay=False
    )
    data = tu.get_tensordict({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match="dynamic_context_parallel=True.*set dynamic_context_par"):
        TreeMegatronEngineWithLMHead._check_supported(engine, data)


@ONE_VERL_STACK
@pytest.mark.parametrize("vendor", ["megatron_tree", None])
def test_trainer_balancing_without_a_launcher_edit(vendor):
    """A fresh process as verl's ``TaskRunner``: ``import verl`` (its plugins), then verl's trainer
    module. With ``VERL_ENGINE_VENDOR=megatron_tree`` its ``_balance_batch`` keeps every prompt
    group (uid) on one data-parallel rank with nobody calling ``patch_trainer_balancing`` (one log
    line says so); without the vendor it is verl's own, which splits groups."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "VERL_ENGINE_VENDOR"}
    if vendor:
        env["VERL_ENGINE_VENDOR"] = vendor
    tests = os.path.dirname(os.path.abspath(__file__))  # the harness is not installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    code = (
        "import json\nfrom harness.verl import balance_with_verls_trainer\n"
        "print('RESULT', json.dumps(balance_with_verls_trainer()))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    spread = {dp: sum(len(groups) for groups in result[str(dp)]) for dp in (2, 4)}
    line = "keeps prompt groups on one data-parallel rank (VERL_ENGINE_VENDOR=megatron_tree"
    if vendor:
        assert result["megatron_tree"] and spread == {2: 8, 4: 8}, result  # each group on one rank
        assert run.stderr.count(line) == 1, run.stderr[-3000:]
    else:
        assert not result["megatron_tree"] and min(spread.values()) > 8, result  # verl splits
        assert line not in run.stderr


# ---------------------------------------------------------------------------------------------
# Routing replay (verl's router_replay R2 and R3) under expert parallelism
# ---------------------------------------------------------------------------------------------

ROUTE_KEY = "routed_experts"  # verl's per-token routes


def _rollout_routes(seqs: list, prompt_lengths: list, *, layers: int, experts: int, topk: int):
    """Routes a rollout engine would record for ``seqs``: per sample [n - 1, layers, topk] (none for
    the last token), distinct experts per token drawn at random, so that they differ from the
    model's own choice; the samples of a prompt agree on the prompt's tokens, except sample 1 of
    the first prompt, whose route at prompt token 5 differs (there the samples may not share a
    tree position)."""
    g = torch.Generator().manual_seed(7)

    def draw(n):
        return torch.rand(n, layers, experts, generator=g).argsort(-1)[..., :topk].to(torch.int16)

    routes, prompt_routes = [], {}
    for i, (seq, p) in enumerate(zip(seqs, prompt_lengths)):
        key = tuple(seq[:p].tolist())
        if key not in prompt_routes:
            prompt_routes[key] = draw(p)
        mine = torch.cat([prompt_routes[key], draw(len(seq) - 1 - p)])
        if i == 1:
            mine = mine.clone()
            mine[5] = mine[5].flip(-1) if topk > 1 else (mine[5] + 1) % experts
        routes.append(mine)
    return routes


def _replay_worker(
    rank: int,
    path: str,
    mode: str,
    parallel: dict,
    data_parallel: int,
    reference: dict | None,
    vanilla_mbridge: bool,
) -> dict:
    """verl's ``infer_batch`` then ``train_batch`` (its ppo_loss) with verl's routing replay of
    ``mode`` through verl's stock engine and the tree engine (whole trees, then trunk reuse), each
    data-parallel rank on its own GRPO batch (2 prompts of 20-27 tokens x 4 samples).

    R2: the old-log-prob pass records the routes (returned per sample in verl's layout); the
    training step replays routes that are not the model's own choice (drawn at random, as a
    recording made before an optimizer step differs from the model after it), so a replay that is
    silently ignored changes the loss. R3: both passes replay the rollout's routes (drawn at
    random; none for a sample's last token, which routes natively), one sample of a prompt
    disagreeing with the others at one prompt token."""
    from functools import partial

    from harness import verl as harness

    harness.setup_cpu()
    from transformers import AutoConfig
    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    hf = AutoConfig.from_pretrained(path)
    # 2 prompts of 20-27 tokens x 4 samples, every sequence 36 tokens long (see the test)
    g = torch.Generator().manual_seed(2 + rank % data_parallel)
    pairs = []
    for _ in range(2):
        prompt = torch.randint(
            1, hf.vocab_size, (int(torch.randint(20, 28, (1,), generator=g)),), generator=g
        )
        pairs += [
            (prompt, torch.randint(1, hf.vocab_size, (36 - len(prompt),), generator=g))
            for _ in range(4)
        ]
    padded, seqs = harness.rollout_layout(pairs)
    prompt_lengths = [len(p) for p, _ in pairs]
    routes = _rollout_routes(
        seqs,
        prompt_lengths,
        layers=hf.num_hidden_layers,
        experts=hf.num_experts,
        topk=hf.num_experts_per_tok,
    )
    if mode == "R2":  # one route per token, as verl's record pass gives them
        routes = [torch.cat([r, r[-1:]]) for r in routes]
    routes = torch.nested.as_nested_tensor(routes, layout=torch.jagged)
    # old log-probs near the model's (a uniform guess over the vocabulary): PPO ratios near 1
    old = torch.full(padded["responses"].shape, -math.log(hf.vocab_size))
    advantages = (
        torch.randn(old.shape, generator=torch.Generator().manual_seed(1 + rank % data_parallel))
        * padded["response_mask"]
    )
    config = McoreActorConfig(
        strategy="megatron",
        rollout_n=4,
        ppo_mini_batch_size=len(seqs),
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
    )

    def run(engine, replay: bool = True) -> dict:
        infer = harness.engine_batch(
            padded, 1, calculate_entropy=True, enable_routing_replay=replay
        )
        if mode == "R3" and replay:
            infer[ROUTE_KEY] = routes
        with engine.eval_mode():
            output = engine.infer_batch(infer).get("model_output", {})
        train = harness.engine_batch(
            dict(padded, old_log_probs=old, advantages=advantages),
            1,
            global_batch_size=len(seqs),
            enable_routing_replay=replay,
        )
        if replay:
            train[ROUTE_KEY] = routes
        with engine.train_mode():
            result = engine.train_batch(train, loss_function=partial(ppo_loss, config=config))
            grads = harness.engine_grads(engine)
        recorded, log_probs = output.get(ROUTE_KEY), output.get("log_probs")  # last stage only
        return {
            "log_probs": None if log_probs is None else [t.clone() for t in log_probs.unbind()],
            "routes": None if recorded is None else [t.clone() for t in recorded.unbind()],
            "loss": float(sum(result["loss"])) if "loss" in result else None,
            "grads": grads,
            "stats": dict(engine.tree_stats) if getattr(engine, "tree_stats", None) else None,
        }

    def build(vendor, layout):
        return harness.build_engine(
            path,
            vendor=vendor,
            lr=0.0,
            clip_grad=1e9,
            parallel=layout,
            vanilla_mbridge=vanilla_mbridge,
            router_replay=mode,
            micro_batch_size=1,
        )[0]

    if reference is None:  # verl's stock engine at the same layout
        out = {"reference": run(build(None, parallel))}
    else:  # the tree engine at the reference layout (the rest of the world data parallel)
        out = {"reference": run(build("megatron_tree", reference))}
        harness.reset_model_parallel()
    tree = build("megatron_tree", parallel)
    out["engine"] = type(tree).__name__
    out["bridge"] = type(tree.bridge).__module__
    out["sequence_parallel"] = tree.tf_config.sequence_parallel
    out["trees"] = run(tree)
    tree.tree_max_tokens = TRUNK_PARTS  # no prompt group fits: trunk reuse
    out["trunks"] = run(tree)
    out["native"] = run(tree, replay=False)  # the model's own routes: the replay changes results
    return out


# name: (the engines' layout, data-parallel size, the reference's layout); 2 ranks each. Reference
# None: verl's stock engine at the same layout; a layout: the tree engine there (verl's stock CP
# needs transformer-engine), the rest of the world data parallel on the same batch.
REPLAY_LAYOUTS = {
    "ep2": ({"ep": 2}, 2, None),
    "pp2": ({"pp": 2}, 1, None),
    "cp2": ({"cp": 2}, 1, {}),
    "pp2-vpp2": ({"pp": 2, "vpp": 2}, 1, None),
    "tp2-sp": ({"tp": 2, "sp": True}, 1, None),
}
# The replay is the tree engine's (the same code on both verl stacks); the bridge only builds the
# model. So the verl stack (mbridge) runs every layout, and the verl + Megatron-Bridge stack the two
# whose models the bridge builds differently: experts split over ranks, and one model chunk per
# virtual stage (saves 6 of its 10 two-rank worlds, ~50 s).
REPLAY_LAYOUTS_HERE = (
    ["ep2", "pp2-vpp2"]
    if installed("megatron.bridge") and installed("verl")
    else list(REPLAY_LAYOUTS)
)


@pytest.mark.parametrize("layout", REPLAY_LAYOUTS_HERE)
@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_routing_replay(tmp_path, mode, layout):
    """verl's routing replay in the tree engine at EP=2 (two data-parallel ranks, each holding 2 of
    the 4 experts of a tiny Qwen3-MoE, each on its own batch), at PP=2 (one MoE layer per stage),
    at PP=2 x VPP=2 (4 layers: one per model chunk, each chunk recording its own routers), at TP=2
    with sequence parallelism (each TP rank's routers see its shard of the rows; the record pass
    gathers them) and at CP=2 (each rank records its rows' routes), whole trees and trunk reuse,
    against verl's stock engine at the same layout (EP, PP, VPP, SP) or the tree engine at CP=1
    (CP), on the same batches:
    log-probs and loss (on the last stage), every rank's gradients; R2's recorded routes (gathered
    over the stages by verl's bookkeeping) equal the reference's per token. verl's model path:
    Megatron-Bridge where it is installed, mbridge otherwise.

    verl's stock engine runs its BSHD path on a CPU (its THD path needs transformer-engine's
    attention), but lays the routes it replays and records out in THD order: they line up with the
    model's rows only for one sample per micro-batch and no padding. Elsewhere it replays routes
    on the wrong tokens (tried: micro-batches of 2 samples, loss 0.034 against 0.190 for the tree
    engine and for the stock engine at one sample) or, under R3, refuses ("Router replay tensors
    are not aligned": BSHD pads every sample to the batch's longest). So the reference runs one
    sample per micro-batch, and every sequence of the batch has the same length."""
    from harness.models import make_hf_checkpoint

    parallel, data_parallel, reference = REPLAY_LAYOUTS[layout]
    path = str(tmp_path / "qwen3_moe")
    layers = 4 if "vpp" in parallel else 2  # one MoE layer per model chunk
    make_hf_checkpoint("qwen3_moe", path, num_hidden_layers=layers)
    vanilla_mbridge = not installed("megatron.bridge")
    ranks = run_spawned(
        _replay_worker,
        2,
        path,
        mode,
        parallel,
        data_parallel,
        reference,
        vanilla_mbridge,
        megatron=False,
    )
    # verl's engines return outputs on the last pipeline stage only
    assert [out["reference"]["loss"] is not None for out in ranks] == (
        [False, True] if "pp" in parallel else [True, True]
    )
    worst = {}
    for out in ranks:
        assert out["engine"] == "TreeMegatronEngineWithLMHead"
        assert out["bridge"].startswith("mbridge" if vanilla_mbridge else "megatron.bridge")
        assert out["sequence_parallel"] == parallel.get("sp", False)
        stock, native = out["reference"], out["native"]
        last_stage = stock["loss"] is not None
        if last_stage:  # the replayed routes are not the model's own
            if mode == "R3":  # the old log-probs replay the rollout's routes
                assert (
                    max(
                        float((a[:-1] - b[:-1]).abs().max())
                        for a, b in zip(native["log_probs"], stock["log_probs"])
                    )
                    > 1e-3
                )
            assert abs(native["loss"] - stock["loss"]) > 1e-3 * abs(stock["loss"])
        for name in ("trees", "trunks"):
            run, stats = out[name], out[name]["stats"]
            assert (stats["trunk_groups"] > 0) == (name == "trunks"), stats
            _check_gradients(run["grads"], stock["grads"])
            errors = {"grad": max(gradient_errors(run["grads"], stock["grads"]).values())}
            assert (run["loss"] is None) == (not last_stage)
            if last_stage:
                from megatron_tree.testing.tolerances import max_abs_error, worst_error

                errors["logp"] = worst_error(
                    max_abs_error(got[:-1], want[:-1])
                    for got, want in zip(run["log_probs"], stock["log_probs"])
                )
                errors["loss"] = abs(run["loss"] - stock["loss"]) / abs(stock["loss"])
                assert errors["logp"] <= LOGP_TOL and errors["loss"] <= LOSS_RTOL, errors
            if mode == "R2" and last_stage:
                assert [r.shape for r in run["routes"]] == [
                    (len(lp), layers, 2) for lp in stock["log_probs"]
                ]
                assert all(
                    torch.equal(got, want) for got, want in zip(run["routes"], stock["routes"])
                )
            else:
                assert run["routes"] is None and stock["routes"] is None
            for key, value in errors.items():
                worst[(name, key)] = max(worst.get((name, key), 0.0), value)
    path_name = "mbridge" if vanilla_mbridge else "Megatron-Bridge"
    print(f"routing replay {mode} at {layout} ({path_name}):", worst)


# ---------------------------------------------------------------------------------------------
# The critic under pipeline parallelism
# ---------------------------------------------------------------------------------------------


def _critic_pipeline_worker(rank: int, path: str, vanilla_mbridge: bool) -> dict:
    """verl's value engine at PP=2: ``infer_batch`` (values) and ``train_batch`` (verl's
    value_loss) on one GRPO batch (2 prompts of 20-27 tokens x 4 samples) through verl's stock
    engine and the tree engine, with whole trees and with trunk reuse. Learning rate 0 (one tree
    engine runs both packings on the same weights), gradients unclipped."""
    from functools import partial

    from harness import verl as harness

    harness.setup_cpu()
    from verl.workers.config.critic import McoreCriticConfig
    from verl.workers.utils.losses import value_loss

    padded, seqs = harness.rollout_batch(
        _vocab(path), prompts=2, samples=4, prompt_tokens=(20, 28), seed=2
    )
    g = torch.Generator().manual_seed(2)
    mask = padded["response_mask"]
    extra = {
        "values": torch.randn(mask.shape, generator=g) * mask,
        "returns": torch.randn(mask.shape, generator=g) * mask,
    }
    config = McoreCriticConfig(
        strategy="megatron",
        rollout_n=4,
        ppo_mini_batch_size=len(seqs),
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
    )

    def run(engine) -> dict:
        with engine.eval_mode():
            output = engine.infer_batch(harness.engine_batch(padded))
        train = harness.engine_batch(dict(padded, **extra), global_batch_size=len(seqs))
        with engine.train_mode():
            result = engine.train_batch(train, loss_function=partial(value_loss, config=config))
            grads = harness.engine_grads(engine)
        values = output.get("model_output", {}).get("values")  # the last stage's ranks only
        return {
            "values": None if values is None else [t.clone() for t in values.unbind()],
            "loss": float(sum(result["loss"])) if "loss" in result else None,
            "grads": grads,
            "stats": dict(engine.tree_stats) if getattr(engine, "tree_stats", None) else None,
        }

    def build(vendor):
        return harness.build_engine(
            path,
            vendor=vendor,
            model_type="value_model",
            lr=0.0,
            clip_grad=1e9,
            parallel={"pp": 2},
            vanilla_mbridge=vanilla_mbridge,
        )[0]

    out = {"stock": run(build(None))}
    tree = build("megatron_tree")
    out["engine"] = type(tree).__name__
    out["bridge"] = type(tree.bridge).__module__
    tree.tree_max_tokens = WHOLE_TREES
    out["trees"] = run(tree)
    tree.tree_max_tokens = TRUNK_PARTS
    out["trunks"] = run(tree)
    return out


def test_tree_critic_under_pipeline_parallelism(tmp_path):
    """The value engine (verl's critic) at PP=2, whole trees and trunk reuse, against verl's stock
    value engine at PP=2: values and loss on the last stage, both stages' gradients. verl's model
    path: Megatron-Bridge where it is installed, mbridge otherwise."""
    from harness.models import make_hf_checkpoint

    path = str(tmp_path / "qwen3")
    make_hf_checkpoint("qwen3", path)
    vanilla_mbridge = not installed("megatron.bridge")
    ranks = run_spawned(_critic_pipeline_worker, 2, path, vanilla_mbridge, megatron=False)
    worst = {}
    for rank, out in enumerate(ranks):
        assert out["engine"] == "TreeMegatronEngineWithValueHead"
        assert out["bridge"].startswith("mbridge" if vanilla_mbridge else "megatron.bridge")
        stock = out["stock"]
        assert (stock["values"] is not None) == (rank == 1)  # outputs on the last stage
        for name in ("trees", "trunks"):
            run = out[name]
            assert (run["stats"]["trunk_groups"] > 0) == (name == "trunks"), run["stats"]
            assert (run["values"] is None) == (stock["values"] is None)
            if stock["values"] is not None:
                from megatron_tree.testing.tolerances import max_abs_error, worst_error

                errors = {
                    "values": worst_error(
                        max_abs_error(got, want)
                        for got, want in zip(run["values"], stock["values"])
                    ),
                    "loss": abs(run["loss"] - stock["loss"]) / abs(stock["loss"]),
                }
                assert all(
                    got.shape == want.shape for got, want in zip(run["values"], stock["values"])
                )
                assert errors["values"] <= LOGP_TOL and errors["loss"] <= LOSS_RTOL, errors
                for key, value in errors.items():
                    worst[(name, key)] = max(worst.get((name, key), 0.0), value)
            _check_gradients(run["grads"], stock["grads"])
            grad = max(gradient_errors(run["grads"], stock["grads"]).values())
            worst[(name, "grad")] = max(worst.get((name, "grad"), 0.0), grad)
    print(f"critic at PP=2 ({'mbridge' if vanilla_mbridge else 'Megatron-Bridge'}):", worst)


def test_routes_to_replay_per_sample():
    """verl's ``routed_experts`` as the tree engine replays them, per sample [n, layers, topk]: R2's
    table of the MoE layers only is spread to their layer numbers (-1 on dense layers, which never
    read it); R3's rollout routes (none for the last token) replay all but the last token, which
    routes natively (-1), and nothing for a sample without response tokens; R2's old-log-prob pass
    without routes records (None); routes of the wrong length are refused."""
    from types import SimpleNamespace

    from verl.utils import tensordict_utils as tu

    from megatron_tree.integrations.verl import TreeMegatronEngineWithLMHead

    def engine(mode):
        return SimpleNamespace(
            engine_config=SimpleNamespace(router_replay=SimpleNamespace(mode=mode)),
            tf_config=SimpleNamespace(num_layers=4, moe_layer_freq=[0, 1, 0, 1]),
        )

    def batch(routes, responses, lengths=(3, 4)):
        ids = [torch.arange(1, n + 1) for n in lengths]
        data = tu.get_tensordict(
            {
                "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
                "response_mask": torch.tensor([[1] * r + [0] * (2 - r) for r in responses]),
            }
        )
        if routes is not None:
            data[ROUTE_KEY] = torch.nested.as_nested_tensor(routes, layout=torch.jagged)
        tu.assign_non_tensor(data, enable_routing_replay=True)
        return data

    def replay(mode, data, forward_only=False):
        return TreeMegatronEngineWithLMHead._routes_to_replay(engine(mode), data, forward_only)

    moe_only = [torch.full((n, 2, 2), 3, dtype=torch.int16) for n in (3, 4)]
    r2 = replay("R2", batch(moe_only, (2, 2))).unbind()
    assert [tuple(r.shape) for r in r2] == [(3, 4, 2), (4, 4, 2)]
    assert all(bool((r[:, [1, 3]] == 3).all() and (r[:, [0, 2]] == -1).all()) for r in r2)
    rollout = [torch.full((n - 1, 4, 2), 2, dtype=torch.int16) for n in (3, 4)]
    first, second = replay("R3", batch(rollout, (2, 0))).unbind()
    assert bool((first[:2] == 2).all() and (first[2] == -1).all())
    assert bool((second == -1).all())  # no response tokens: nothing replayed
    assert replay("R2", batch(None, (2, 2)), forward_only=True) is None
    assert replay("disabled", batch(rollout, (2, 2))) is None
    with pytest.raises(ValueError, match="sample 1 has 2 routes for 4 tokens"):
        replay("R3", batch([rollout[0], rollout[1][:2]], (2, 2)))
    with pytest.raises(ValueError, match="holds routes of 3 layers; the model has 4 layers, 2"):
        replay("R2", batch([torch.zeros(n, 3, 2, dtype=torch.int16) for n in (3, 4)], (2, 2)))
    with pytest.raises(ValueError, match="R2 records it in compute_log_prob"):
        replay("R3", batch(None, (2, 2)), forward_only=True)
