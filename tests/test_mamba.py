"""The tree Mamba-2 mixer (``TreeMambaMixer``) against each sequence alone, through the module.

Reference: the Mamba-2 layer written out here from its definition on one sequence at a time
(``in_proj``, torch's causal ``conv1d``, SiLU, softplus dt, the token-by-token SSD recurrence, the D
skip, the gated group RMS norm, ``out_proj``) on the mixer's own parameters; the tree code never
runs in it. float64: the tree and the reference differ by rounding only, except that the mixer keeps
``A = -exp(A_log)`` in fp32 as Megatron and HF do (so do we here: same value on both sides). A
state entering a segment from the wrong parent, a convolution tap on the wrong token or a norm group
split wrongly moves outputs by >= 1e-3. Needs megatron-core's Mamba mixer (0.17+ with triton
importable); skipped elsewhere with the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.marks import CPU_SUITE
from harness.models import pack, recurrent_sequences
from megatron_tree.core.recurrent import ssd_reference
from megatron_tree.testing.tolerances import FP64_MODEL_TOL

mamba = pytest.importorskip("megatron_tree.mcore.mamba")
pytestmark = [
    CPU_SUITE,
    pytest.mark.skipif(
        mamba.TreeMambaMixer is None,
        reason="megatron-core's Mamba mixer does not import here (it needs triton)",
    ),
]

HEADS, HEAD_DIM, GROUPS, STATE, HIDDEN = 4, 8, 2, 6, 32
FP32_EPS_REL = 1e-6  # a few fp32 ulps (1.2e-7) relative: what one fp32 cast on the path leaves


def _mixer(world_size_tp: int = 1):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        mamba_num_heads=HEADS,
        mamba_head_dim=HEAD_DIM,
        mamba_state_dim=STATE,
        mamba_num_groups=GROUPS,
        params_dtype=torch.float64,
    )
    torch.manual_seed(0)
    mixer = mamba.TreeMambaMixer(
        config,
        MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
        d_model=HIDDEN,
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        chunk_size=8,  # the tries' longer segments span several scan chunks
    ).double()
    with torch.no_grad():  # away from the all-ones / zero init, so every parameter matters
        mixer.norm.weight.uniform_(0.5, 1.5)
        mixer.D.uniform_(0.5, 1.5)
    return mixer


def _conv(mixer) -> tuple:
    """Megatron's convolution parameters (weight, bias): ``conv1d_weight`` / ``conv1d_bias`` on
    megatron-core 0.19, an ``nn.Conv1d`` named ``conv1d`` before."""
    if hasattr(mixer, "conv1d_weight"):
        return mixer.conv1d_weight, mixer.conv1d_bias
    return mixer.conv1d.weight, mixer.conv1d.bias


def _reference(mixer, h: torch.Tensor) -> torch.Tensor:
    """One sequence h [L, HIDDEN] -> [L, HIDDEN], Mamba-2 written out."""
    n = h.shape[0]
    inner, groups = HEADS * HEAD_DIM, GROUPS * STATE
    z, xbc, dt = (h @ mixer.in_proj.weight.t()).split([inner, inner + 2 * groups, HEADS], -1)
    conv = F.conv1d(xbc.t()[None], *_conv(mixer), padding=3, groups=xbc.shape[1])
    x, b, c = F.silu(conv[0, :, :n].t()).split([inner, groups, groups], -1)
    per_head = lambda t: t.reshape(n, GROUPS, 1, STATE).expand(-1, -1, HEADS // GROUPS, -1)  # noqa: E731
    y, _ = ssd_reference(
        x.reshape(n, HEADS, HEAD_DIM),
        F.softplus(dt + mixer.dt_bias),
        -torch.exp(mixer.A_log.float()).double(),
        per_head(b).reshape(n, HEADS, STATE),
        per_head(c).reshape(n, HEADS, STATE),
    )
    y = (y + mixer.D[:, None] * x.reshape(n, HEADS, HEAD_DIM)).reshape(n, inner)
    gated = (y * F.silu(z)).reshape(n, GROUPS, inner // GROUPS)
    normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5)
    return (mixer.norm.weight * normed.reshape(n, inner)) @ mixer.out_proj.weight.t()


def test_tree_mixer_equals_each_sequence_alone_forward_and_backward(world):
    """Branching multi-turn tries (prefixes of other sequences, one-token segments, branches
    inside the convolution window, segments longer than a scan chunk), float64: outputs and every
    parameter's gradient of a per-sequence weighted loss."""
    from megatron_tree.core.mask import tree_attention_mask

    seqs = recurrent_sequences()
    mb = pack(seqs)[0]
    tree = mb["tree"]
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(256, HIDDEN, generator=g, dtype=torch.float64)
    mixer = _mixer()
    hidden = embed[mb["input_ids"][0]][:, None, :]
    out, bias = mixer(hidden, tree_attention_mask(tree))
    assert bias is None and out.shape == hidden.shape
    rows = {int(tree.sequence_ids[i]): tree.sequence_token_index(i) for i in range(len(seqs))}
    weights = [torch.randn(len(s), HIDDEN, generator=g, dtype=torch.float64) for s in seqs]
    tree_loss = sum((w * out[rows[i], 0]).sum() for i, w in enumerate(weights))
    tree_loss.backward()
    got = {n: p.grad.clone() for n, p in mixer.named_parameters()}
    mixer.zero_grad()
    ref_loss = 0.0
    for i, (seq, w) in enumerate(zip(seqs, weights)):
        want = _reference(mixer, embed[seq])
        assert (out[rows[i], 0] - want).abs().max() <= FP64_MODEL_TOL, i
        ref_loss = ref_loss + (w * want).sum()
    ref_loss.backward()
    assert len(got) == 8  # in_proj, conv1d weight / bias, dt_bias, A_log, D, norm, out_proj
    for name, param in mixer.named_parameters():
        scale = param.grad.abs().max()
        assert scale > 0, name
        # A = -exp(A_log) is computed in fp32 (as Megatron and HF do): its gradient rounds there.
        tol = FP32_EPS_REL if name == "A_log" else FP64_MODEL_TOL
        assert (got[name] - param.grad).abs().max() <= tol * max(1.0, scale), name


def test_same_state_dict_as_megatrons_mixer(world):
    """Checkpoints load unchanged: the tree mixer's state-dict names and shapes are MambaMixer's
    (its norm included, under the name ``norm.weight``)."""
    mixer = _mixer()
    names = {n: tuple(t.shape) for n, t in mixer.state_dict().items() if t is not None}
    inner = HEADS * HEAD_DIM
    conv = inner + 2 * GROUPS * STATE
    # megatron-core 0.19 names the convolution's parameters conv1d_weight / conv1d_bias, earlier
    # releases hold an nn.Conv1d named conv1d
    sep = "_" if hasattr(mixer, "conv1d_weight") else "."
    assert names == {
        f"conv1d{sep}weight": (conv, 1, 4),
        f"conv1d{sep}bias": (conv,),
        "dt_bias": (HEADS,),
        "A_log": (HEADS,),
        "D": (HEADS,),
        "in_proj.weight": (2 * inner + 2 * GROUPS * STATE + HEADS, HIDDEN),
        "norm.weight": (inner,),
        "out_proj.weight": (HIDDEN, inner),
    }


def test_mixer_refuses_a_call_without_the_tree(world):
    mixer = _mixer()
    with pytest.raises(ValueError, match="needs the micro-batch's tree"):
        mixer(torch.zeros(4, 1, HIDDEN, dtype=torch.float64), None)
