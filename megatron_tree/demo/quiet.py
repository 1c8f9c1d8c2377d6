"""Hide *known* upstream noise (warnings, log records, a few bare prints) behind one summary line.

The main job (``examples/tree_vs_baseline.py``) imports Megatron-Core, mbridge, transformers and
torch; on a machine without transformer-engine/apex they emit a wall of well-understood warnings
before the job's first own line. :func:`known_upstream_warnings` suppresses only messages that match
:data:`KNOWN` (a regex and a category label each), counts them, and at the end prints one line::

    [demo] 9 known upstream warnings hidden (transformer-engine/apex absent: 7, deprecations: 1,
    ...);
    set MEGATRON_TREE_VERBOSE=1 to show them

Anything that does not match is shown exactly as before: unknown warnings are never hidden. With
``MEGATRON_TREE_VERBOSE=1`` nothing is filtered at all.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator

from ..patches._scoped import swapped

VERBOSE_ENV = "MEGATRON_TREE_VERBOSE"

# (category label, regex searched in the message text). Keep these specific: a broad pattern would
# hide warnings we have not looked at.
KNOWN: list[tuple[str, str]] = [
    ("transformer-engine/apex absent", r"Transformer Engine and Apex are not installed"),
    ("transformer-engine/apex absent", r"\bApex is not installed\b"),
    (
        "transformer-engine/apex absent",
        r"[Tt]ransformer[- _][Ee]ngine (is )?not (installed|available|found)",
    ),
    ("transformer-engine/apex absent", r"No module named '(transformer_engine|apex)'"),
    ("deprecations", r"full scope is deprecated"),
    ("deprecations", r"GPTModel IS DEPRECATED"),
    ("deprecations", r"is_fx_tracing"),
    ("deprecations", r"torch\.utils\._pytree\._register_pytree_node is deprecated"),
    ("deprecations", r"`torch_dtype` is deprecated"),
    ("deprecations", r"pkg_resources is deprecated"),
    ("setuptools notices", r"BuildBackendWarning|Editable installation"),
    (
        "Megatron info prints",
        r"^\s*> number of parameters on \(tensor, pipeline\) model parallel rank",
    ),
]


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


class KnownNoise:
    """Matches messages against the known patterns and counts what it hid, per category."""

    def __init__(self, known=None):
        self.known = [(label, re.compile(p)) for label, p in (KNOWN if known is None else known)]
        self.counts: collections.Counter[str] = collections.Counter()

    def match(self, text: str) -> str | None:
        for label, pattern in self.known:
            if pattern.search(text):
                return label
        return None

    def hide(self, text: str) -> bool:
        label = self.match(text)
        if label is None:
            return False
        self.counts[label] += 1
        return True

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self, prefix: str = "[demo]") -> str:
        parts = ", ".join(f"{label}: {n}" for label, n in self.counts.most_common())
        return (
            f"{prefix} {self.total} known upstream warnings hidden ({parts}); set {VERBOSE_ENV}=1 "
            "to show them"
        )


def _shown(record: logging.LogRecord, noise: KnownNoise) -> bool:
    try:
        text = record.getMessage()
    except Exception:  # a malformed record is not ours to judge: show it
        return True
    return not noise.hide(text)


class _LineFilter(io.TextIOBase):
    """Wraps a text stream; drops whole lines that match a known pattern, passes the rest
    through."""

    def __init__(self, stream, noise: KnownNoise):
        self.stream, self.noise, self.pending = stream, noise, ""

    def write(self, s: str) -> int:
        self.pending += s
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not self.noise.hide(line):
                self.stream.write(line + "\n")
        return len(s)

    def flush(self) -> None:
        if self.pending and not self.noise.hide(self.pending):
            self.stream.write(self.pending)
        self.pending = ""
        self.stream.flush()

    def __getattr__(self, name):  # fileno, encoding, isatty, ... of the wrapped stream
        return getattr(self.stream, name)


@contextlib.contextmanager
def known_upstream_warnings(
    prefix: str = "[demo]", report: bool = True, stream=None, filter_stdout: bool = True
) -> Iterator[KnownNoise]:
    """Hide known upstream warnings/log records/prints inside the block; print one summary line
    after.

    ``report`` False skips the summary (e.g. on ranks other than 0). Unknown messages are shown.
    With ``MEGATRON_TREE_VERBOSE=1`` nothing is hidden and no summary is printed.
    """
    noise = KnownNoise()
    if verbose():
        yield noise
        return
    original_showwarning = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if noise.hide(str(message)):
            return
        original_showwarning(message, category, filename, lineno, file, line)

    # A filter on the root logger does not see records that propagate up from child loggers, and
    # upstream libraries add loggers and handlers at import time; so filter where every record
    # passes
    # once: Logger.handle on the logger that made it (restored on exit).
    original_handle = logging.Logger.handle

    def handle(self, record):
        if _shown(record, noise):
            original_handle(self, record)

    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(swapped(warnings, showwarning=showwarning))
            stack.enter_context(swapped(logging.Logger, handle=handle))
            if filter_stdout:
                stack.enter_context(swapped(sys, stdout=_LineFilter(sys.stdout, noise)))
                stack.callback(
                    lambda: sys.stdout.flush()
                )  # the filter's last line, before stdout is restored
            yield noise
    finally:
        if report and noise.total:
            print(noise.summary(prefix), file=stream or sys.stderr, flush=True)
