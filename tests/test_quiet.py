"""megatron_tree.demo.quiet hides known upstream warnings (counted, one summary line) and never
unknown ones."""

import io
import logging
import sys
import warnings

from megatron_tree.demo.quiet import known_upstream_warnings

KNOWN_MSG = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
UNKNOWN_MSG = "something nobody has looked at yet"


def _run(monkeypatch, verbose):
    if verbose:
        monkeypatch.setenv("MEGATRON_TREE_VERBOSE", "1")
    else:
        monkeypatch.delenv("MEGATRON_TREE_VERBOSE", raising=False)
    summary, logged, shown = io.StringIO(), io.StringIO(), []
    handler = logging.StreamHandler(logged)
    logger = logging.getLogger("megatron.core.test_quiet")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with known_upstream_warnings(
                prefix="[t]", stream=summary, filter_stdout=False
            ) as noise:
                warnings.warn(KNOWN_MSG, UserWarning)
                warnings.warn("full scope is deprecated. Use empty cuda_graph_scope", UserWarning)
                warnings.warn(UNKNOWN_MSG, UserWarning)
                logger.warning("Apex is not installed. Falling back to Torch Norm")
                logger.warning("unknown log line")
            shown = [str(w.message) for w in caught]
    finally:
        logger.removeHandler(handler)
    return noise, shown, logged.getvalue(), summary.getvalue()


def test_known_hidden_and_counted_unknown_shown(monkeypatch):
    noise, shown, logged, summary = _run(monkeypatch, verbose=False)
    assert shown == [UNKNOWN_MSG]
    assert "unknown log line" in logged and "Apex" not in logged
    assert noise.total == 3
    assert noise.counts == {"transformer-engine/apex absent": 2, "deprecations": 1}
    assert summary.count("\n") == 1
    assert summary.startswith("[t] 3 known upstream warnings hidden (")
    assert "MEGATRON_TREE_VERBOSE=1" in summary


def test_verbose_shows_everything(monkeypatch):
    noise, shown, logged, summary = _run(monkeypatch, verbose=True)
    assert len(shown) == 3 and UNKNOWN_MSG in shown and KNOWN_MSG in shown
    assert "Apex is not installed" in logged and "unknown log line" in logged
    assert noise.total == 0 and summary == ""


def test_known_stdout_prints_hidden(monkeypatch, capsys):
    monkeypatch.delenv("MEGATRON_TREE_VERBOSE", raising=False)
    summary = io.StringIO()
    with known_upstream_warnings(stream=summary):
        print(" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 5245696")
        print("[1/7] own progress line")
        sys.stdout.write("partial ")
        sys.stdout.write("line\n")
    out = capsys.readouterr().out
    assert out == "[1/7] own progress line\npartial line\n"
    assert "1 known upstream warnings hidden (Megatron info prints: 1)" in summary.getvalue()
