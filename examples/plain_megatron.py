"""Tree training with plain Megatron-Core (no mbridge): build, step, optimize.

    python examples/plain_megatron.py

Builds a small GPT from Megatron's local layer spec rewritten for tree attention, then runs a few
GRPO steps on a synthetic batch with ``tree_forward_backward`` and a torch optimizer. Single
process (gloo); on a CPU-only machine the CPU runtime patch is applied.
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist


def main(steps: int = 3) -> list[float]:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tree import (
        TreeGPTModel,
        build_packed_tree_batch,
        ppo_clipped_loss,
        tree_attention_spec,
        tree_forward_backward,
    )
    from megatron_tree.patches import megatron_cpu
    from megatron_tree.testing.synthetic import grpo_batch

    megatron_cpu.apply()  # no-op where CUDA is available
    init = f"file://{tempfile.mkdtemp()}/rendezvous"  # a one-process world: no port to race for
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)

    config = TransformerConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=512,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
        masked_softmax_fusion=False,  # CPU: no fused CUDA softmax
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    # Tree attention replaces core_attention in every layer; TreeGPTModel indexes RoPE by depth.
    spec = tree_attention_spec(get_gpt_layer_local_spec(normalization="RMSNorm"), block_size=64)
    model = TreeGPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=1024,
        max_sequence_length=2048,
        position_embedding_type="rope",
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    batch = grpo_batch(
        num_prompts=2, samples_per_prompt=4, prompt_len=192, response_len=(32, 64), vocab_size=1024
    )
    response = batch.pop("loss_mask")
    batch["loss_mask"] = torch.zeros_like(response)
    batch["loss_mask"][:, :-1] = response[:, 1:]  # rolled: entry t is about token t + 1
    batch["advantages"] = (
        torch.randn(batch["input_ids"].shape[0], 1).expand_as(response).contiguous()
    )

    # Pack the rollout batch once; every pass below steps on the same trees.
    packed = build_packed_tree_batch(batch, max_tokens_per_mb=1024, block_size=64, vocab_size=1024)
    # The behaviour policy's log-probs, from a forward-only pass, attached in tree layout.
    old = tree_forward_backward(model, packed, None, forward_only=True, collect_outputs=True)
    packed.attach("old_logprobs", old.tree_outputs["logprobs"])
    losses = []
    for step in range(steps):  # PPO epochs on one batch
        optimizer.zero_grad(set_to_none=True)
        result = tree_forward_backward(model, packed, ppo_clipped_loss)
        optimizer.step()
        losses.append(float(result.loss))
        print(f"step {step}: {result.log_line()}")

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    megatron_cpu.undo()
    return losses


if __name__ == "__main__":
    main()
