"""Tree modules for HF's recurrent mixers (gated delta-nets, Mamba-2), over core.recurrent.

transformers' attention interface has no hook for a layer whose state runs along the sequence, so
:func:`swap_recurrent_modules` (called by
:func:`~megatron_tree.integrations.transformers.prepare_model`) changes the class of each such
mixer instance to a subclass whose forward follows the packed tree: the same instance, parameters
and state-dict names, so checkpoints, optimizers and FSDP2's sharding see the same model.

* Gated delta-nets: Qwen3-Next's ``Qwen3NextGatedDeltaNet`` and Qwen3.5's
  ``Qwen3_5GatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet`` (transformers >= 5.8). Their decoder
  layers hand the mixer the forward's keyword arguments, so the micro-batch's ``tree_mask`` reaches
  it (also when HF's gradient checkpointing recomputes the layer: the kwargs are the checkpointed
  call's arguments).
  transformers 4.x's Qwen3-Next layer calls its mixer without them (its mixer's forward takes no
  ``**kwargs``): there its decoder layers become :class:`TreeQwen3NextDecoderLayer`, which hand them
  on.
* Mamba-2: Nemotron-H's ``NemotronHMamba2Mixer``. ``NemotronHBlock`` calls its mixer without the
  keyword arguments, so its Mamba blocks become :class:`TreeNemotronHBlock`, which hands them on.

Per token, as HF's own forward: the projections; the depthwise causal convolution over the token's
``kernel - 1`` nearest ancestors (zeros above the root), SiLU; the scan per segment of the
compressed trie from its parent segment's final state (:mod:`megatron_tree.core.recurrent`; one
:class:`~megatron_tree.core.recurrent.RecurrentPlan` per micro-batch, kept on the tree mask's plan
and shared by every layer and the recomputation); the gated norm and the output projection. So
every token gets what its sequence alone gives it. On CUDA the scans run fla's / mamba_ssm's
kernels where installed (as the Megatron path's modules do), else the exact pure-torch scans.

Legend: b batch rows (1 for a packed micro-batch), n positions, Hk / Hv key / value heads, dk / dv
their dims, H Mamba heads of P channels, G groups of state size N.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging

import torch
import torch.nn.functional as F

from ..core.recurrent import (
    RecurrentPlan,
    l2norm,
    tree_causal_conv,
    tree_gated_delta_rule,
    tree_ssd,
)

logger = logging.getLogger(__name__)


def _hf_class(module: str, name: str):
    """``transformers.models.<module>.<name>``, or None where this transformers lacks it."""
    try:
        return getattr(importlib.import_module(f"transformers.models.{module}"), name)
    except (ImportError, AttributeError):
        return None


Qwen3NextGatedDeltaNet = _hf_class("qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet")
Qwen3NextDecoderLayer = _hf_class("qwen3_next.modeling_qwen3_next", "Qwen3NextDecoderLayer")
Qwen3_5GatedDeltaNet = _hf_class("qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet")
Qwen3_5MoeGatedDeltaNet = _hf_class("qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet")
NemotronHMamba2Mixer = _hf_class("nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer")
NemotronHBlock = _hf_class("nemotron_h.modeling_nemotron_h", "NemotronHBlock")


def _takes_kwargs(function) -> bool:
    """Whether ``function`` takes ``**kwargs`` (transformers 5's mixers do, and get the forward's
    keyword arguments from their layer; 4.x's Qwen3-Next mixer takes none and gets none)."""
    kinds = (p.kind for p in inspect.signature(function).parameters.values())
    return inspect.Parameter.VAR_KEYWORD in kinds


@functools.cache
def _kernel(module: str) -> bool:
    """``module`` (fla's or mamba_ssm's Triton op) imports here (checked once, logged if not)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        logger.warning(
            "tree recurrent mixers on CUDA without %s (%s): running the exact pure-torch scan",
            module,
            exc,
        )
        return False
    return True


def _delta_rule(x: torch.Tensor):
    if x.is_cuda and _kernel("fla.ops.gated_delta_rule"):
        from ..mcore.gdn_kernels import tree_gated_delta_rule_fla

        return tree_gated_delta_rule_fla
    return tree_gated_delta_rule


def _ssd(x: torch.Tensor):
    if x.is_cuda and _kernel("mamba_ssm.ops.triton.ssd_combined"):
        from ..mcore.ssd_kernels import tree_ssd_mamba_ssm

        return tree_ssd_mamba_ssm
    return tree_ssd


def _recurrent_plan(module, tree_mask, cache_params, attention_mask) -> RecurrentPlan:
    """The micro-batch's segment schedule from ``tree_mask`` (built by the first recurrent layer,
    kept on the mask's plan), after checking the call is a packed-tree one."""
    where = f"{type(module).__name__} (layer {module.layer_idx})"
    plan = getattr(tree_mask, "plan", None)
    if plan is None:
        raise ValueError(
            f"{where} needs the micro-batch's tree in the forward's kwargs: run the model through "
            "megatron_tree.integrations.transformers.tree_forward (or pass "
            "tree_mask=tree_attention_mask(micro_batch.rows))"
        )
    if cache_params is not None:
        raise ValueError(
            f"{where} runs packed trees for training and scoring: call with use_cache=False"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{where} got an attention_mask: call the model without one (tree_mask replaces it)"
        )
    if plan.rows is not None:
        raise ValueError(
            f"{where} runs whole trees: pack with share_trunks=False, without context parallelism"
        )
    return plan.recurrent()


class _TreeGatedDeltaNet:
    """The tree forward of HF's gated delta-nets; a subclass adds ``_tree_inputs`` for its family's
    projections and the HF class as its second base."""

    is_tree_module = True

    def _tree_inputs(self, hidden_states):
        """[b, n, hidden] -> (q|k|v before the convolution [b, n, 2 Hk dk + Hv dv], z [b, n, Hv,
        dv], beta logits [b, n, Hv], decay logits a [b, n, Hv])."""
        raise NotImplementedError

    def forward(
        self, hidden_states, cache_params=None, attention_mask=None, *, tree_mask=None, **kwargs
    ):
        """hidden_states [b, n, hidden] (b rows of one tree), ``tree_mask`` the micro-batch's
        :func:`~megatron_tree.core.mask.tree_attention_mask` -> [b, n, hidden]."""
        plan = _recurrent_plan(self, tree_mask, cache_params, attention_mask)
        bsz, n, _ = hidden_states.shape
        mixed, z, beta, a = self._tree_inputs(hidden_states)
        weight = self.conv1d.weight.squeeze(1)  # [conv_dim, kernel]
        mixed = F.silu(tree_causal_conv(mixed.transpose(0, 1), weight, self.conv1d.bias, plan))
        q, k, v = torch.split(
            mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1
        )  # [n, b, .]
        q = l2norm(q.reshape(n, bsz, -1, self.head_k_dim))
        k = l2norm(k.reshape(n, bsz, -1, self.head_k_dim))
        v = v.reshape(n, bsz, -1, self.head_v_dim)
        repeat = self.num_v_heads // self.num_k_heads
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [b, n, Hv]
        heads = self.num_v_heads
        fold = lambda t: t.reshape(n, bsz * heads, *t.shape[3:])  # noqa: E731  (batch into heads)
        out = _delta_rule(v)(
            fold(q * self.head_k_dim**-0.5),
            fold(k),
            fold(v),
            fold(g.transpose(0, 1)),
            fold(beta.sigmoid().transpose(0, 1)),
            plan,
        )  # [n, b Hv, dv]
        out = out.reshape(n, bsz, heads, self.head_v_dim).transpose(0, 1)
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(bsz, n, -1))


def _qwen3_5_inputs(module, hidden_states):
    """Qwen3.5's separate projections (q|k|v already in the convolution's channel order)."""
    bsz, n, _ = hidden_states.shape
    z = module.in_proj_z(hidden_states).reshape(bsz, n, -1, module.head_v_dim)
    return (
        module.in_proj_qkv(hidden_states),
        z,
        module.in_proj_b(hidden_states),
        module.in_proj_a(hidden_states),
    )


class _TreeMamba2Mixer:
    """The tree forward of HF's Mamba-2 mixers (Nemotron-H's layout)."""

    is_tree_module = True

    def forward(
        self, hidden_states, cache_params=None, attention_mask=None, *, tree_mask=None, **kwargs
    ):
        """hidden_states [b, n, hidden] (b rows of one tree), ``tree_mask`` the micro-batch's
        :func:`~megatron_tree.core.mask.tree_attention_mask` -> [b, n, hidden].

        dt is limited to ``time_step_limit`` after the softplus, as HF's CUDA path and Megatron do;
        HF's CPU ``torch_forward`` also clamps it from below at ``time_step_min`` (equal where that
        is 0)."""
        plan = _recurrent_plan(self, tree_mask, cache_params, attention_mask)
        dtype = hidden_states.dtype
        bsz, n, _ = hidden_states.shape
        inner, heads, p = self.intermediate_size, self.num_heads, self.head_dim
        groups, state = self.n_groups, self.ssm_state_size
        proj = self.in_proj(hidden_states)
        d_mlp = (proj.shape[-1] - 2 * inner - 2 * groups * state - heads) // 2
        _, _, gate, xbc, dt = proj.split([d_mlp, d_mlp, inner, self.conv_dim, heads], dim=-1)
        weight = self.conv1d.weight.squeeze(1)  # [conv_dim, kernel]
        xbc = self.act(tree_causal_conv(xbc.transpose(0, 1), weight, self.conv1d.bias, plan))
        x, b_in, c_in = torch.split(xbc, [inner, groups * state, groups * state], dim=-1)
        work = torch.promote_types(dtype, torch.float32)
        dt = F.softplus(dt.to(work) + self.dt_bias.to(work)).transpose(0, 1)  # [n, b, H]
        low, high = self.time_step_limit or (0.0, float("inf"))
        if (low, high) != (0.0, float("inf")):
            dt = dt.clamp(low, high)
        xh = x.reshape(n, bsz * heads, p)
        y = _ssd(x)(
            xh,
            dt.reshape(n, bsz * heads),
            -torch.exp(self.A_log.float()).repeat(bsz),  # batch folded into heads
            b_in.reshape(n, bsz * groups, state),
            c_in.reshape(n, bsz * groups, state),
            plan,
            chunk=self.chunk_size,
        )  # [n, b H, P]
        y = y.to(work) + self.D.to(work).repeat(bsz)[:, None] * xh.to(work)
        y = y.reshape(n, bsz, inner).transpose(0, 1)  # [b, n, inner]
        return self.out_proj(self.norm(y, gate).to(dtype))


# HF class -> its tree class; the swap changes an instance's class along this map.
TREE_CLASSES: dict[type, type] = {}

if Qwen3NextGatedDeltaNet is not None:

    class TreeQwen3NextGatedDeltaNet(_TreeGatedDeltaNet, Qwen3NextGatedDeltaNet):
        """Qwen3-Next's gated delta-net on packed trees (same parameters)."""

        def _tree_inputs(self, hidden_states):
            bsz, n, _ = hidden_states.shape
            q, k, v, z, beta, a = self.fix_query_key_value_ordering(
                self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
            )  # q|k|v interleaved per key head in the checkpoint: HF's reordering
            mixed = torch.cat([t.reshape(bsz, n, -1) for t in (q, k, v)], dim=-1)
            return mixed, z, beta, a

    TREE_CLASSES[Qwen3NextGatedDeltaNet] = TreeQwen3NextGatedDeltaNet

if Qwen3NextGatedDeltaNet is not None and not _takes_kwargs(Qwen3NextGatedDeltaNet.forward):

    class TreeQwen3NextDecoderLayer(Qwen3NextDecoderLayer):
        """transformers 4.x's Qwen3NextDecoderLayer that hands its gated delta-net the forward's
        keyword arguments (``tree_mask``); HF's layer drops them. Same submodules and parameters."""

        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            if self.layer_type != "linear_attention":
                return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)
            for name in ("position_ids", "use_cache"):  # the mixer's forward does not take them
                kwargs.pop(name, None)
            cache = kwargs.pop("past_key_values", None)
            residual = hidden_states
            hidden_states = self.linear_attn(
                self.input_layernorm(hidden_states),
                cache_params=cache,
                attention_mask=attention_mask,
                **kwargs,
            )
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
            if isinstance(hidden_states, tuple):  # MoE: (hidden states, router logits)
                hidden_states = hidden_states[0]
            return residual + hidden_states

    TREE_CLASSES[Qwen3NextDecoderLayer] = TreeQwen3NextDecoderLayer

if Qwen3_5GatedDeltaNet is not None:

    class TreeQwen3_5GatedDeltaNet(_TreeGatedDeltaNet, Qwen3_5GatedDeltaNet):
        """Qwen3.5's gated delta-net on packed trees (same parameters)."""

        _tree_inputs = _qwen3_5_inputs

    TREE_CLASSES[Qwen3_5GatedDeltaNet] = TreeQwen3_5GatedDeltaNet

if Qwen3_5MoeGatedDeltaNet is not None:

    class TreeQwen3_5MoeGatedDeltaNet(_TreeGatedDeltaNet, Qwen3_5MoeGatedDeltaNet):
        """Qwen3.5-MoE's gated delta-net on packed trees (same parameters)."""

        _tree_inputs = _qwen3_5_inputs

    TREE_CLASSES[Qwen3_5MoeGatedDeltaNet] = TreeQwen3_5MoeGatedDeltaNet

if NemotronHMamba2Mixer is not None:

    class TreeNemotronHMamba2Mixer(_TreeMamba2Mixer, NemotronHMamba2Mixer):
        """Nemotron-H's Mamba-2 mixer on packed trees (same parameters)."""

    class TreeNemotronHBlock(NemotronHBlock):
        """NemotronHBlock that hands its Mamba mixer the forward's keyword arguments
        (``tree_mask``); HF's block drops them. Same submodules and parameters."""

        def forward(
            self,
            hidden_states,
            past_key_values=None,
            attention_mask=None,
            position_ids=None,
            use_cache=False,
            **kwargs,
        ):
            if self.block_type != "mamba":
                return super().forward(
                    hidden_states,
                    past_key_values=past_key_values,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=use_cache,
                    **kwargs,
                )
            residual = hidden_states
            hidden_states = self.norm(hidden_states.to(dtype=self.norm.weight.dtype))
            hidden_states = self.mixer(
                hidden_states, cache_params=past_key_values, attention_mask=attention_mask, **kwargs
            )
            return residual + hidden_states

    TREE_CLASSES[NemotronHMamba2Mixer] = TreeNemotronHMamba2Mixer
    TREE_CLASSES[NemotronHBlock] = TreeNemotronHBlock


def swap_recurrent_modules(model: torch.nn.Module) -> int:
    """Swap every recurrent mixer of ``model`` that has a tree module; returns how many.

    Changes the class of each instance in place (idempotent: a swapped module is not swapped again),
    and that of the layers that must hand their mixer the tree mask (Nemotron-H's blocks, 4.x's
    Qwen3-Next layers; not counted). Modules without a tree class are left to
    :func:`~megatron_tree.integrations.transformers.prepare_model`, which refuses them by name."""
    swapped = 0
    for module in model.modules():
        tree_class = TREE_CLASSES.get(type(module))
        if tree_class is None:
            continue
        module.__class__ = tree_class
        swapped += int(getattr(tree_class, "is_tree_module", False))
    return swapped
