"""``TreeGatedDeltaNet``: Megatron-Core's ``GatedDeltaNet`` (Qwen3-Next, Qwen3.5) on packed trees.

The same module, parameters and state-dict names as ``megatron.core.ssm.gated_delta_net
.GatedDeltaNet`` (``in_proj``, ``conv1d``, ``A_log``, ``dt_bias``, ``out_norm``, ``out_proj``);
:func:`~megatron_tree.mcore.spec.tree_attention_spec` swaps it in. Its forward takes the tree from
the micro-batch's mask (``attention_mask.plan``): the causal convolution reads each token's
ancestors, the delta rule runs per segment of the compressed trie from its parent segment's final
state (:mod:`megatron_tree.core.recurrent`), so every token gets what its sequence alone gives it.

The layer's per-token inputs (the convolution's input and the gate logits) play the part of an
attention layer's keys and values: :meth:`~megatron_tree.core.rows.TreeRows.keys_values` completes
them to the micro-batch's context, all-gathered over the CP group (each CP rank then runs the
recurrence over the whole context and keeps its rows; the recurrence is a few percent of the layer's
FLOPs), recorded by a trunk part and prepended for the parts after it (trunk reuse: a branch
recomputes the recurrence along its trunk from the stored inputs, exact, with gradients reaching
the trunk through the store). Backends: the pure-torch chunked rule on every device; on CUDA with
``fla`` installed, fla's varlen ``chunk_gated_delta_rule`` with per-segment initial states, one
call per level of the plan (:func:`~megatron_tree.mcore.gdn_kernels.tree_gated_delta_rule_fla`).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel

from ..core.recurrent import l2norm, tree_causal_conv, tree_gated_delta_rule

try:  # megatron-core >= 0.19
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.ssm.gated_delta_net import common as _gdn_common
except ImportError:  # pragma: no cover - older megatron-core
    GatedDeltaNet = None
    _gdn_common = None


logger = logging.getLogger(__name__)


@functools.cache
def _fla_kernels() -> bool:
    """fla's Triton gated delta rule imports here (checked once; logged once where not)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except ImportError as exc:
        logger.warning(
            "tree GatedDeltaNet layers on CUDA without fla's kernels (%s): running the pure-torch "
            "chunked rule (exact, slower); `pip install fla-core` for the Triton kernels",
            exc,
        )
        return False
    return True


def _delta_rule_backend(x: torch.Tensor):
    """The gated delta rule for ``x``'s device: fla's kernel on CUDA where it is installed, else
    the pure-torch chunked rule."""
    if x.is_cuda and _fla_kernels():
        from .gdn_kernels import tree_gated_delta_rule_fla

        return tree_gated_delta_rule_fla
    return tree_gated_delta_rule


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


@contextlib.contextmanager
def _without_fla_requirement():
    """Megatron's constructor refuses to build without ``fla`` (its only kernels); the tree layer
    does not call them, so the check is lifted while it builds (restored after)."""
    saved = _gdn_common.HAVE_FLA
    _gdn_common.HAVE_FLA = True
    try:
        yield
    finally:
        _gdn_common.HAVE_FLA = saved


if GatedDeltaNet is not None:

    class TreeGatedDeltaNet(GatedDeltaNet):
        """GatedDeltaNet whose forward follows the packed tree of ``attention_mask``.

        Built by Megatron's ``build_module`` with GatedDeltaNet's arguments. Forward:
        hidden_states [n, b, hidden] (n this rank's rows; n / tp of them under sequence
        parallelism), attention_mask a :func:`~megatron_tree.core.mask.tree_attention_mask` ->
        (output [n, b, hidden], bias).
        """

        def __init__(self, *args, **kwargs):
            with _without_fla_requirement():
                super().__init__(*args, **kwargs)

        def _setup_variant_attrs(self):  # called by the constructor
            super()._setup_variant_attrs()
            self.gated_delta_rule = tree_gated_delta_rule  # fla's kernel is None without fla

        def forward(
            self,
            hidden_states,
            attention_mask,
            inference_context=None,
            packed_seq_params=None,
            sequence_len_offset=None,
            *,
            inference_params=None,
            **kwargs,
        ):
            where = f"layer {self.layer_number}"
            if inference_context is not None or inference_params is not None:
                raise ValueError(
                    f"{where}: tree GatedDeltaNet is for training and scoring, not inference"
                )
            if packed_seq_params is not None:
                raise ValueError(
                    f"{where}: trees come as attention_mask=tree_attention_mask(...), not "
                    "packed_seq_params"
                )
            plan = getattr(attention_mask, "plan", None)
            if plan is None:
                raise ValueError(
                    f"{where}: a tree GatedDeltaNet needs the micro-batch's tree: pass "
                    "attention_mask=tree_attention_mask(tree or rows) (tree_forward_backward does "
                    "this)"
                )
            qkvzba, _ = self.in_proj(hidden_states)  # [n, b, in_proj_dim / tp]
            qk, vd, heads = self.qk_dim_local_tp, self.v_dim_local_tp, self.num_v_heads_local_tp
            qkv, gate, beta_alpha = torch.split(qkvzba, [2 * qk + vd, vd, 2 * heads], dim=-1)
            # The context's inputs (all CP ranks' rows, a trunk's stored rows, then these) [K, b,
            # ...].
            qkv, beta_alpha = plan.keys_values(qkv, beta_alpha, self.layer_number)
            recurrent = plan.recurrent()
            bias = self.conv1d.bias if self.conv_bias else None
            qkv = self.act_fn(tree_causal_conv(qkv, self.conv1d.weight.squeeze(1), bias, recurrent))
            out = self._delta_rule(qkv, beta_alpha, recurrent)  # [K, b, heads, dv]
            if plan.query_positions is not None:
                out = out.index_select(0, plan.query_positions)
            if self.recompute_norm_out:
                self.norm_out_checkpoint = tensor_parallel.CheckpointWithoutOutput(
                    fp8=self.config.fp8
                )  # None: off
                norm_out = self.norm_out_checkpoint.checkpoint(self._gated_norm, out, gate)
            else:
                norm_out = self._gated_norm(out, gate)
            output, output_bias = self.out_proj(norm_out)
            if self.recompute_norm_out:
                self.norm_out_checkpoint.discard_output_and_register_recompute(output)
            return output, output_bias

        def _delta_rule(
            self, qkv: torch.Tensor, beta_alpha: torch.Tensor, recurrent
        ) -> torch.Tensor:
            """Convolved q/k/v [K, b, 2 qk + v] and beta/alpha logits [K, b, 2 heads] -> [K, b,
            heads, dv]."""
            k_ctx, b = qkv.shape[:2]
            qk = self.qk_dim_local_tp
            query, key, value = torch.split(qkv, [qk, qk, self.v_dim_local_tp], dim=-1)
            query = query.reshape(k_ctx, b, -1, self.key_head_dim)
            key = key.reshape(k_ctx, b, -1, self.key_head_dim)
            value = value.reshape(k_ctx, b, -1, self.value_head_dim)
            if self.use_qk_l2norm:
                query, key = l2norm(query), l2norm(key)
            repeat = self.num_value_heads // self.num_key_heads
            if repeat > 1:
                query, key = (
                    query.repeat_interleave(repeat, dim=2),
                    key.repeat_interleave(repeat, dim=2),
                )
            beta, alpha = beta_alpha.chunk(2, dim=-1)
            g = -self.A_log.exp() * F.softplus(_at_least_fp32(alpha) + self.dt_bias)
            heads = value.shape[2]
            fold = lambda t: t.reshape(k_ctx, b * heads, *t.shape[3:])  # noqa: E731  (batch into heads)
            out = _delta_rule_backend(value)(
                fold(query * self.key_head_dim**-0.5),
                fold(key),
                fold(value),
                fold(g),
                fold(beta.sigmoid()),
                recurrent,
            )
            return out.reshape(k_ctx, b, heads, self.value_head_dim)

        def _gated_norm(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            """RMS-normed output times act(gate), [n, b, heads, dv] and [n, b, heads * dv] -> [n, b,
            heads * dv]."""
            n, b = gate.shape[:2]
            y = self.out_norm(out.reshape(-1, self.value_head_dim))
            y = y * self.act_fn(_at_least_fp32(gate.reshape(-1, self.value_head_dim)))
            return y.to(out.dtype).reshape(n, b, -1)

else:  # pragma: no cover
    TreeGatedDeltaNet = None
