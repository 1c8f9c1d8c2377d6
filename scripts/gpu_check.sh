#!/usr/bin/env bash
# GPU check for tree attention (run on a CUDA machine; about 5-8 minutes on one GPU).
#
#   1. the CPU test suite of the attention/bridge code, with CUDA hidden (it must pass there too);
#   2. parity on CUDA: tiny Qwen2/Qwen3/Llama HF checkpoints loaded through
#      patch_bridge_for_tree_training + mbridge, branching tries, per-sequence log-probs against HF
#      fp32 -- in bf16 for the flex, block_sparse and sdpa backends (bar: at most 2x the error of the
#      same bf16 model run on each sequence unpacked), and in fp32 with flex (bar 1e-4);
#   3. the flex backend forward and backward against an fp64 brute force (bar: at most 2x the error
#      of the brute force computed in bf16), and packed-vs-unpacked gradients of a TreeGPTModel with
#      the flex backend in fp32 (relative error <= 1e-4 per parameter);
#   4. scripts/bench_model.py at a larger size (bf16, flex);
#   5. the end-to-end GRPO step (examples/tree_vs_baseline.py) on qwen3_small (hidden 1024, 8 layers),
#      bf16, flex, 16K-token trees, tree vs. unshared baseline (bar: >= 85% of the ideal speed-up);
# then prints one summary table. Exit status 0 iff every check passed.
#
# Needs a Python environment with CUDA torch, megatron-core 0.16.x, mbridge 0.15.1, transformers<5
# and this package (scripts/setup_env.sh with MEGATRON_TREE_TORCH set to a CUDA torch, or "skip" to
# keep the torch already installed). Set PYTHON to use another interpreter than .venv/bin/python.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="$(mktemp -d)"
T0=$SECONDS

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch.cuda.is_available() is False; run this on a CUDA machine" >&2
  exit 2
fi
"$PY" -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'megatron-core', m.__version__, torch.cuda.get_device_name(0))"

# ---------------------------------------------------------------------------------------------- 1
echo "== [1/5] CPU suite with CUDA hidden"
CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=4 timeout 240 "$PY" -m pytest -q -p no:cacheprovider -W ignore \
  tests/test_attention.py tests/test_attention_model.py tests/test_bridge.py tests/test_cpu_patch.py \
  >"$OUT/cpu_suite.txt" 2>&1
CPU_RC=$?
tail -n 3 "$OUT/cpu_suite.txt"
echo "cpu suite (CUDA hidden)|$(tail -n 1 "$OUT/cpu_suite.txt" | tr -d '=' | xargs)|all pass|$([ $CPU_RC = 0 ] && echo PASS || echo FAIL)" \
  >"$OUT/rows.txt"

# ------------------------------------------------------------------------------------------ 2 + 3
echo "== [2-3/4] CUDA parity (bf16/fp32) and flex forward/backward"
timeout 300 "$PY" - "$OUT/rows.txt" <<'PYEOF'
import os
import socket
import sys
import tempfile

import torch

sys.path.insert(0, "tests")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
rows_path = sys.argv[1]
DEV = torch.device("cuda", 0)
torch.cuda.set_device(DEV)


def record(name, value, bar, ok):
    print(f"{name}: {value} (bar {bar}) {'PASS' if ok else 'FAIL'}", flush=True)
    with open(rows_path, "a") as f:
        f.write(f"{name}|{value}|{bar}|{'PASS' if ok else 'FAIL'}\n")


def guarded(name, fn):
    try:
        fn()
    except Exception as exc:  # one failing check must not hide the others
        import traceback

        traceback.print_exc()
        record(name, f"error: {type(exc).__name__}: {str(exc)[:80]}", "-", False)


import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mp_random

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
mp_random.model_parallel_cuda_manual_seed(1234)

from megatron_tree.testing.models import ARCHS, VOCAB, attention_reference, branching_sequences, make_hf_checkpoint, pack
from megatron_tree.core.attention import tree_attention
from megatron_tree.core.mask import build_attention_mask_from_trie

SEQS = branching_sequences()
MICRO_BATCHES = pack(SEQS)


def gather_tree(logits, mb):
    tree = mb["tree"]
    logp = torch.log_softmax(logits[0].float(), -1).cpu()
    out = {}
    for i in range(tree.num_sequences):
        idx = tree.sequence_token_index(i)
        out[int(tree.sequence_ids[i])] = logp[idx[:-1], tree.input_ids[idx[1:]]]
    return out


def megatron_tree_logprobs(model):
    out = {}
    with torch.no_grad():
        for mb in MICRO_BATCHES:
            logits = model(
                mb["input_ids"].to(DEV), mb["position_ids"].to(DEV),
                attention_mask=mb["tree"].subtree_end.to(DEV),
            )
            out.update(gather_tree(logits, mb))
    return out


def megatron_unpacked_logprobs(model):
    """The same model on each sequence alone: a one-sequence chain (subtree_end = L everywhere)."""
    out = {}
    with torch.no_grad():
        for i, s in enumerate(SEQS):
            n = len(s)
            logits = model(
                s[None].to(DEV), torch.arange(n, device=DEV)[None],
                attention_mask=torch.full((n,), n, dtype=torch.int32, device=DEV),
            )
            out[i] = torch.log_softmax(logits[0].float(), -1).cpu()[:-1].gather(1, s[1:, None])[:, 0]
    return out


def hf_logprobs(path, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, attn_implementation="eager")
    model = model.to(DEV).eval()
    out = {}
    with torch.no_grad():
        for i, s in enumerate(SEQS):
            logits = model(s[None].to(DEV)).logits[0].float().cpu()
            out[i] = torch.log_softmax(logits, -1)[:-1].gather(1, s[1:, None])[:, 0]
    return out


def max_err(a, b):
    return max(float((a[i] - b[i]).abs().max()) for i in a)


def bridge_model(path, backend, dtype):
    from mbridge import AutoBridge

    from megatron_tree.bridges.mbridge import patch_bridge_for_tree_training

    with patch_bridge_for_tree_training(backend=backend):
        bridge = AutoBridge.from_pretrained(path, dtype=dtype)
    bf16 = dtype == torch.bfloat16
    return bridge.get_model(weight_path=path, bf16=bf16, wrap_with_ddp=False)[0].eval()


def parity(arch, path):
    ref32 = hf_logprobs(path, torch.float32)
    hf16 = max_err(hf_logprobs(path, torch.bfloat16), ref32)
    print(f"{arch}: HF bf16 unpacked vs HF fp32: {hf16:.3e} (for reference)")
    for backend in ("flex", "block_sparse", "sdpa"):
        def check(backend=backend):
            model = bridge_model(path, backend, torch.bfloat16)
            tree = max_err(megatron_tree_logprobs(model), ref32)
            unpacked = max_err(megatron_unpacked_logprobs(model), ref32)
            record(f"{arch} bf16 {backend}: tree vs HF fp32", f"{tree:.3e}",
                   f"<= 2x unpacked bf16 {unpacked:.3e}", tree <= 2 * unpacked)
        guarded(f"{arch} bf16 {backend}", check)

    def check_fp32():
        model = bridge_model(path, "flex", torch.float32)
        tree = max_err(megatron_tree_logprobs(model), ref32)
        record(f"{arch} fp32 flex: tree vs HF fp32", f"{tree:.3e}", "<= 1e-4", tree <= 1e-4)
    guarded(f"{arch} fp32 flex", check_fp32)


with tempfile.TemporaryDirectory() as root:
    for arch in ARCHS:
        path = os.path.join(root, arch)
        make_hf_checkpoint(arch, path)
        parity(arch, path)


def flex_kernel_check():
    tree = pack(branching_sequences() * 3, block_size=128, max_tokens=1024)[0]["tree"].to(DEV)
    n = tree.padded_length
    masked = build_attention_mask_from_trie(tree)
    g = torch.Generator(device=DEV).manual_seed(0)
    base = [torch.randn(s, generator=g, device=DEV, dtype=torch.float64)
            for s in [(n, 1, 8, 64), (n, 1, 2, 64), (n, 1, 2, 64)]]
    grad_out = torch.randn(n, 1, 8 * 64, generator=g, device=DEV, dtype=torch.float64)

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in base]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, grad_out.to(dtype))
        return [out.detach().double()] + [x.double() for x in grads]

    ref = run(lambda q, k, v: attention_reference(q, k, v, masked), torch.float64)
    naive16 = run(lambda q, k, v: attention_reference(q, k, v, masked), torch.bfloat16)
    flex16 = run(lambda q, k, v: tree_attention(q, k, v, tree.subtree_end, backend="flex"), torch.bfloat16)
    flex32 = run(lambda q, k, v: tree_attention(q, k, v, tree.subtree_end, backend="flex"), torch.float32)
    for name, r, a, b, c in zip(("out", "dq", "dk", "dv"), ref, naive16, flex16, flex32):
        err_naive, err_flex = float((a - r).abs().max()), float((b - r).abs().max())
        record(f"flex bf16 {name} (N={n})", f"{err_flex:.3e}", f"<= 2x naive bf16 {err_naive:.3e}",
               err_flex <= 2 * err_naive)
        err32 = float((c - r).abs().max())
        record(f"flex fp32 {name} (N={n})", f"{err32:.3e}", "<= 1e-4", err32 <= 1e-4)


guarded("flex kernel fwd/bwd", flex_kernel_check)


def model_gradient_check():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tree.mcore.model import TreeGPTModel
    from megatron_tree.mcore.spec import tree_attention_spec

    for recompute in ({}, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
                      {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}):
        def build(cls, spec, **extra):
            config = TransformerConfig(
                num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=128, masked_softmax_fusion=False, hidden_dropout=0.0,
                attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True,
                add_bias_linear=False, init_method_std=0.15, params_dtype=torch.float32, **extra,
            )
            torch.manual_seed(0)
            return cls(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                       max_sequence_length=512, position_embedding_type="rope").to(DEV).train()

        local = get_gpt_layer_local_spec(normalization="RMSNorm")
        reference = build(GPTModel, local)
        tree_model = build(TreeGPTModel, tree_attention_spec(local, backend="flex"), **recompute)
        tree_model.load_state_dict(reference.state_dict())
        gen = torch.Generator().manual_seed(7)
        weights = {i: torch.rand(len(s) - 1, generator=gen).to(DEV) for i, s in enumerate(SEQS)}
        loss = 0.0
        for i, s in enumerate(SEQS):
            s = s.to(DEV)
            logits = reference(s[None], torch.arange(len(s), device=DEV)[None], attention_mask=None)
            logp = torch.log_softmax(logits[0], -1)[:-1].gather(1, s[1:, None])[:, 0]
            loss = loss - (logp * weights[i]).sum()
        loss.backward()
        loss = 0.0
        for mb in MICRO_BATCHES:
            tree = mb["tree"].to(DEV)
            logits = tree_model(mb["input_ids"].to(DEV), mb["position_ids"].to(DEV),
                                attention_mask=tree.subtree_end)
            logp = torch.log_softmax(logits[0], -1)
            for i in range(tree.num_sequences):
                idx = tree.sequence_token_index(i)
                seq_logp = logp[idx[:-1], tree.input_ids[idx[1:]]]
                loss = loss - (seq_logp * weights[int(tree.sequence_ids[i])]).sum()
        loss.backward()
        worst = max(
            float((p.grad - q.grad).norm() / q.grad.norm())
            for p, q in zip(tree_model.parameters(), reference.parameters())
        )
        label = recompute.get("recompute_granularity", "none")
        record(f"flex fp32 grads vs unpacked (recompute {label})", f"{worst:.3e}", "<= 1e-4", worst <= 1e-4)


guarded("flex fp32 grads", model_gradient_check)
PYEOF
PARITY_RC=$?
[ $PARITY_RC = 0 ] || echo "CUDA parity script|exit status $PARITY_RC|0|FAIL" >>"$OUT/rows.txt"

# ---------------------------------------------------------------------------------------------- 4
echo "== [4/5] benchmark (bf16, flex, larger model)"
timeout 240 "$PY" scripts/bench_model.py --device cuda --dtype bf16 --backend flex \
  --hidden 1024 --layers 8 --heads 16 --groups 4 --ffn 4096 --vocab 32000 \
  --prompt 4096 --responses 8 --response-len 1024 --reps 5 2>&1 | grep -v -i warn | tee "$OUT/bench.txt"
BENCH_RC=${PIPESTATUS[0]}
if [ "$BENCH_RC" = 0 ]; then
  "$PY" - "$OUT/bench.txt" "$OUT/rows.txt" <<'PYEOF'
import re, sys
text, rows = open(sys.argv[1]).read(), open(sys.argv[2], "a")
for line in text.splitlines():
    m = re.match(r"(shared \(GRPO\)|nothing shared)\s.*?([\d.]+)x\s+([\d.]+)x\s+(\d+)%", line)
    if m:
        name, speed, ideal, frac = m.group(1), float(m.group(2)), float(m.group(3)), int(m.group(4))
        bar = ">= 80% of ideal" if name.startswith("shared") else ">= 0.95x"
        ok = frac >= 80 if name.startswith("shared") else speed >= 0.95
        rows.write(f"bench {name}|{speed:.2f}x (ideal {ideal:.2f}x, {frac}%)|{bar}|{'PASS' if ok else 'FAIL'}\n")
PYEOF
else
  echo "benchmark|exit status $BENCH_RC|0|FAIL" >>"$OUT/rows.txt"
fi

# ---------------------------------------------------------------------------------------------- 5
echo "== [5/5] end-to-end GRPO step, tree vs. unshared (qwen3_small, bf16, flex, 16K-token trees)"
timeout 240 "$PY" examples/tree_vs_baseline.py --device cuda --bf16 --backend flex \
  --config examples/configs/qwen3_small --max-tokens 16384 --prompts 8 --samples 8 \
  --prompt-len 2048 --response-len 256 512 --reps 3 --parity-sequences 2 --out "$OUT" 2>&1 \
  | grep -v -i warn | tee "$OUT/e2e.txt"
E2E_RC=${PIPESTATUS[0]}
if [ "$E2E_RC" = 0 ]; then
  "$PY" - "$OUT/e2e.txt" "$OUT/rows.txt" <<'PYEOF'
import re, sys
text, rows = open(sys.argv[1]).read(), open(sys.argv[2], "a")
speed = float(re.search(r"^speed-up\s+([\d.]+)x", text, re.M).group(1))
ideal = float(re.search(r"^ideal speed-up \(FLOP model\)\s+([\d.]+)x", text, re.M).group(1))
ok = speed >= 0.85 * ideal
rows.write(f"e2e GRPO step speed-up|{speed:.2f}x (ideal {ideal:.2f}x, {speed / ideal:.0%})|>= 85% of ideal|{'PASS' if ok else 'FAIL'}\n")
PYEOF
else
  echo "e2e GRPO step|exit status $E2E_RC|0|FAIL" >>"$OUT/rows.txt"
fi

# ------------------------------------------------------------------------------------------ summary
echo
echo "== summary ($((SECONDS - T0)) s; logs in $OUT)"
"$PY" - "$OUT/rows.txt" <<'PYEOF'
import sys
rows = [line.rstrip("\n").split("|") for line in open(sys.argv[1]) if line.strip()]
widths = [max(len(r[i]) for r in rows + [["check", "value", "bar", "result"]]) for i in range(4)]
for r in [["check", "value", "bar", "result"]] + rows:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
sys.exit(0 if all(r[3] == "PASS" for r in rows) else 1)
PYEOF
