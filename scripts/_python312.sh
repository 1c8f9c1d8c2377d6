# find_python312: print a Python 3.12 interpreter's path, or nothing. Tries python3.12 on PATH, then
# the newest 3.12.x that pyenv manages (pyenv's shim alone refuses unless that version is selected).
find_python312() {
  if python3.12 -c "" >/dev/null 2>&1; then
    command -v python3.12
    return
  fi
  if command -v pyenv >/dev/null 2>&1; then
    local version
    version="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1)"
    if [ -n "$version" ] && [ -x "$(pyenv prefix "$version")/bin/python3.12" ]; then
      echo "$(pyenv prefix "$version")/bin/python3.12"
    fi
  fi
}

# The tests that run on the Megatron-Bridge stack (transformers 5: the mbridge tests cannot run
# there; it carries AReaL 1.0.4 too, for AReaL's engine on Megatron-Bridge models). One list for
# .ci/run and scripts/test_matrix.sh.
MEGATRON_BRIDGE_TESTS=(tests/test_megatron_bridge.py tests/test_checkpoint_load.py tests/test_hybrid.py tests/test_nemotron_h.py tests/test_mamba_parallel.py tests/test_frontier.py tests/test_areal_megatron_bridge.py tests/test_transformers.py tests/test_transformers_recurrent.py tests/test_fsdp2.py tests/test_docs.py)
# The tests that run on the verl stack (verl's own engine code drives them).
VERL_TESTS=(tests/test_verl.py tests/test_verl_fsdp.py)
# The verl + Megatron-Bridge stack runs the Megatron engine's tests only: verl's FSDP engines load
# HF models (no bridge), so the verl stack's run of them covers both.
VERL_MEGATRON_BRIDGE_TESTS=(tests/test_verl.py)
# The tests that run on the AReaL stack (default interpreter, MEGATRON_TREE_BRIDGE=areal: AReaL's own
# engine code drives them).
AREAL_TESTS=(tests/test_areal.py tests/test_areal_fsdp.py tests/test_areal_archon.py tests/test_docs.py)
# The tests that run on the TRL stack (default interpreter, MEGATRON_TREE_BRIDGE=trl: TRL's own
# GRPOTrainer code drives them).
TRL_TESTS=(tests/test_trl.py)
# The tests that run on the kernels stack (MEGATRON_TREE_BRIDGE=kernels: mamba-ssm's and fla's own
# Triton kernels).
KERNELS_TESTS=(tests/test_recurrent_kernels.py)

# Which tests the Python 3.12 stack (megatron-core 0.19.x, mbridge, transformers 4.57) runs: every
# file but those that exercise nothing of its own there. The default stack runs them all.
# Stack-independent: run alone, none of these loads megatron.core or mbridge (tries, packing,
# masks, partition, log-prob gathers on gloo, the recurrent references, the docs tables, our Triton
# kernels in the interpreter and compiled for sm_80 / sm_90: torch 2.13 brings the same Triton 3.7.1
# to both stacks), so the 3.12 stack would repeat the default's run of the same torch and
# transformers versions.
STACK_INDEPENDENT_TESTS=(tests/test_api_table.py tests/test_triton_attention.py tests/test_kernel_compile.py tests/test_mask.py tests/test_packing.py tests/test_partition.py tests/test_recurrent.py tests/test_trunk_packing.py tests/test_main_job_report.py tests/test_models_table.py tests/test_quiet.py tests/test_logprobs.py)
# Run on the default stack only, though they load megatron.core: they compose product calls that
# the 3.12 stack tests in files of their own. The examples' variants (MoE, bf16, the HF engine, plain
# Megatron, the multi-turn read-back: 56 s of that stack's 161 s here) drive the steps, gathers and
# bridges of test_train_step, test_moe, test_bridge and test_grpo_loop; test_triton_model_step runs our
# Triton kernel (stack-independent, in the interpreter) behind the TreeCoreAttention that
# test_attention_model runs there with flex (21 s).
DEFAULT_STACK_TESTS=(tests/test_examples.py tests/test_triton_model_step.py)
# Run by a Python 3.12 framework stack already, on the same megatron-core 0.19.2 (the Megatron-Bridge
# and verl lists), or by a framework's own stack where the 3.12 stack only skips them (AReaL, TRL,
# the kernels). The Megatron-Bridge stack has transformers 5, so the HF tests there run on both
# transformers lines (4.57 on the default stack). Run on the 3.12 stack all the same:
# PY312_ALSO_TESTS, files or tests (pytest node ids) of those lists that need mbridge with
# megatron-core 0.19: the docs' mbridge snippets (they skip on the Megatron-Bridge stack) and the
# README's main job.
PY312_ALSO_TESTS=(tests/test_docs.py tests/test_examples.py::test_main_job_small)

# check_test_lists: fail naming any listed test file (or node id's file and test) that does not
# exist (a renamed file or test must not drop out of a stack unseen).
check_test_lists() {
  local f
  for f in "${MEGATRON_BRIDGE_TESTS[@]}" "${VERL_TESTS[@]}" "${AREAL_TESTS[@]}" "${TRL_TESTS[@]}" \
    "${KERNELS_TESTS[@]}" "${STACK_INDEPENDENT_TESTS[@]}" "${DEFAULT_STACK_TESTS[@]}" \
    "${PY312_ALSO_TESTS[@]}"; do
    if [ ! -f "${f%%::*}" ] || { [[ "$f" == *::* ]] && ! grep -q "^def ${f##*::}(" "${f%%::*}"; }; then
      echo "[ci] $f is in a stack's test list (scripts/_python312.sh) but does not exist: fix the list" >&2
      return 1
    fi
  done
}

# py312_tests: the test files the Python 3.12 stack runs, one a line (every tests/test_*.py not in
# the lists above, and PY312_ALSO_TESTS); a new test file runs there until a list names it.
py312_tests() {
  local f skip
  for f in tests/test_*.py; do
    for skip in "${PY312_ALSO_TESTS[@]}" "${STACK_INDEPENDENT_TESTS[@]}" "${DEFAULT_STACK_TESTS[@]}" \
      "${MEGATRON_BRIDGE_TESTS[@]}" "${VERL_TESTS[@]}" "${AREAL_TESTS[@]}" "${TRL_TESTS[@]}" \
      "${KERNELS_TESTS[@]}"; do
      [ "$f" = "${skip%%::*}" ] && continue 2
    done
    echo "$f"
  done
  printf '%s\n' "${PY312_ALSO_TESTS[@]}"
}
