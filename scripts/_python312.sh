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
MEGATRON_BRIDGE_TESTS=(tests/test_megatron_bridge.py tests/test_hybrid.py tests/test_nemotron_h.py tests/test_mamba_parallel.py tests/test_frontier.py tests/test_areal_megatron_bridge.py tests/test_transformers.py tests/test_transformers_recurrent.py tests/test_fsdp2.py tests/test_docs.py)
# The tests that run on the verl stack (verl's own engine code drives them).
VERL_TESTS=(tests/test_verl.py tests/test_verl_fsdp.py)
# The tests that run on the AReaL stack (default interpreter, MEGATRON_TREE_BRIDGE=areal: AReaL's own
# engine code drives them).
AREAL_TESTS=(tests/test_areal.py tests/test_areal_fsdp.py tests/test_docs.py)
# The tests that run on the TRL stack (default interpreter, MEGATRON_TREE_BRIDGE=trl: TRL's own
# GRPOTrainer code drives them).
TRL_TESTS=(tests/test_trl.py)
