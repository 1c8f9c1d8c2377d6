"""Tree step vs. unpacked reference on any TP x PP layout, launched with torchrun.

    torchrun --nproc-per-node 2 scripts/torchrun_parity.py --tp 2
    torchrun --nproc-per-node 2 scripts/torchrun_parity.py --pp 2
    torchrun --nproc-per-node 4 scripts/torchrun_parity.py --tp 2 --pp 2

gloo on CPU (with the CPU patch), NCCL on CUDA. Each rank first builds the whole model at TP=tp
(PP=1) and runs the unpacked reference step (every sequence alone, stock GPTModel); then the model
parallel state is rebuilt at TP=tp, PP=pp, each rank loads its pipeline stage's slice of the same
weights into a tree model and runs the tree step. Tensor-parallel ranks keep their index across the
two layouts (Megatron orders TP fastest), so each rank compares its own shards. Exit status 1 if
any loss or gradient is off by more than the tolerances (fp32: loss rel 1e-5, gradient rel 1e-4).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--critic", action="store_true")
    p.add_argument("--backend", default="auto", choices=["auto", "sdpa", "flex", "block_sparse"])
    return p.parse_args()


def config(args, tp: int, pp: int):
    from megatron_tree.testing.models import small_gpt_config

    return small_gpt_config(
        num_layers=args.layers, gated_linear_unit=False, add_qkv_bias=True, init_method_std=0.15,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
    )


def batch(vocab: int) -> dict:
    from megatron_tree.testing.synthetic import multi_turn_batch

    b = multi_turn_batch(num_tasks=2, rollouts_per_task=3, turns=3, system_len=24, task_len=8,
                         observation_len=(3, 9), action_len=(4, 12), vocab_size=vocab, seed=5)
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

    from megatron_tree.testing.models import build_gpt_model
    from megatron_tree.testing.reference import gradient_errors, stage_parameter_name, unpacked_reference_step
    from megatron_tree.patches import megatron_cpu
    from megatron_tree import LogProbs, Values, ppo_clipped_loss, tree_forward_backward, value_loss

    if device == "cpu":
        megatron_cpu.apply()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.tp * args.pp:
        raise ValueError(f"world size {world} must equal --tp {args.tp} x --pp {args.pp}")
    loss_fn = value_loss if args.critic else ppo_clipped_loss
    data = batch(args.vocab)

    # 1. Reference: whole model at TP=tp, every sequence alone.
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    model_parallel_cuda_manual_seed(1234)
    reference = build_gpt_model(config(args, args.tp, 1), tree=False, vocab_size=args.vocab, critic=args.critic).to(device)
    want_loss = unpacked_reference_step(reference, data, loss_fn, critic=args.critic)
    state = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in reference.state_dict().items()}
    want = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    del reference
    ps.destroy_model_parallel()

    # 2. Tree step on the TP x PP layout, this stage's slice of the same weights.
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    model_parallel_cuda_manual_seed(1234)
    stage, first = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_rank() * (args.layers // args.pp)
    model = build_gpt_model(config(args, args.tp, args.pp), tree=True, vocab_size=args.vocab, critic=args.critic,
                            backend=args.backend, block_size=16).to(device)
    model.load_state_dict({n: state[stage_parameter_name(n, first)] for n in model.state_dict()})
    result = tree_forward_backward(
        model, data, loss_fn, gather=Values() if args.critic else LogProbs(), max_tokens_per_mb=128, block_size=16,
        tp_group=ps.get_tensor_model_parallel_group(), pad_to_max=args.pp > 1,
    )
    got = {stage_parameter_name(n, first): p.grad for n, p in model.named_parameters()}
    errors = gradient_errors(got, {n: want[n] for n in got})
    worst = max(errors, key=errors.get)
    ok = errors[worst] <= GRAD_RTOL
    line = f"rank {rank} (tp {ps.get_tensor_model_parallel_rank()}, pp stage {stage}): {len(errors)} grads, worst {worst} rel {errors[worst]:.2e}"
    if result.loss is not None:
        loss_rel = abs(float(result.loss) - float(want_loss)) / abs(float(want_loss))
        ok = ok and loss_rel <= LOSS_RTOL
        line += f"; loss tree {float(result.loss):.6f} vs unpacked {float(want_loss):.6f} (rel {loss_rel:.1e})"
    line += f"; trees {result.num_micro_batches}, tree_token_ratio {result.tree_token_ratio:.3f} -> {'PASS' if ok else 'FAIL'}"
    print(line, flush=True)
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag)
    if rank == 0:
        print(f"torchrun parity (tp {args.tp}, pp {args.pp}, {'critic' if args.critic else 'actor'}): "
              f"{'PASS' if int(flag) == 0 else 'FAIL'}", flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return int(flag)


if __name__ == "__main__":
    sys.exit(main())
