"""The Python snippets of README.md and of every docs/*.md page, run as written.

Every ```python block of ``DOCS`` is executed unmodified (compiled with the document's own line
numbers, so a traceback points at the line of the document). What a snippet leaves to the reader
(a checkpoint path, a rollout batch, an optimizer, a config) comes from a fixture preamble below,
one per snippet; a block without one fails :func:`test_every_snippet_has_a_preamble`, so a new
snippet is tested from the day it is written. A sketch that leaves its inputs to the reader (a
``...`` argument) cannot run; it is listed in ``SKETCHES`` with the reason and compiled only. A
DeprecationWarning raised at a snippet's line is an
error: the docs must not teach a name the package deprecated.

A snippet that imports a stack's package (mbridge; Megatron-Bridge, the
``MEGATRON_TREE_BRIDGE=megatron-bridge`` stack; verl) runs where that package is installed and is
skipped elsewhere with the reason shown. The Megatron-Bridge snippet runs in a fresh interpreter:
the order of its imports is part of what it documents (after another test, Megatron-Bridge would
already be in ``sys.modules``).
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *sorted(f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")))
# The packages of the stacks beyond the default one: a snippet importing one runs where it is
# installed (the stack that installs it, in scripts/_python312.sh's test lists).
STACK_PACKAGES = {
    "mbridge": "mbridge 0.15.1 is missing or cannot run here (it needs transformers < 5): runs on "
    "the default and Python 3.12 stacks",
    "megatron.bridge": "megatron-bridge is not installed: runs on the Megatron-Bridge stack "
    "(MEGATRON_TREE_BRIDGE=megatron-bridge, tests listed in MEGATRON_BRIDGE_TESTS)",
    "verl": "verl is not installed: runs on the verl stack (MEGATRON_TREE_BRIDGE=verl)",
    "areal": "AReaL is not installed: runs on the AReaL stack (MEGATRON_TREE_BRIDGE=areal)",
}


def stack_installed(package: str) -> bool:
    if importlib.util.find_spec(package) is None:
        return False
    if package == "mbridge":  # installed on the Megatron-Bridge stack too, where it cannot run
        from importlib.metadata import version

        return int(version("transformers").split(".")[0]) < 5
    return True


FRESH_PROCESS = ("megatron.bridge", "areal")  # snippets importing these run in a new interpreter
FRESH_PROCESS_TIMEOUT_S = 600
# Upstream deprecations the documented path cannot avoid (-W options; later ones take precedence):
# Megatron-Bridge 0.6.2's provide_distributed_model warns that provider-based configuration is
# deprecated (for ModelConfig + ModelBuilder); the tree patch binds to the provider.
FRESH_PROCESS_IGNORED = (
    "-W",
    "ignore:ModelProviderMixin-based model configuration:DeprecationWarning",
)
# A snippet runs as this module: a DeprecationWarning attributed to its lines (a name the docs
# still teach but the package deprecated) is an error.
SNIPPET_MODULE = "docs_snippet"


def python_blocks(doc: str) -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block of ``doc`` (fences at any indent)."""
    blocks, lines, start, indent = [], (ROOT / doc).read_text().splitlines(), None, ""
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if start is None and stripped == "```python":
            start, indent = number + 1, line[: len(line) - len(line.lstrip())]
        elif start is not None and stripped == "```":
            body = [text[len(indent) :] for text in lines[start - 1 : number - 1]]
            blocks.append((start, "\n".join(body) + "\n"))
            start = None
    return blocks


def snippet_id(doc: str, index: int) -> str:
    return f"{doc}-block{index}"


SNIPPETS = {
    snippet_id(doc, i): (doc, line, code)
    for doc in DOCS
    for i, (line, code) in enumerate(python_blocks(doc))
}


def imported_modules(code: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def stack_of(code: str) -> str | None:
    """The stack package the snippet imports (a key of ``STACK_PACKAGES``), or None."""
    for name in imported_modules(code):
        for package in STACK_PACKAGES:
            if name == package or name.startswith(package + "."):
                return package
    return None


def compiled(doc: str, line: int, code: str):
    """``code`` compiled as lines ``line..`` of ``doc``: tracebacks name the document's lines."""
    return compile("\n" * (line - 1) + code, str(ROOT / doc), "exec")


# ---- Fixture preambles: what each snippet leaves to the reader. ----------------------------------


class CountingOptimizer:
    """The snippets' ``optimizer``: anything with ``step()``; counts the calls."""

    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1


def rollout() -> dict:
    """A right-padded rollout batch of the tiny checkpoints' vocabulary: a shared prompt with six
    responses, a multi-turn chain, a prefix and a duplicate; rolled loss mask, advantages."""
    from harness.models import branching_sequences
    from megatron_tree.testing.synthetic import rl_batch

    return rl_batch(branching_sequences())


def rl_loop_namespace(checkpoints) -> dict:
    """The mbridge examples (README quick start, usage's first): ``hf_path``, the rollout tensors
    ``ids``, ``mask``, ``loss_mask``, ``advantages``, ``vocab_size``, ``ppo_epochs``,
    ``optimizer``."""
    from harness.models import VOCAB

    batch = rollout()
    return dict(
        hf_path=checkpoints["qwen3"],
        ids=batch["input_ids"],
        mask=batch["attention_mask"],
        loss_mask=batch["loss_mask"],
        advantages=batch["advantages"],
        vocab_size=VOCAB,
        ppo_epochs=2,
        optimizer=CountingOptimizer(),
    )


def check_rl_loop(ns: dict) -> None:
    assert ns["optimizer"].steps == ns["ppo_epochs"]
    assert math.isfinite(float(ns["result"].loss))
    grads = [p.grad for p in ns["models"][0].parameters() if p.requires_grad]
    assert any(g is not None and bool(g.abs().sum() > 0) for g in grads), "no gradient"


def megatron_core_namespace(checkpoints) -> dict:
    """usage's plain Megatron-Core example: ``config``, ``V`` (vocabulary), ``S`` (max length)."""
    from harness.models import VOCAB, small_gpt_config

    return dict(config=small_gpt_config(), V=VOCAB, S=512)


def check_megatron_core(ns: dict) -> None:
    from megatron_tree import TreeGPTModel

    assert isinstance(ns["model"], TreeGPTModel)


def building_blocks_namespace(checkpoints) -> dict:
    """usage's building blocks: a padded ``batch`` of ``B`` rows, a tree ``model`` on ``device``,
    its ``tp_group``."""
    from megatron.core import parallel_state

    from harness.models import VOCAB, build_gpt_model, small_gpt_config

    batch = rollout()
    return dict(
        batch=batch,
        B=batch["input_ids"].shape[0],
        model=build_gpt_model(small_gpt_config(), tree=True, vocab_size=VOCAB).eval(),
        device="cpu",
        tp_group=parallel_state.get_tensor_model_parallel_group(),
    )


def check_building_blocks(ns: dict) -> None:
    batch, merged = ns["batch"], ns["merged"]
    lengths = batch["attention_mask"].sum(1)
    assert tuple(merged.shape) == tuple(batch["input_ids"].shape)
    for row, n in enumerate(lengths.tolist()):  # rolled log-probs of real tokens: finite, < 0
        assert bool((merged[row, : n - 1] < 0).all()) and bool(merged[row].isfinite().all())


def hf_namespace(checkpoints) -> dict:
    """docs/huggingface.md's snippet: ``hf_path``, a list of branching ``sequences``, ``device``."""
    from harness.models import branching_sequences

    return dict(hf_path=checkpoints["qwen3"], sequences=branching_sequences(), device="cpu")


def check_hf(ns: dict) -> None:
    """Each sequence's log-probs equal HF eager's on the sequence alone."""
    from harness.models import hf_logprobs
    from megatron_tree.testing.tolerances import LOGP_TOL

    seqs, logprobs = ns["sequences"], ns["logprobs"]
    assert isinstance(logprobs, list) and len(logprobs) == len(seqs)
    reference = hf_logprobs(ns["hf_path"], seqs)
    for i, seq in enumerate(seqs):
        assert logprobs[i].shape == seq.shape
        err = float((logprobs[i][:-1].detach() - reference[i]).abs().max())
        assert err <= LOGP_TOL, f"sequence {i}: {err}"


MEGATRON_BRIDGE_PREAMBLE = """\
# Fixture preamble (tests/test_docs.py): a one-process world and a tiny checkpoint; nothing of
# Megatron-Bridge or of megatron_tree's bridges is imported before the snippet.
import os, sys
sys.path.insert(0, "tests")  # the test harness (tests/harness), not installed
from harness.dist import single_process_world
single_process_world()
hf_path, tp = os.environ["MEGATRON_TREE_DOCS_CHECKPOINT"], 1
assert "megatron.bridge" not in sys.modules
"""
MEGATRON_BRIDGE_CHECK = """\
from megatron_tree import TreeGPTModel
assert isinstance(models[0], TreeGPTModel), type(models[0])
print("MEGATRON_TREE_DOCS_OK")
"""

AREAL_PREAMBLE = """\
# Fixture preamble (tests/test_docs.py): AReaL imports on a CPU machine only with the test
# harness's stand-ins for what it imports but this path never uses (ray, wandb, ...).
import sys
sys.path.insert(0, "tests")  # the test harness (tests/harness), not installed
from harness import areal_platform
areal_platform.setup_cpu()
"""
AREAL_CHECK = """\
from areal.trainer.rl_trainer import PPOTrainer  # looks the engines up in areal.engine
from megatron_tree.integrations.areal import TreeMegatronPPOActor, TreeMegatronPPOCritic
assert areal.engine.MegatronPPOActor is TreeMegatronPPOActor
assert areal.engine.MegatronPPOCritic is TreeMegatronPPOCritic
print("MEGATRON_TREE_DOCS_OK")
"""

AREAL_ARCHON_CHECK = """\
# what AReaL's trainer runs for an "archon" allocation (rl_trainer.py, _create_train_engine)
from areal.experimental.engine.archon_engine import ArchonPPOActor, ArchonPPOCritic
assert ArchonPPOActor is areal_archon.TreeArchonPPOActor
assert ArchonPPOCritic is areal_archon.TreeArchonPPOCritic
print("MEGATRON_TREE_DOCS_OK")
"""

# snippet id -> (preamble: checkpoints -> namespace, or source run before it in a fresh process;
# check: namespace -> None, or source run after it).
PREAMBLES = {
    snippet_id("README.md", 0): (rl_loop_namespace, check_rl_loop),
    snippet_id("docs/areal.md", 0): (AREAL_PREAMBLE, AREAL_CHECK),
    snippet_id("docs/areal.md", 1): (AREAL_PREAMBLE, AREAL_ARCHON_CHECK),
    snippet_id("docs/huggingface.md", 0): (hf_namespace, check_hf),
    snippet_id("docs/usage.md", 0): (rl_loop_namespace, check_rl_loop),
    snippet_id("docs/usage.md", 1): (MEGATRON_BRIDGE_PREAMBLE, MEGATRON_BRIDGE_CHECK),
    snippet_id("docs/usage.md", 2): (megatron_core_namespace, check_megatron_core),
    snippet_id("docs/usage.md", 3): (building_blocks_namespace, check_building_blocks),
}
# snippet id -> why it cannot run as written (it is compiled only).
SKETCHES = {
    snippet_id("docs/how-it-works.md", 0): "the data-parallel slicing inside a caller's loop "
    "(global_batch, dp_size, config, dp_rank from the caller)",
    snippet_id("docs/parallelism.md", 0): "a torchrun script at context_parallel_size=2 "
    "(TransformerConfig(...) elided)",
}


def test_every_snippet_has_a_preamble():
    assert not set(PREAMBLES) & set(SKETCHES)
    assert set(SNIPPETS) == set(PREAMBLES) | set(SKETCHES), (
        "the Python blocks of the docs changed: give each a preamble in tests/test_docs.py "
        f"(found {sorted(SNIPPETS)}, preambles for {sorted(PREAMBLES)}, sketches "
        f"{sorted(SKETCHES)})"
    )


@pytest.mark.parametrize("snippet", sorted(set(SKETCHES) & set(SNIPPETS)))
def test_sketch_compiles(snippet):
    doc, line, code = SNIPPETS[snippet]
    compiled(doc, line, code)  # a SyntaxError names the document's line


def run_fresh(doc: str, line: int, code: str, preamble: str, check: str, checkpoint: str) -> None:
    padded = "\n" * (line - 1) + code  # the document's line numbers in tracebacks
    program = "\n".join(
        [preamble, f"exec(compile({padded!r}, {str(ROOT / doc)!r}, 'exec'))", check]
    )
    env = {**os.environ, "MEGATRON_TREE_DOCS_CHECKPOINT": checkpoint}
    proc = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning:__main__", *FRESH_PROCESS_IGNORED]
        + ["-c", program],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=FRESH_PROCESS_TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "MEGATRON_TREE_DOCS_OK" in proc.stdout, (
        f"{doc}:{line} failed in a fresh interpreter:\n{output[-6000:]}"
    )


@pytest.mark.parametrize("snippet", sorted(set(SNIPPETS) - set(SKETCHES)))
def test_snippet_runs_as_written(snippet, checkpoints, request):
    doc, line, code = SNIPPETS[snippet]
    if snippet not in PREAMBLES:
        pytest.fail(f"{doc}:{line} has no preamble in tests/test_docs.py")
    if torch.cuda.is_available():
        pytest.skip("CPU suite; run with CUDA_VISIBLE_DEVICES= on CUDA machines")
    stack = stack_of(code)
    if stack is not None and not stack_installed(stack):
        pytest.skip(f"{doc}:{line}: {STACK_PACKAGES[stack]}")
    preamble, check = PREAMBLES[snippet]
    if stack in FRESH_PROCESS:
        run_fresh(doc, line, code, preamble, check, checkpoints["qwen3"])
        return
    request.getfixturevalue("world")
    namespace = {**preamble(checkpoints), "__name__": SNIPPET_MODULE}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=DeprecationWarning, module=SNIPPET_MODULE)
        exec(compiled(doc, line, code), namespace)
    check(namespace)


def test_snippet_extraction_reads_indented_fences(tmp_path, monkeypatch):
    """A fence inside a list item (indented) is a block too, its indent removed."""
    doc = tmp_path / "x.md"
    doc.write_text("text\n\n- item\n\n  ```python\n  a = 1\n  b = a\n  ```\n\n```bash\nls\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert python_blocks("x.md") == [(6, "a = 1\nb = a\n")]
