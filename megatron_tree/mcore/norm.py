"""``LocalNorm``: a torch LayerNorm / RMSNorm for local (no transformer-engine) layer specs, with
Megatron's ``layernorm_zero_centered_gamma`` (y = x_hat * (1 + weight), the weight starting at 0).

Megatron-Core's local norm (``WrappedTorchNorm``) refuses zero-centered gamma, which Qwen3-Next and
Qwen3.5 use in every norm; transformer-engine has it. This module is what the local hybrid specs
(:func:`megatron_tree.mcore.spec.local_hybrid_block_spec`) use on machines without
transformer-engine. Its parameters are named ``weight`` (and ``bias``) like torch's, so bridges'
weight maps for separate norms apply.
"""

from __future__ import annotations

import torch

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class LocalNorm(torch.nn.Module):
    """Megatron's norm builder signature: ``LocalNorm(config, hidden_size, eps=1e-5, ...)``.

    Args:
        config: the layer's TransformerConfig (``normalization``, ``layernorm_zero_centered_gamma``,
            ``sequence_parallel``: the parameters are marked so that Megatron sums their gradients
            over the tensor-parallel group).
        hidden_size: the normalized (last) dimension.
        eps: added to the variance.
        zero_centered_gamma: overrides ``config.layernorm_zero_centered_gamma`` when True.
    """

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
        **_unused,
    ):
        super().__init__()
        self.normalization = normalization or config.normalization
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={self.normalization!r} is not one of {NORMALIZATIONS}")
        self.zero_centered = bool(zero_centered_gamma or config.layernorm_zero_centered_gamma)
        self.eps = eps
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(
            init(hidden_size, dtype=config.params_dtype, device=device)
        )
        self.bias = None
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(
                torch.zeros(hidden_size, dtype=config.params_dtype, device=device)
            )
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden] (statistics in fp32 at least)."""
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        if self.bias is not None:
            h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight + 1 if self.zero_centered else self.weight
        h = h * weight.to(h.dtype)
        if self.bias is not None:
            h = h + self.bias.to(h.dtype)
        return h.to(dtype)
