"""Hypothesis strategies that several test files share (imports hypothesis: for tests only).

Which examples they draw is fixed by the Hypothesis profile that tests/conftest.py loads ("ci",
derandomized, by default).
"""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def random_tries(draw, max_vocab: int = 6, max_sequences: int = 12, max_tail: int = 9):
    """Lists of token lists grown from earlier ones: shared prefixes, branches, prefixes of one
    another, duplicates. Each sequence copies a drawn prefix (possibly empty or whole) of an earlier
    one, or none, and appends up to ``max_tail`` tokens (at least one when nothing was copied) from
    a vocabulary of 2..``max_vocab`` ids; 1..``max_sequences`` sequences."""
    vocab = draw(st.integers(2, max_vocab))
    sequences: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_sequences))):
        base: list[int] = []
        if sequences and draw(st.booleans()):
            parent = draw(st.sampled_from(sequences))
            base = parent[: draw(st.integers(0, len(parent)))]
        ids = st.integers(0, vocab - 1)
        sequences.append(base + draw(st.lists(ids, min_size=0 if base else 1, max_size=max_tail)))
    return sequences
