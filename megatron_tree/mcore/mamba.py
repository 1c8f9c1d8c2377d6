"""``TreeMambaMixer``: Megatron-Core's Mamba-2 mixer (Nemotron-H, Nemotron 3) on packed trees.

The same module, parameters and state-dict names as ``megatron.core.ssm.mamba_mixer.MambaMixer``
(``in_proj``, ``conv1d_weight``, ``conv1d_bias``, ``dt_bias``, ``A_log``, ``D``, ``norm.weight``,
``out_proj``); :func:`~megatron_tree.mcore.spec.tree_attention_spec` swaps it in, and
:class:`TreeMambaLayer` (a ``MambaLayer`` that hands its mixer the micro-batch's tree mask) around
it. Per token: ``in_proj`` -> ``[z, x, B, C, dt]``; the depthwise causal convolution of ``[x, B,
C]`` over the token's ``d_conv - 1`` nearest ancestors (zeros above the root), SiLU; ``dt =
softplus(dt + dt_bias)``; the SSD scan per segment of the compressed trie from its parent segment's
final state (:func:`~megatron_tree.core.recurrent.tree_ssd`); ``+ D x``; the gated RMS norm
``norm(y * silu(z))`` over groups of ``d_inner / ngroups`` channels (Megatron's
``norm_before_gate=False``, as HF's ``torch_forward``); ``out_proj``. So every token gets what its
sequence alone gives it.

As in :class:`~megatron_tree.mcore.gated_delta_net.TreeGatedDeltaNet`, the convolution's input and
the dt logits play the part of an attention layer's keys and values
(:meth:`~megatron_tree.core.rows.TreeRows.keys_values`): all-gathered over the CP group (each CP
rank scans the whole context and keeps its rows), recorded by a trunk part and prepended for the
parts after it (trunk reuse). Tensor parallelism splits heads and groups as Megatron does; the
tree's plan is the same on every rank.

Backends: the pure-torch chunked scan on every device; on CUDA with ``mamba_ssm`` installed,
``mamba_chunk_scan_combined`` once per (level, length bucket) of the plan
(:func:`~megatron_tree.mcore.ssd_kernels.tree_ssd_mamba_ssm`).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F

from ..core.recurrent import tree_causal_conv, tree_ssd

try:  # megatron-core >= 0.16 ships the Mamba layers; they import mamba_ssm lazily (guarded)
    from megatron.core.ssm import mamba_mixer as _mamba_mixer
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.ssm.mamba_mixer import MambaMixer
except ImportError:  # pragma: no cover - megatron-core without Mamba
    _mamba_mixer = MambaLayer = MambaMixer = None

logger = logging.getLogger(__name__)


class GatedRMSNorm(torch.nn.Module):
    """``weight * rmsnorm(y * silu(z))`` with the RMS taken over groups of ``group_size`` channels
    (Mamba-2's gated norm with the gate applied first), in at least fp32 inside.

    Built with the arguments Megatron's ``ExtendedRMSNorm`` takes; holds one parameter,
    ``weight`` [hidden] (split by tensor parallelism like Megatron's)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if norm_before_gate:
            raise ValueError("GatedRMSNorm: norm_before_gate=True is not a Mamba-2 layout")
        self.eps = eps
        self.group_size = group_size or hidden_size
        if hidden_size % self.group_size:
            raise ValueError(f"hidden_size={hidden_size} is not a multiple of {self.group_size}")
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z [..., hidden] -> [..., hidden] in y's dtype."""
        work = torch.promote_types(y.dtype, torch.float32)
        h = y.to(work) * F.silu(z.to(work))
        grouped = h.unflatten(-1, (-1, self.group_size))
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(work) * grouped.flatten(-2)).to(y.dtype)


@contextlib.contextmanager
def _without_mamba_ssm_requirement():
    """Megatron's constructor refuses to build without ``mamba_ssm`` and builds its norm from it;
    the tree mixer calls neither, so while it builds the check is lifted and the norm is ours
    (restored after)."""
    saved = _mamba_mixer.HAVE_MAMBA_SSM, _mamba_mixer.ExtendedRMSNorm
    _mamba_mixer.HAVE_MAMBA_SSM, _mamba_mixer.ExtendedRMSNorm = True, GatedRMSNorm
    try:
        yield
    finally:
        _mamba_mixer.HAVE_MAMBA_SSM, _mamba_mixer.ExtendedRMSNorm = saved


@functools.cache
def _mamba_ssm_kernels() -> bool:
    """mamba_ssm's Triton SSD kernels import here (checked once; logged once where not)."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined  # noqa: F401
    except ImportError as exc:
        logger.warning(
            "tree Mamba layers on CUDA without mamba_ssm's kernels (%s): running the pure-torch "
            "chunked scan (exact, slower); `pip install mamba-ssm` for the Triton kernels",
            exc,
        )
        return False
    return True


def _ssd_backend(x: torch.Tensor):
    """The SSD scan for ``x``'s device: mamba_ssm's kernel on CUDA where it is installed, else the
    pure-torch chunked scan."""
    if x.is_cuda and _mamba_ssm_kernels():
        from .ssd_kernels import tree_ssd_mamba_ssm

        return tree_ssd_mamba_ssm
    return tree_ssd


if MambaMixer is not None:

    class TreeMambaMixer(MambaMixer):
        """MambaMixer whose forward follows the packed tree of ``attention_mask``.

        Built by Megatron's ``build_module`` with MambaMixer's arguments. Forward: hidden_states [n,
        b, hidden] (n this rank's rows), attention_mask a
        :func:`~megatron_tree.core.mask.tree_attention_mask` -> (output [n, b, hidden], bias).
        """

        def __init__(self, *args, **kwargs):
            with _without_mamba_ssm_requirement():
                super().__init__(*args, **kwargs)

        def conv_parameters(self) -> tuple[torch.Tensor, torch.Tensor | None]:
            """The depthwise convolution's weight [channels, 1, d_conv] and bias [channels]:
            megatron-core 0.19 holds them as ``conv1d_weight`` / ``conv1d_bias``, earlier releases
            as an ``nn.Conv1d`` named ``conv1d``."""
            if hasattr(self, "conv1d_weight"):
                return self.conv1d_weight, self.conv1d_bias
            return self.conv1d.weight, self.conv1d.bias

        def forward(
            self,
            hidden_states,
            attention_mask=None,
            inference_context=None,
            *,
            inference_params=None,
            packed_seq_params=None,
        ):
            where = f"Mamba layer {self.layer_number}"
            if inference_context is not None or inference_params is not None:
                raise ValueError(f"{where}: the tree Mamba mixer is for training and scoring")
            if packed_seq_params is not None:
                raise ValueError(
                    f"{where}: trees come as attention_mask=tree_attention_mask(...), not "
                    "packed_seq_params"
                )
            plan = getattr(attention_mask, "plan", None)
            if plan is None:
                raise ValueError(
                    f"{where}: a tree Mamba mixer needs the micro-batch's tree: pass "
                    "attention_mask=tree_attention_mask(tree or rows) (tree_forward_backward does "
                    "this; a TreeMambaLayer hands it on)"
                )
            zxbcdt, _ = self.in_proj(hidden_states)  # [n, b, in_proj_dim / tp]
            inner, groups = self.d_inner_local_tp, self.ngroups_local_tp * self.d_state
            z, xbc, dt = torch.split(
                zxbcdt, [inner, inner + 2 * groups, self.nheads_local_tp], dim=-1
            )
            xbc, dt = plan.keys_values(xbc, dt, self.layer_number)  # the context's [K, b, ...]
            recurrent = plan.recurrent()
            weight, bias = self.conv_parameters()
            xbc = F.silu(tree_causal_conv(xbc, weight.squeeze(1), bias, recurrent))
            x, b_in, c_in = torch.split(xbc, [inner, groups, groups], dim=-1)
            y = self._scan(x, dt, b_in, c_in, recurrent)  # [K, b, inner]
            if plan.query_positions is not None:
                y = y.index_select(0, plan.query_positions)
            y = self.norm(y, z)
            return self.out_proj(y)

        def _scan(self, x, dt, b_in, c_in, recurrent) -> torch.Tensor:
            """Convolved x [K, b, inner], dt logits [K, b, heads], B and C [K, b, groups * N] ->
            SSD output plus the D skip, [K, b, inner]."""
            k_ctx, b = x.shape[:2]
            heads, p = self.nheads_local_tp, self.headdim
            work = torch.promote_types(x.dtype, torch.float32)
            dt = F.softplus(dt.to(work) + self.dt_bias.to(work))
            a = -torch.exp(self.A_log.float()).repeat(b)  # batch folded into heads
            xh = x.reshape(k_ctx, b * heads, p)
            bg, cg = (
                t.reshape(k_ctx, b * self.ngroups_local_tp, self.d_state) for t in (b_in, c_in)
            )
            y = _ssd_backend(x)(
                xh, dt.reshape(k_ctx, b * heads), a, bg, cg, recurrent, chunk=self.chunk_size
            )
            d = self.D.to(work)
            d = d.reshape(heads, p) if self.D_has_hdim else d[:, None]
            y = y.reshape(k_ctx, b, heads, p).to(work) + d * xh.reshape(k_ctx, b, heads, p).to(work)
            return y.reshape(k_ctx, b, heads * p).to(x.dtype)

    class TreeMambaLayer(MambaLayer):
        """MambaLayer that hands its mixer the micro-batch's tree mask (Megatron's MambaLayer takes
        ``attention_mask`` and drops it). Same submodules and parameters."""

        def forward(
            self,
            hidden_states,
            attention_mask=None,
            inference_context=None,
            rotary_pos_emb=None,
            *,
            inference_params=None,
            packed_seq_params=None,
        ):
            residual = hidden_states
            if self.config.fp32_residual_connection:
                residual = residual.float()
            hidden_states = self.norm(hidden_states.to(dtype=self.config.params_dtype))
            out = self.mixer(
                hidden_states,
                attention_mask,
                inference_context=inference_context,
                inference_params=inference_params,
                packed_seq_params=packed_seq_params,
            )
            with self.bias_dropout_add_exec_handler():
                return self.mamba_bda(
                    training=self.training, fused=self.config.bias_dropout_fusion
                )(out, residual, self.hidden_dropout)

else:  # pragma: no cover
    TreeMambaMixer = TreeMambaLayer = None
