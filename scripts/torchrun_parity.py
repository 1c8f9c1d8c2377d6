"""Tree step vs. unpacked reference on any TP x CP x PP (x VPP) x DP layout, launched with torchrun.

    torchrun --nproc-per-node 2 scripts/torchrun_parity.py --tp 2
    torchrun --nproc-per-node 2 scripts/torchrun_parity.py --tp 2 --sp
    torchrun --nproc-per-node 2 scripts/torchrun_parity.py --pp 2 --vpp 2
    torchrun --nproc-per-node 4 scripts/torchrun_parity.py --cp 2 --tp 2
    torchrun --nproc-per-node 4 scripts/torchrun_parity.py --cp 2        # CP=2 x DP=2
    torchrun --nproc-per-node 2 scripts/torchrun_parity.py --tp 2 --trunk  # trunk reuse
    torchrun --nproc-per-node 2 scripts/torchrun_parity.py --pp 2 --chains # trunk parts in chains

gloo on CPU (with the CPU patch), NCCL on CUDA. Each rank first builds the whole model at TP=tp
(no CP, PP or SP) and runs the unpacked reference step on the whole batch (every sequence alone,
stock GPTModel); then the model parallel state is rebuilt at the tree layout, each rank loads its
pipeline stage's (and virtual stage's) slice of the same weights into a tree model and runs the
tree step on its data-parallel share of the batch; gradients are averaged over the data x context
parallel ranks, as Megatron DDP does. Tensor-parallel ranks keep their index across the two layouts
(Megatron orders TP fastest), so each rank compares its own shards. Exit status 1 if any loss or
gradient is off by more than the tolerances (fp32: loss rel 1e-5, gradient rel 1e-4).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# The test harness (tests/harness: tiny models, spawned worlds, engine fixtures) is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
OUTPUT_ATOL = 1e-5  # per-token log-probs / values, fp32


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--critic", action="store_true")
    p.add_argument("--backend", default="auto", choices=["auto", "sdpa", "flex", "block_sparse"])
    p.add_argument(
        "--trunk",
        action="store_true",
        help="trunk reuse: prompt groups larger than the 64-token micro-batch (share_trunks=True)",
    )
    p.add_argument(
        "--chains",
        action="store_true",
        help="trunk reuse with chains: a 150-token history and a 140-token sequence at capacity 64",
    )
    return p.parse_args()


def config(args, tp: int, pp: int = 1, cp: int = 1, vpp: int | None = None, sp: bool = False):
    from harness.models import small_gpt_config

    return small_gpt_config(
        num_layers=args.layers,
        gated_linear_unit=False,
        add_qkv_bias=True,
        init_method_std=0.15,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sp,
    )


def tree_chunks(args, device, state):
    """This rank's model chunks (one per virtual stage) holding their slices of ``state``."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from harness.models import build_gpt_model
    from megatron_tree.testing.reference import stage_parameter_name

    chunks, names = [], {}
    for vp_stage in [None] if args.vpp is None else range(args.vpp):
        cfg = config(args, args.tp, args.pp, args.cp, args.vpp, args.sp)
        chunk = build_gpt_model(
            cfg,
            tree=True,
            vocab_size=args.vocab,
            critic=args.critic,
            backend=args.backend,
            block_size=16,
            vp_stage=vp_stage,
        ).to(device)
        first = get_transformer_layer_offset(cfg, vp_stage=vp_stage)
        for n in chunk.state_dict():
            names[(len(chunks), n)] = stage_parameter_name(n, first)
        chunk.load_state_dict({n: state[names[(len(chunks), n)]] for n in chunk.state_dict()})
        chunks.append(chunk)
    return chunks, names


def batch(vocab: int, trunk: bool, chains: bool = False) -> dict:
    from harness.models import long_context_sequences, trunk_sequences
    from megatron_tree.testing.synthetic import multi_turn_batch, rl_batch

    if chains:
        return rl_batch(long_context_sequences(), response_start=5)
    if trunk:
        return rl_batch(trunk_sequences(), response_start=5)

    b = multi_turn_batch(
        num_tasks=2,
        rollouts_per_task=3,
        turns=3,
        system_len=24,
        task_len=8,
        observation_len=(3, 9),
        action_len=(4, 12),
        vocab_size=vocab,
        seed=5,
    )
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros_like(b["loss_mask"])
    mask[:, :-1] = b["loss_mask"][:, 1:]  # rolled: entry t is about token t + 1
    b["loss_mask"] = mask
    b["old_logprobs"] = -3 * torch.rand(mask.shape, generator=g) - 3.5
    b["advantages"] = torch.randn(mask.shape[0], 1, generator=g).expand_as(mask).contiguous()
    b["returns"] = torch.randn(mask.shape, generator=g)
    return b


def main() -> int:
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from harness.models import build_gpt_model
    from megatron_tree import (
        LogProbs,
        PackingConfig,
        ProcessGroups,
        Values,
        ppo_clipped_loss,
        tree_forward_backward,
        value_loss,
    )
    from megatron_tree.patches import megatron_cpu
    from megatron_tree.testing.reference import gradient_errors, unpacked_reference_step

    if device == "cpu":
        megatron_cpu.apply()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % (args.tp * args.pp * args.cp):
        raise ValueError(
            f"world size {world} must be a multiple of --tp {args.tp} x --pp {args.pp} x --cp "
            f"{args.cp}"
        )
    loss_fn = value_loss if args.critic else ppo_clipped_loss
    args.trunk = args.trunk or args.chains
    data = batch(args.vocab, args.trunk, args.chains)

    # 1. Reference: whole model at TP=tp, every sequence of the whole batch alone.
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    model_parallel_cuda_manual_seed(1234)
    reference = build_gpt_model(
        config(args, args.tp), tree=False, vocab_size=args.vocab, critic=args.critic
    ).to(device)
    want_outputs: dict = {}
    want_loss = unpacked_reference_step(
        reference, data, loss_fn, critic=args.critic, outputs=want_outputs
    )
    state = {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else v
        for k, v in reference.state_dict().items()
    }
    want = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    del reference
    ps.destroy_model_parallel()

    # 2. Tree step on the tree layout: this stage's slices of the same weights, this DP rank's rows.
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp,
        virtual_pipeline_model_parallel_size=args.vpp,
    )
    model_parallel_cuda_manual_seed(1234)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    chunks, names = tree_chunks(args, device, state)
    mine = {k: v[dp_rank::dp] for k, v in data.items()}
    result = tree_forward_backward(
        chunks if args.vpp else chunks[0],
        mine,
        loss_fn,
        gather=Values() if args.critic else LogProbs(),
        packing=PackingConfig(
            max_tokens_per_mb=64 if args.trunk else 128,
            block_size=16,
            pad_to_max=args.pp > 1,
            share_trunks=True if args.trunk else None,
        ),
        groups=ProcessGroups(
            tp=ps.get_tensor_model_parallel_group(),
            dp=ps.get_data_parallel_group() if dp > 1 else None,
        ),
        collect_outputs=True,
    )
    got = {
        names[(c, n)]: p.grad for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()
    }
    for (
        chunk
    ) in chunks:  # finalize_model_grads: sequence-parallel (norm) weights hold per-shard sums
        for p in chunk.parameters():
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    for g in got.values():  # Megatron DDP: average over the data x context parallel ranks
        dist.all_reduce(
            g, op=dist.ReduceOp.AVG, group=ps.get_data_parallel_group(with_context_parallel=True)
        )
    errors = gradient_errors(got, {n: want[n] for n in got})
    worst = max(errors, key=errors.get)
    ok = errors[worst] <= GRAD_RTOL
    stage = ps.get_pipeline_model_parallel_rank()
    line = (
        f"rank {rank} (tp {ps.get_tensor_model_parallel_rank()}, cp "
        f"{ps.get_context_parallel_rank()}, dp {dp_rank}, pp stage {stage}): {len(errors)} grads, "
        f"worst {worst} rel {errors[worst]:.2e}"
    )
    if result.loss is not None:
        loss = result.loss.clone()
        if dp > 1:
            dist.all_reduce(loss, group=ps.get_data_parallel_group())  # the DP ranks' shares add up
        loss_rel = abs(float(loss) - float(want_loss)) / abs(float(want_loss))
        ok = ok and loss_rel <= LOSS_RTOL
        line += (
            f"; loss tree {float(loss):.6f} vs unpacked {float(want_loss):.6f} (rel {loss_rel:.1e})"
        )
        name = "values" if args.critic else "logprobs"
        got_out = result.merged_outputs(max_seq_len=data["input_ids"].shape[1])[name]
        rows = range(data["input_ids"].shape[0])[dp_rank::dp]
        out_err = max(
            float(
                (got_out[j, : len(want_outputs[i][name])].double() - want_outputs[i][name].double())
                .abs()
                .max()
            )
            for j, i in enumerate(rows)
        )
        ok = ok and out_err <= OUTPUT_ATOL
        line += f"; max |{name} tree - unpacked| {out_err:.1e}"
    parts = sum(mb["rows"].group is not None for mb in result.packed)
    line += (
        f"; trees {result.num_micro_batches} ({parts} trunk-reuse parts), "
        f"tree_token_ratio {result.tree_token_ratio:.3f} -> {'PASS' if ok else 'FAIL'}"
    )
    print(line, flush=True)
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag)
    if rank == 0:
        dp = world // (args.tp * args.pp * args.cp)
        layout = (
            f"tp {args.tp}{' +sp' if args.sp else ''}, cp {args.cp}, pp {args.pp}, "
            f"vpp {args.vpp or 1}, dp {dp}"
        )
        print(
            f"torchrun parity ({layout}, {'critic' if args.critic else 'actor'}): "
            f"{'PASS' if int(flag) == 0 else 'FAIL'}",
            flush=True,
        )
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return int(flag)


if __name__ == "__main__":
    sys.exit(main())
