"""Mixture-of-experts models with trees: the spec rewrite leaves the MoE MLP alone, and the tree
step of a local-spec MoE GPT (4 experts, top-2, allgather and alltoall dispatchers) equals the
unpacked per-sequence step at EP=1, EP=2 and EP=2 x TP=2 (sequence parallel, expert TP 1).

Token-choice routing without a capacity factor routes every token on its own hidden state, which
is the same in a tree as in the sequence alone, so log-probs, the main loss and its gradients are
exactly those of the unpacked batch (up to fp32 summation order). The load-balancing loss and the
z-loss are means over the tokens of a micro-batch, which a tree counts differently; they are off
here (``moe_aux_loss_coeff=0``, no z-loss), and their tree-exact version is issue 11 part 3.

The reference is Megatron's stock GPTModel (causal attention, positions 0..L-1) on each sequence
alone at EP=1; expert-parallel runs load the EP=1 weights (local expert ``i`` on EP rank ``r`` is
global expert ``i + r * num_local_experts``) and their gradients are compared per global expert.
"""

from __future__ import annotations

import types

import pytest
import torch

from harness.dist import run_spawned
from harness.models import (
    VOCAB,
    branching_sequences,
    build_gpt_model,
    global_expert_name,
    long_context_sequences,
    moe_layer_spec,
    recompute_fields,
    small_moe_config,
)
from megatron_tree.core.losses import ppo_clipped_loss
from megatron_tree.testing.reference import (
    gradient_errors,
    parameter_grads,
    unpacked_reference_step,
)
from megatron_tree.testing.synthetic import rl_batch
from megatron_tree.testing.tolerances import GRAD_RTOL, LOGP_TOL, LOSS_RTOL

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU suite; run with CUDA_VISIBLE_DEVICES= on CUDA machines"
)

DISPATCHERS = ("allgather", "alltoall")


def _batch() -> dict:
    return rl_batch(branching_sequences(), response_start=5)


def _loss_fn(outputs, mb):
    return ppo_clipped_loss(outputs, mb, clip_eps=0.2, entropy_coef=0.01)


def _reference_logprobs(model, batch: dict) -> torch.Tensor:
    """[B, L] next-token log-probs of the stock model on each sequence alone (0 past the end)."""
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for i, n in enumerate(batch["attention_mask"].sum(1).tolist()):
            seq = batch["input_ids"][i, :n]
            logp = torch.log_softmax(
                model(seq[None], torch.arange(n)[None], attention_mask=None)[0].double(), -1
            )
            out[i, : n - 1] = logp[torch.arange(n - 1), seq[1:]].float()
    return out


def _tree_step(model, batch, **kwargs):
    from megatron.core import parallel_state as ps

    from megatron_tree.mcore.step import tree_forward_backward

    packing = dict(max_tokens_per_mb=64, block_size=16) if isinstance(batch, dict) else {}
    return tree_forward_backward(
        model,
        batch,
        _loss_fn,
        collect_outputs=True,
        tp_group=ps.get_tensor_model_parallel_group(),
        **{**packing, **kwargs},
    )


def _logprob_err(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> float:
    """Max |got - want| over the next-token log-probs [B, L - 1] that ``mask`` marks."""
    width = mask.shape[1]
    return float(((got[:, :width].float() - want[:, :width]).abs() * mask).max())


# ----------------------------------------------------------------------------- the spec rewrite


def _structure(obj):
    """A comparable form of a spec: ModuleSpec, functools.partial (megatron-core 0.19 builds MoE
    MLP specs with partial, which compares by identity) and dataclasses, recursively."""
    import dataclasses
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(obj, ModuleSpec):
        return ("spec", obj.module, _structure(obj.params), _structure(obj.submodules))
    if isinstance(obj, functools.partial):
        return ("partial", obj.func, _structure(obj.args), _structure(obj.keywords))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (
            type(obj),
            tuple((f.name, _structure(getattr(obj, f.name))) for f in dataclasses.fields(obj)),
        )
    if isinstance(obj, dict):
        return tuple(sorted((k, _structure(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_structure(v) for v in obj)
    from megatron.core.tensor_parallel import RowParallelLinear

    from megatron_tree.mcore.moe import ExpertRowParallelLinear

    # The rewrite's one change inside the experts: their second projection copies a biased output.
    return RowParallelLinear if obj is ExpertRowParallelLinear else obj


def _module_class(spec):
    return spec.func if hasattr(spec, "func") else spec.module


def _mlp_structure(mlp):
    """``_structure`` of an MLP spec with an MoELayer subclass (the rewrite may put in
    ``megatron_tree.mcore.moe.TreeMoELayer``, which changes only how the router losses weigh
    tokens) written as MoELayer: what must stay is the router, experts, shared experts, params."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    kind, cls, *rest = _structure(mlp)
    return (kind, MoELayer if isinstance(cls, type) and issubclass(cls, MoELayer) else cls, *rest)


def _without_core_attention(layer_spec):
    """The layer spec's submodules with self-attention's core attention and mask type blanked."""
    import copy

    subs = copy.deepcopy(layer_spec.submodules)
    subs.self_attention.submodules.core_attention = None
    subs.self_attention.params = {
        k: v for k, v in subs.self_attention.params.items() if k != "attn_mask_type"
    }
    subs.mlp = None  # compared by _mlp_structure
    return _structure(subs)


def test_spec_rewrite_leaves_the_moe_mlp_alone():
    """Layer and block specs: only core attention and the mask type change (and the MoE layer class
    may become a subclass, see ``_mlp_structure``); the MoE MLP's router, experts and shared experts
    compare equal, field by field, to the original's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tree.mcore.core_attention import TreeCoreAttention
    from megatron_tree.mcore.spec import tree_attention_spec

    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_layer_freq=[1, 0, 1, 1],
        moe_shared_expert_intermediate_size=32,
        moe_ffn_hidden_size=32,
    )
    for spec in (
        moe_layer_spec(config),
        get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0),
    ):
        layers = getattr(spec, "layer_specs", [spec])
        rewritten = tree_attention_spec(spec)
        new_layers = getattr(rewritten, "layer_specs", [rewritten])
        assert sum(_module_class(layer.submodules.mlp) is MoELayer for layer in layers) == len(
            layers
        ) - (len(layers) > 1)
        for old, new in zip(layers, new_layers):
            assert (
                new.submodules.self_attention.submodules.core_attention.module is TreeCoreAttention
            )
            assert _mlp_structure(new.submodules.mlp) == _mlp_structure(old.submodules.mlp)
            assert _without_core_attention(new) == _without_core_attention(old)


def test_spec_rewrite_leaves_the_te_moe_mlp_alone():
    pytest.importorskip("transformer_engine")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_tree.mcore.spec import tree_attention_spec

    te = get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True)
    rewritten = tree_attention_spec(te)
    assert _mlp_structure(rewritten.submodules.mlp) == _mlp_structure(te.submodules.mlp)
    assert _without_core_attention(rewritten) == _without_core_attention(te)


# ----------------------------------------------------------------------------- EP = 1, in process


@pytest.fixture(scope="module")
def ep1(world, tmp_path_factory):
    """The EP=1 results every parallel layout is compared with: the unpacked reference (loss,
    gradients, log-probs) and the tree step per dispatcher, plus the weights on disk."""
    batch = _batch()
    reference = build_gpt_model(small_moe_config(), tree=False, vocab_size=VOCAB)
    want_loss = unpacked_reference_step(reference, batch, _loss_fn)
    out = {
        "loss": float(want_loss),
        "grads": parameter_grads(reference),
        "logprobs": _reference_logprobs(reference, batch),
        "state": str(tmp_path_factory.mktemp("moe") / "state.pt"),
    }
    torch.save(reference.state_dict(), out["state"])
    for dispatcher in DISPATCHERS:
        tree = build_gpt_model(
            small_moe_config(dispatcher=dispatcher),
            tree=True,
            vocab_size=VOCAB,
            backend="block_sparse",
            block_size=16,
        )
        tree.load_state_dict(reference.state_dict())
        result = _tree_step(tree, batch)
        out[dispatcher] = {
            "loss": float(result.loss),
            "grads": parameter_grads(tree),
            "trees": result.num_micro_batches,
            "logprobs": result.merged_outputs(max_seq_len=batch["input_ids"].shape[1])["logprobs"],
        }
    return out


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_moe_tree_step_equals_unpacked(ep1, dispatcher):
    got = ep1[dispatcher]
    assert got["trees"] > 1  # several trees: the micro-batch normalization is exercised
    assert got["loss"] == pytest.approx(ep1["loss"], rel=LOSS_RTOL)
    assert (
        _logprob_err(got["logprobs"], ep1["logprobs"], _batch()["attention_mask"][:, 1:])
        <= LOGP_TOL
    )
    errors = gradient_errors(got["grads"], ep1["grads"])
    assert any("local_experts" in n for n in errors) and any("router" in n for n in errors)
    assert max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])


# ----------------------------------------------------------------------------- expert parallelism


def _shard(full: torch.Tensor, local_shape: torch.Size, rank: int) -> torch.Tensor:
    """This tensor-parallel rank's slice of ``full`` (the one dimension whose size differs)."""
    if full.shape == local_shape:
        return full
    (dim,) = [d for d, (a, b) in enumerate(zip(full.shape, local_shape)) if a != b]
    return full.chunk(full.shape[dim] // local_shape[dim], dim=dim)[rank]


def _finalize_grads(model) -> None:
    """What Megatron DDP + finalize_model_grads do after the backward, on a model without DDP:
    sequence-parallel parameters (norms, router) summed over TP; dense gradients averaged over the
    data-parallel ranks; expert gradients (which already hold the tokens of every EP rank) summed
    over the expert-data-parallel ranks and divided by the data-parallel size."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    if model.config.sequence_parallel:
        ddp_like = types.SimpleNamespace(module=model, ddp_config=DistributedDataParallelConfig())
        _allreduce_non_tensor_model_parallel_grads(
            [ddp_like], model.config, ps.get_tensor_model_parallel_group()
        )
    dp = ps.get_data_parallel_world_size()
    for p in model.parameters():
        expert = not getattr(p, "allreduce", True)
        group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
        dist.all_reduce(p.grad, group=group)
        p.grad /= dp


def _ep_worker(rank: int, state_path: str) -> dict:
    """Both dispatchers at this world's layout; this rank's rows when data parallel."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    batch = _batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = torch.arange(batch["input_ids"].shape[0]).chunk(dp)[dp_rank]  # 8 + 7 sequences at DP=2
    local = {k: v[rows] for k, v in batch.items()}
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    full = torch.load(state_path)
    out = {"rows": rows, "layout": (tp, ep, dp)}
    for dispatcher in DISPATCHERS:
        config = small_moe_config(dispatcher=dispatcher, sequence_parallel=tp > 1)
        model = build_gpt_model(
            config, tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=16
        )
        per_rank = config.num_moe_experts // ep
        names = {
            n: global_expert_name(n, ep_rank=ep_rank, num_local_experts=per_rank)
            for n in model.state_dict()
        }
        model.load_state_dict(
            {
                n: _shard(full[names[n]], t.shape, tp_rank) if torch.is_tensor(t) else t
                for n, t in model.state_dict().items()
            }
        )
        # The allgather dispatcher all-gathers equal-sized token blocks over the EP ranks, so every
        # EP rank needs trees of one length (pad_to_max); the alltoall dispatcher sends any sizes.
        result = _tree_step(
            model,
            local,
            dp_group=ps.get_data_parallel_group(),
            parallel_size=tp,
            pad_to_max=dispatcher == "allgather",
        )
        _finalize_grads(model)
        loss = result.loss.clone()
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        out[dispatcher] = {
            "loss": float(loss),
            "trees": result.num_micro_batches,
            "logprobs": result.merged_outputs(max_seq_len=batch["input_ids"].shape[1])["logprobs"],
            "grads": {names[n]: (g, tp_rank) for n, g in parameter_grads(model).items()},
        }
    return out


def _check_against_ep1(ranks: list[dict], ep1: dict) -> None:
    mask = _batch()["attention_mask"][:, 1:]
    for r in ranks:
        for dispatcher in DISPATCHERS:
            got = r[dispatcher]
            for want in (ep1["logprobs"], ep1[dispatcher]["logprobs"]):
                rows = r["rows"]
                assert _logprob_err(got["logprobs"], want[rows], mask[rows]) <= LOGP_TOL, (
                    r["layout"],
                    dispatcher,
                )
            assert got["loss"] == pytest.approx(ep1["loss"], rel=LOSS_RTOL), (
                r["layout"],
                dispatcher,
            )
            for want in (ep1["grads"], ep1[dispatcher]["grads"]):
                sharded = {
                    n: _shard(want[n], g.shape, tp_rank) for n, (g, tp_rank) in got["grads"].items()
                }
                errors = gradient_errors({n: g for n, (g, _) in got["grads"].items()}, sharded)
                worst = max(errors.items(), key=lambda kv: kv[1])
                assert worst[1] <= GRAD_RTOL, (r["layout"], dispatcher, worst)
    # Together the EP ranks hold every expert of the EP=1 model, each with its gradient.
    experts = {n for r in ranks for n in r[DISPATCHERS[0]]["grads"] if "local_experts" in n}
    assert experts == {n for n in ep1["grads"] if "local_experts" in n}


def test_expert_parallel_2_equals_ep1(ep1):
    """EP=2 x DP=2 (TP=1): each rank holds 2 of the 4 experts and steps on its own 8 or 7
    sequences; tokens cross ranks to their experts and back."""
    ranks = run_spawned(_ep_worker, 2, ep1["state"], tp=1, ep=2)
    assert [r["layout"] for r in ranks] == [(1, 2, 2)] * 2
    _check_against_ep1(ranks, ep1)


def test_expert_parallel_2_with_tensor_parallel_2_equals_ep1(ep1):
    """TP=2 (sequence parallel, as Megatron requires for MoE training under TP) x EP=2 with expert
    TP 1: each rank routes its half of every tree's tokens."""
    ranks = run_spawned(_ep_worker, 2, ep1["state"], tp=2, ep=2, etp=1)
    assert [r["layout"] for r in ranks] == [(2, 2, 1)] * 2
    _check_against_ep1(ranks, ep1)


# ----------------------------------------------------------------------------- per-expert token
# counts


def test_expert_token_counter(world):
    """Each MoE layer routes every packed token (padding included) to top-k experts; a training
    step under full recompute counts each forward once (the recomputed router in the backward is
    skipped), so it reports what the forward-only pass reports."""
    from megatron_tree.core.packing import build_packed_tree_batch
    from megatron_tree.mcore.moe_stats import ExpertTokenCounter

    config = small_moe_config(**recompute_fields("full"))
    model = build_gpt_model(
        config, tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=16
    )
    packed = build_packed_tree_batch(
        _batch(), max_tokens_per_mb=64, block_size=16, pad_to_max=True, share_trunks=False
    )
    with ExpertTokenCounter(model) as forward_only:
        _tree_step(model, packed, forward_only=True)
    with ExpertTokenCounter(model) as train:
        _tree_step(model, packed)
    tokens = sum(tree.padded_length for tree in packed.trees)
    assert sorted(forward_only.per_layer) == [
        f"decoder.layers.{i}.mlp.router" for i in range(config.num_layers)
    ]
    for counts in forward_only.per_layer.values():
        assert counts.shape == (4,) and int(counts.sum()) == config.moe_router_topk * tokens
    assert all(torch.equal(train.per_layer[n], c) for n, c in forward_only.per_layer.items())
    assert int(forward_only.totals().sum()) == config.num_layers * config.moe_router_topk * tokens
    assert forward_only.log_line().startswith("expert tokens: [")
    with pytest.raises(ValueError, match="needs a model with MoE layers"):
        ExpertTokenCounter(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- trunk reuse

# Router losses on. A trunk group's losses are its sequences' as one unpacked batch; the same
# group held whole in one tree gives exactly those (test_moe_aux_loss.py checks a whole tree
# against Megatron's stock model on the unpacked batch), so it is the reference here.
ROUTER_LOSSES = dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)


def _long_batch(which: str) -> dict:
    """ "history": one 240-token trie (a 150-token history, five continuations); "lone": one
    140-token sequence; "both"."""
    seqs = long_context_sequences()
    picked = {"history": seqs[:-1], "lone": seqs[-1:], "both": seqs}[which]
    return rl_batch(picked, response_start=5)


def _logged_router_losses() -> dict[str, torch.Tensor]:
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    losses = {
        name: entry["values"].detach().clone()
        for name, entry in get_moe_layer_wise_logging_tracker().items()
    }
    clear_aux_losses_tracker()
    return losses


def _trunk_moe_step(model, batch, capacity: int, **kwargs):
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()
    model.zero_grad(set_to_none=True)
    result = _tree_step(model, batch, max_tokens_per_mb=capacity, block_size=16, **kwargs)
    return result, parameter_grads(model), _logged_router_losses()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_trunk_reuse_router_losses_equal_the_whole_group(world, recompute):
    """The 150-token history group at capacity 64: a chain of three trunk parts and two branch
    micro-batches, routing statistics summed over them in a first no-grad pass. Loss, log-probs,
    every gradient and the logged load-balancing and z losses equal the group held in one tree."""
    config = small_moe_config(**ROUTER_LOSSES, **recompute_fields(recompute))
    model = build_gpt_model(
        config, tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=16
    )
    batch = _long_batch("history")
    whole, want, want_losses = _trunk_moe_step(model, batch, 256, share_trunks=False)
    assert len(whole.packed) == 1
    got_result, got, got_losses = _trunk_moe_step(model, batch, 64)
    rows = [mb["rows"] for mb in got_result.packed]
    assert sum(r.records for r in rows) == 3 and all(r.group == 0 for r in rows)
    assert float(got_result.loss) == pytest.approx(float(whole.loss), rel=LOSS_RTOL)
    assert set(want_losses) == {"load_balancing_loss", "z_loss"} and set(got_losses) == set(
        want_losses
    )
    for name, values in want_losses.items():
        assert torch.allclose(got_losses[name], values, rtol=LOSS_RTOL, atol=0), (
            name,
            got_losses[name],
            values,
        )
    errors = gradient_errors(got, want)
    assert any("router" in n for n in errors) and max(errors.values()) <= GRAD_RTOL, max(
        errors.items(), key=lambda kv: kv[1]
    )
    mask = batch["attention_mask"][:, 1:]
    width = batch["input_ids"].shape[1]
    assert (
        _logprob_err(
            got_result.merged_outputs(max_seq_len=width)["logprobs"],
            whole.merged_outputs(max_seq_len=width)["logprobs"].float(),
            mask,
        )
        <= LOGP_TOL
    )


def _trunk_ep_worker(rank: int, state_path: str, dispatcher: str) -> dict:
    """EP=2 x DP=2: rank 0 steps on the history group (3 trunk parts, 2 branches), rank 1 on the
    lone 140-token sequence (2 trunk parts, 1 branch): the ranks run their calls with as many
    micro-batches, fill-ins where they have fewer."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    config = small_moe_config(dispatcher=dispatcher, **ROUTER_LOSSES)
    model = build_gpt_model(
        config, tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=16
    )
    per_rank = config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    names = {
        n: global_expert_name(n, ep_rank=ep_rank, num_local_experts=per_rank)
        for n in model.state_dict()
    }
    full = torch.load(state_path)
    model.load_state_dict({n: full[names[n]] for n in model.state_dict()})
    both = _long_batch("both")  # the same per-token inputs as the reference's; rows 0-5 the history
    rows = slice(0, 6) if ps.get_data_parallel_rank() == 0 else slice(6, 7)
    batch = {k: v[rows] for k, v in both.items()}
    result = _tree_step(
        model,
        batch,
        max_tokens_per_mb=64,
        block_size=16,
        dp_group=ps.get_data_parallel_group(),
        pad_to_max=dispatcher == "allgather",
    )
    _finalize_grads(model)
    loss = result.loss.clone()
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return {
        "loss": float(loss),
        "grads": {names[n]: g for n, g in parameter_grads(model).items()},
        "trunk_parts": sum(mb["rows"].records for mb in result.packed),
    }


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_trunk_reuse_under_expert_parallel_2_equals_whole_groups(world, tmp_path, dispatcher):
    """Reference: EP=1, both tries of the two ranks in one process, each held whole in one tree
    (capacity 256), so each tree's router losses are its trie's as one unpacked batch."""
    config = small_moe_config(dispatcher=dispatcher, **ROUTER_LOSSES)
    reference = build_gpt_model(
        config, tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=16
    )
    torch.save(reference.state_dict(), tmp_path / "state.pt")
    whole, want, _ = _trunk_moe_step(reference, _long_batch("both"), 256, share_trunks=False)
    assert len(whole.packed) == 2
    ranks = run_spawned(_trunk_ep_worker, 2, str(tmp_path / "state.pt"), dispatcher, tp=1, ep=2)
    assert [r["trunk_parts"] for r in ranks] == [3, 2]
    for r in ranks:
        assert r["loss"] == pytest.approx(float(whole.loss), rel=LOSS_RTOL)
    got = {n: g for r in ranks for n, g in r["grads"].items()}  # each rank holds its experts' grads
    errors = gradient_errors(got, want)
    assert set(errors) == set(want) and max(errors.values()) <= GRAD_RTOL, max(
        errors.items(), key=lambda kv: kv[1]
    )


def test_an_all_padding_tree_adds_no_router_loss(world):
    """A data-parallel (or expert-parallel) fill-in tree holds no token: W = 0 once made the
    load-balancing loss 0 x inf = NaN in every gradient. Now it adds nothing."""
    from megatron_tree.core.batch import PackedTreeBatch, micro_batch
    from megatron_tree.core.packing import build_packed_tree_batch
    from megatron_tree.core.tree import PackedTree

    model = build_gpt_model(
        small_moe_config(**ROUTER_LOSSES),
        tree=True,
        vocab_size=VOCAB,
        backend="block_sparse",
        block_size=16,
    )
    packed = build_packed_tree_batch(
        _batch(), max_tokens_per_mb=64, block_size=16, share_trunks=False
    )
    filler = micro_batch(PackedTree.all_padding(64))
    filler.inputs.update({k: v[:0] for k, v in packed[0].inputs.items()})
    padded = PackedTreeBatch(
        list(packed) + [filler], packed.batch_size, packed.num_real_tokens, packed.max_token_id
    )
    model.zero_grad(set_to_none=True)
    want, want_grads = _tree_step(model, packed), parameter_grads(model)
    model.zero_grad(set_to_none=True)
    got, got_grads = _tree_step(model, padded), parameter_grads(model)
    assert float(got.loss) == pytest.approx(float(want.loss), rel=LOSS_RTOL)
    errors = gradient_errors(got_grads, want_grads)
    assert max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])
