"""NaN injection audit: a pytest plugin, off unless NAN_INJECT=1 (docs/install.md, "The NaN audit").

Use:  NAN_INJECT=1 PYTHONPATH=tests python -m pytest -p harness.nan_inject -p no:xdist ...

When NAN_INJECT=1, importing this module (in the pytest process, and in the multiprocessing fork
server, which preloads it first) patches megatron_tree so that
  * the product's finiteness check never fires (core.finite.non_finite -> False device bool,
    FiniteCheck.raise_if_any -> no-op; re-bound in every megatron_tree module that imported them),
  * the first call per test per process of a per-token log-prob producer returns its log-probs
    with ONE element set to NaN (out of place: clone, then set; autograd keeps working). The
    element is the last scored entry of the tree's first sequence (cu_seqlens[1] - 2: the log-prob
    of that sequence's last token, a response token in any RL batch), else entry 0.
Each injection writes a marker file into $NAN_INJECT_DIR (set per test by the hooks below; forked
ranks receive it with the caller's environment). Per-test results go to $NAN_INJECT_RESULTS
(default: nan_inject/results.json under the system temporary folder), merged with what the file
already holds.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
import tempfile

import pytest

ACTIVE = os.environ.get("NAN_INJECT") == "1"
MODE = os.environ.get("NAN_INJECT_MODE", "once")  # "once" (default) or "all": every call
HARNESS = os.environ.get("NAN_INJECT_HARNESS") == "1"
VERL = os.environ.get("NAN_INJECT_VERL") == "1"  # also verl's Megatron adapter's head
_count = [0]
_current = [None]  # nodeid of the running test (pytest process)
ROOT = os.environ.get("NAN_INJECT_ROOT", os.path.join(tempfile.gettempdir(), "nan_inject"))
RESULTS = os.environ.get("NAN_INJECT_RESULTS", os.path.join(ROOT, "results.json"))
_done: set[str] = set()  # NAN_INJECT_DIRs this process has injected into already
_originals: dict[int, tuple] = {}  # id(original) -> (original, replacement); keeps it alive

PRODUCERS = (
    # (module, name, how to find (logprobs, tree) in the call)
    ("megatron_tree.core.logprobs", "gather_packed_tree_logprobs_entropy"),
    ("megatron_tree.core.logprobs", "gather_packed_tree_logprobs"),
    ("megatron_tree.core.logprobs", "gather_packed_tree_logprobs_entropy_from_hidden"),
)


def _marker(name: str, info: dict) -> None:
    directory = os.environ["NAN_INJECT_DIR"]
    os.makedirs(directory, exist_ok=True)
    _count[0] += 1
    with open(os.path.join(directory, f"{os.getpid()}-{_count[0]}-{name}.json"), "w") as f:
        json.dump(info, f)


def _tree_of(name, args, kwargs):
    if "tree" in kwargs:
        return kwargs["tree"]
    position = 2 if name.endswith("_from_hidden") else 1
    return args[position] if len(args) > position else None


def _inject(name: str, out, tree):
    import torch

    directory = os.environ.get("NAN_INJECT_DIR")
    if not directory or (directory in _done and MODE != "all"):
        return out
    logprobs = out[0] if isinstance(out, tuple) else out
    if not torch.is_tensor(logprobs) or logprobs.numel() == 0 or not logprobs.is_floating_point():
        return out
    # The element: the last entry of the first sequence that this call actually computed (a
    # nonzero log-prob; entries predicted by rows another trunk part / CP rank computes read 0, and
    # each sequence's last entry is 0), i.e. the log-prob of that sequence's last (response) token.
    flat = logprobs.detach().reshape(-1)
    computed = (flat != 0).nonzero().flatten()
    if computed.numel() == 0:
        return out  # nothing computed here: wait for the next call
    index = int(computed[0])
    try:
        cu = tree.cu_seqlens.to(computed.device)
        seq = torch.searchsorted(cu, computed, right=True) - 1
        index = int(computed[seq == seq[0]][-1])
    except Exception:
        pass
    _done.add(directory)
    poisoned = logprobs.clone()
    poisoned.view(-1)[index] = math.nan
    _marker(
        name,
        {
            "pid": os.getpid(),
            "producer": name,
            "index": index,
            "numel": logprobs.numel(),
            "requires_grad": bool(poisoned.requires_grad),
            "rank": os.environ.get("RANK"),
            "grad_enabled": torch.is_grad_enabled(),
            "stack": [
                f"{fr.filename.replace('/work/main/', '')}:{fr.lineno}:{fr.name}"
                for fr in __import__("traceback").extract_stack()[:-3]
                if "/site-packages/" not in fr.filename and "pluggy" not in fr.filename
            ][-8:],
        },
    )
    return (poisoned, *out[1:]) if isinstance(out, tuple) else poisoned


def _wrap(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        rows = kwargs.get("rows")
        if rows is not None and getattr(rows, "records", False):
            # A trunk part that records keys for later parts: it computes only the shared prefix
            # (prompt) entries, which losses mask; inject into the first part that is not one.
            return out
        return _inject(name, out, _tree_of(name, args, kwargs))

    wrapper._nan_inject_original = fn
    return wrapper


def _wrap_harness(fn):
    """Second pass (NAN_INJECT_HARNESS=1): the test harness's log-softmax of the product's logits
    (harness.models.packed_logprobs, {batch row: [L - 1]}) gets one NaN: the last entry of its
    lowest batch row, once per test per process."""

    @functools.wraps(fn)
    def wrapper(logits, micro_batch):
        out = fn(logits, micro_batch)
        directory = os.environ.get("NAN_INJECT_DIR")
        if not out or not directory or (directory in _done and MODE != "all"):
            return out
        key = min(out)
        if out[key].numel() == 0:
            return out
        _done.add(directory)
        poisoned = out[key].clone()
        poisoned.view(-1)[-1] = math.nan
        _marker(
            "harness.packed_logprobs",
            {
                "pid": os.getpid(),
                "producer": "harness.models.packed_logprobs",
                "row": key,
                "numel": poisoned.numel(),
            },
        )
        return {**out, key: poisoned}

    wrapper._nan_inject_original = fn
    return wrapper


def _false_flag(outputs):
    import torch

    device = next((v.device for v in outputs.values() if torch.is_tensor(v)), torch.device("cpu"))
    return torch.zeros((), dtype=torch.bool, device=device)


def _no_raise(self):
    self.entries = []


def rebind(prefixes=("megatron_tree",)) -> None:
    """Replace every module-level binding of a patched original in the modules loaded so far."""
    for modname, module in list(sys.modules.items()):
        if module is None or not modname.startswith(prefixes):
            continue
        for attr, value in list(vars(module).items()):
            pair = _originals.get(id(value))
            if pair is not None and value is pair[0]:
                setattr(module, attr, pair[1])


def apply() -> None:
    import importlib

    finite = importlib.import_module("megatron_tree.core.finite")
    if getattr(finite, "_nan_inject_applied", False):
        return
    _originals[id(finite.non_finite)] = (finite.non_finite, _false_flag)
    finite.non_finite = _false_flag
    finite.FiniteCheck.raise_if_any = _no_raise
    for modname, name in PRODUCERS:
        module = importlib.import_module(modname)
        fn = getattr(module, name)
        wrapped = _wrap(name, fn)
        _originals[id(fn)] = (fn, wrapped)
        setattr(module, name, wrapped)
    if HARNESS:
        models = importlib.import_module("harness.models")
        fn = models.packed_logprobs
        wrapped = _wrap_harness(fn)
        _originals[id(fn)] = (fn, wrapped)
        models.packed_logprobs = wrapped
    if VERL:
        # verl's Megatron adapter takes log-probs through verl's own logits processor at the
        # tree's rows (TreeMegatronEngineWithLMHead._tree_head), not through the gathers above.
        # Patched when the harness builds an engine: verl's plugin loading has imported the
        # adapter by then (importing it here first would register its engines twice).
        harness_verl = importlib.import_module("harness.verl")
        build = harness_verl.build_engine

        @functools.wraps(build)
        def build_engine(*args, **kwargs):
            adapter = sys.modules.get("megatron_tree.integrations.verl")
            cls = getattr(adapter, "TreeMegatronEngineWithLMHead", None)
            if cls is not None and not hasattr(cls._tree_head, "_nan_inject_original"):
                head = cls._tree_head

                @functools.wraps(head)
                def tree_head(self, *a, **k):
                    out = head(self, *a, **k)
                    if "log_probs" in out:
                        poisoned = _inject("verl._tree_head", out["log_probs"], None)
                        out = dict(out, log_probs=poisoned)
                    return out

                tree_head._nan_inject_original = head
                cls._tree_head = tree_head
            return build(*args, **kwargs)

        harness_verl.build_engine = build_engine
    finite._nan_inject_applied = True
    rebind(("megatron_tree", "harness", "test_"))


if ACTIVE:
    apply()


# ------------------------------------------------------------------------------------------------
# pytest hooks (harmless where this module is imported as a plain module, e.g. by the fork server)
# ------------------------------------------------------------------------------------------------

_records: dict[str, dict] = {}


def _sanitize(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[:200]


def _markers(directory: str) -> list[dict]:
    if not os.path.isdir(directory):
        return []
    found = []
    for entry in sorted(os.listdir(directory)):
        try:
            with open(os.path.join(directory, entry)) as f:
                found.append(json.load(f))
        except (OSError, ValueError):
            pass
    return found


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Failed|Interrupt|Exit))(:|$)")


def _inner_exception(text: str) -> str | None:
    """The last exception line of a spawned rank's traceback inside a RuntimeError message."""
    lines = [line for line in text.splitlines() if _EXC_LINE.match(line)]
    return lines[-1][:300] if lines else None


def pytest_configure(config):
    if not ACTIVE:
        return
    try:
        import harness.dist as hd

        if "harness.nan_inject" not in hd.PRELOAD:
            hd.PRELOAD = ("harness.nan_inject",) + tuple(hd.PRELOAD)
    except ImportError:
        pass


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not ACTIVE:
        return (yield)
    rebind(("megatron_tree", "harness", "test_"))
    directory = os.path.join(ROOT, "runs", _sanitize(item.nodeid))
    if os.path.isdir(directory):
        for entry in os.listdir(directory):
            os.remove(os.path.join(directory, entry))
    previous = os.environ.get("NAN_INJECT_DIR")
    os.environ["NAN_INJECT_DIR"] = directory
    _records[item.nodeid] = {"nodeid": item.nodeid, "outcome": None, "mode": MODE}
    _current[0] = item.nodeid
    try:
        return (yield)
    finally:
        if previous is None:
            os.environ.pop("NAN_INJECT_DIR", None)
        else:
            os.environ["NAN_INJECT_DIR"] = previous
        record = _records[item.nodeid]
        found = _markers(directory)
        record["injected_here"] = len(found)
        record["producers"] = sorted({m["producer"] for m in found})
        inherited = []
        for chain in item._fixtureinfo.name2fixturedefs.values():
            for fd in chain:
                src = getattr(fd, "_nan_injected_by", None)
                if src and src != item.nodeid:
                    inherited.append(f"{fd.argname} (set up in {src})")
        record["inherited_from_fixture"] = sorted(set(inherited))
        record["injected"] = bool(found) or bool(inherited)
        record["python"] = sys.executable
        try:
            with open(RESULTS) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
        data[item.nodeid] = record
        with open(RESULTS, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if not ACTIVE:
        return (yield)
    directory = os.environ.get("NAN_INJECT_DIR", "")
    before = len(_markers(directory)) if directory else 0
    fixturedef._nan_injected_by = None
    try:
        return (yield)
    finally:
        if directory and len(_markers(directory)) > before:
            fixturedef._nan_injected_by = _current[0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if not ACTIVE or item.nodeid not in _records:
        return report
    record = _records[item.nodeid]
    if call.when == "call" or ((report.failed or report.skipped) and record["outcome"] is None):
        outcome = report.outcome
        if call.when != "call" and report.failed:
            outcome = f"error in {call.when}"
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        record["outcome"] = outcome
        if call.excinfo is not None and report.failed:
            text = str(call.excinfo.value)
            record["exception"] = call.excinfo.typename
            record["message"] = (text.strip().splitlines() or [""])[0][:300]
            inner = _inner_exception(text) if call.excinfo.typename == "RuntimeError" else None
            if inner:
                record["inner_exception"] = inner
    return report
