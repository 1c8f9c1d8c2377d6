"""Synthetic RL batches with realistic prefix sharing, for benchmarks, demos and tests.

Each generator returns a right-padded batch dict: ``input_ids`` int64 [B, L], ``attention_mask``
int64 [B, L], ``loss_mask`` float32 [B, L] (1 on generated tokens), in a shuffled order so that
packing cannot rely on shared sequences being adjacent.
"""

from __future__ import annotations

import random

import torch


def pad_sequences(
    sequences: list[torch.Tensor], loss_masks: list[torch.Tensor] | None = None
) -> dict:
    """Right-pad 1-D token tensors into a batch dict (``loss_mask`` included when given)."""
    if not sequences:
        raise ValueError("sequences is empty; pass at least one 1-D token tensor")
    width = max(len(s) for s in sequences)
    batch = {
        "input_ids": torch.zeros(len(sequences), width, dtype=torch.int64),
        "attention_mask": torch.zeros(len(sequences), width, dtype=torch.int64),
    }
    if loss_masks is not None:
        batch["loss_mask"] = torch.zeros(len(sequences), width, dtype=torch.float32)
    for i, seq in enumerate(sequences):
        batch["input_ids"][i, : len(seq)] = seq
        batch["attention_mask"][i, : len(seq)] = 1
        if loss_masks is not None:
            batch["loss_mask"][i, : len(seq)] = loss_masks[i]
    return batch


def random_trie_sequences(seed: int, num_sequences: int, max_len: int) -> list[torch.Tensor]:
    """Random sequences with much sharing, for property tests: each one copies a random prefix of an
    earlier one (possibly empty or whole) and appends 1-39 tokens from {0, 1, 2}, cut at
    ``max_len``."""
    g = torch.Generator().manual_seed(seed)
    seqs: list[torch.Tensor] = []
    for _ in range(num_sequences):
        base = (
            seqs[int(torch.randint(len(seqs), (), generator=g))]
            if seqs
            else torch.zeros(0, dtype=torch.int64)
        )
        cut = int(torch.randint(len(base) + 1, (), generator=g))
        tail = torch.randint(0, 3, (int(torch.randint(1, 40, (), generator=g)),), generator=g)
        seqs.append(torch.cat([base[:cut], tail])[:max_len])
    return seqs


def _shuffled(sequences, loss_masks, generator):
    perm = torch.randperm(len(sequences), generator=generator).tolist()
    return pad_sequences([sequences[i] for i in perm], [loss_masks[i] for i in perm])


def grpo_batch(
    *,
    num_prompts: int = 8,
    samples_per_prompt: int = 8,
    prompt_len: int = 512,
    response_len: tuple[int, int] = (64, 128),
    vocab_size: int = 32000,
    seed: int = 0,
) -> dict:
    """``num_prompts`` prompts, each followed by ``samples_per_prompt`` independent responses.

    Response lengths are uniform in ``[response_len[0], response_len[1]]``.
    """
    g = torch.Generator().manual_seed(seed)
    sequences, loss_masks = [], []
    for _ in range(num_prompts):
        prompt = torch.randint(0, vocab_size, (prompt_len,), generator=g)
        for _ in range(samples_per_prompt):
            n = int(torch.randint(response_len[0], response_len[1] + 1, (), generator=g))
            sequences.append(torch.cat([prompt, torch.randint(0, vocab_size, (n,), generator=g)]))
            loss_masks.append(torch.cat([torch.zeros(prompt_len), torch.ones(n)]))
    return _shuffled(sequences, loss_masks, g)


def multi_turn_batch(
    *,
    num_tasks: int = 4,
    rollouts_per_task: int = 4,
    turns: int | tuple[int, int] = 4,
    system_len: int = 256,
    task_len: int = 128,
    observation_len: tuple[int, int] = (32, 96),
    action_len: tuple[int, int] = (32, 128),
    vocab_size: int = 32000,
    seed: int = 0,
) -> dict:
    """Agent trajectories where every turn extends the one before it.

    One system prompt is shared by all tasks; each task prompt by its rollouts. A rollout of
    ``turns`` turns yields one sequence per turn (the whole history up to and including that turn's
    action), so every earlier turn's sequence is a prefix of the later ones. ``turns`` is a fixed
    count or ``(min, max)``, drawn uniformly per rollout.
    """
    g = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(0, vocab_size, (n,), generator=g)

    def length(bounds):
        return int(torch.randint(bounds[0], bounds[1] + 1, (), generator=g))

    if isinstance(turns, int):
        turns = (turns, turns)
    if not (1 <= turns[0] <= turns[1]):
        raise ValueError(
            f"turns={turns} must be an int >= 1 or a (min, max) pair with 1 <= min <= max"
        )
    system = tokens(system_len)
    sequences, loss_masks = [], []
    for _ in range(num_tasks):
        task = torch.cat([system, tokens(task_len)])
        for _ in range(rollouts_per_task):
            history, mask = task, torch.zeros(len(task))
            num_turns = turns[0] if turns[0] == turns[1] else length(turns)
            for turn in range(num_turns):
                if turn > 0:
                    obs = tokens(length(observation_len))
                    history, mask = (
                        torch.cat([history, obs]),
                        torch.cat([mask, torch.zeros(len(obs))]),
                    )
                action = tokens(length(action_len))
                history, mask = (
                    torch.cat([history, action]),
                    torch.cat([mask, torch.ones(len(action))]),
                )
                sequences.append(history)
                loss_masks.append(mask)
    return _shuffled(sequences, loss_masks, g)


def agent_batch(*, seed: int = 95, **overrides) -> dict:
    """A multi-turn agent batch too large for one 8K-token tree: one 300-token system prompt shared
    by 6 tasks, 4 rollouts per task of 2-5 turns each (90 sequences, 65.5K tokens, 12.7K unique
    with the default seed); ``overrides`` go to :func:`multi_turn_batch`."""
    kwargs = dict(num_tasks=6, rollouts_per_task=4, turns=(2, 5), system_len=300, seed=seed)
    return multi_turn_batch(**{**kwargs, **overrides})


def rl_batch(seqs: list[torch.Tensor], *, response_start: int = 5, seed: int = 11) -> dict:
    """The padded batch of the step tests: ``seqs`` right-padded, a rolled ``loss_mask`` on the
    entries about tokens ``response_start + 1..`` of each sequence (none at its end), random
    ``old_logprobs``, per-sequence ``advantages`` and per-token ``returns`` [B, L]."""
    batch = pad_sequences(seqs)
    b, width = batch["input_ids"].shape
    g = torch.Generator().manual_seed(seed)
    lengths = batch["attention_mask"].sum(1)
    pos = torch.arange(width)[None]
    batch["loss_mask"] = ((pos >= response_start) & (pos < (lengths - 1)[:, None])).float()
    batch["old_logprobs"] = -3 * torch.rand(b, width, generator=g) - 3.5
    batch["advantages"] = torch.randn(b, 1, generator=g).expand(b, width).contiguous()
    batch["returns"] = torch.randn(b, width, generator=g)
    return batch


def long_history_sequences(
    *,
    history_len: int = 24000,
    num_tasks: int = 10,
    task_len: tuple[int, int] = (200, 600),
    second_turn_every: int = 3,
    vocab_size: int = 1024,
    seed: int = 7,
) -> list[torch.Tensor]:
    """A long shared history (an agent's context) with ``num_tasks`` tasks below it; every
    ``second_turn_every``-th task also has a second turn (an observation of 50-150 tokens and an
    action of 100-300). Token ids in [1, vocab_size)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(1, vocab_size, (n,), generator=g)

    history = tokens(history_len)
    seqs = []
    for i in range(num_tasks):
        first = torch.cat([history, tokens(rng.randint(*task_len))])
        seqs.append(first)
        if i % second_turn_every == 0:
            seqs.append(
                torch.cat([first, tokens(rng.randint(50, 150)), tokens(rng.randint(100, 300))])
            )
    return seqs
