"""Rollouts a chat model samples itself: GRPO groups, a second turn that shares the first, a reward
that can be checked, and the padded batch that ``build_packed_tree_batch`` packs.

The examples and benchmarks on the real model (``examples/tree_vs_baseline.py``,
``examples/grpo_loop.py --model smollm2``, ``scripts/bench_trl.py`` / ``bench_verl.py
--model smollm2``) draw their batches here, so they train on the same kind of data.
"""

from __future__ import annotations

import random
import re
import sys
import time
from dataclasses import dataclass

import torch


class ProgressBar:
    """A progress bar on stderr: redrawn in place on a terminal, else a line per quarter (logs)."""

    def __init__(self, total: int, label: str, width: int = 30):
        if total < 1:
            raise ValueError(f"total={total} must be >= 1")
        self.total, self.label, self.width = total, label, width
        self.done, self.t0, self._quarter = 0, time.perf_counter(), 0
        self.tty = sys.stderr.isatty()

    def update(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if self.tty:
            self._draw("\r", "")
        elif self.done * 4 // self.total > self._quarter:
            self._quarter = self.done * 4 // self.total
            self._draw("", "\n")

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
        elif self._quarter < 4:
            self._draw("", "\n")

    def _draw(self, start: str, end: str) -> None:
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        took = time.perf_counter() - self.t0
        sys.stderr.write(
            f"{start}{self.label} [{bar}] {self.done}/{self.total} ({took:.1f} s){end}"
        )
        sys.stderr.flush()


@torch.no_grad()
def sample(
    model,
    prompts: torch.Tensor,
    max_new: int,
    eos: int,
    pad: int,
    *,
    g: torch.Generator | None,
    greedy: bool = False,
    progress: ProgressBar | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample (temperature 1, or greedy) up to ``max_new`` tokens after equal-length ``prompts``
    [B, P] with a HuggingFace causal LM's KV cache.

    Returns:
        responses [B, max_new] (``pad`` after EOS), lengths [B] (EOS included), and the sampler's
        log-prob of each response token [B, max_new] (float64; 0 after the end).
    """
    if max_new < 1:
        raise ValueError(f"max_new={max_new} must be >= 1")
    out = model(input_ids=prompts, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    b = prompts.shape[0]
    done = torch.zeros(b, dtype=torch.bool)
    lengths = torch.zeros(b, dtype=torch.long)
    tokens, logps = [], []
    for t in range(max_new):
        logp = torch.log_softmax(logits.double(), -1)
        if greedy:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(logp.exp(), 1, generator=g)[:, 0]
        logps.append(torch.where(done, 0.0, logp.gather(1, nxt[:, None])[:, 0]))
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        lengths += (~done).long()
        tokens.append(nxt)
        done |= nxt == eos
        if progress is not None:
            progress.update()
        if bool(done.all()) or t == max_new - 1:
            break
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    if progress is not None:
        progress.update(max_new - len(tokens))  # the steps an early stop skipped
    responses = torch.full((b, max_new), pad, dtype=torch.long)
    responses[:, : len(tokens)] = torch.stack(tokens, 1)
    sampled_logprobs = torch.zeros(b, max_new, dtype=torch.float64)
    sampled_logprobs[:, : len(tokens)] = torch.stack(logps, 1)
    return responses, lengths, sampled_logprobs


@dataclass(frozen=True)
class Question:
    """One user turn and the integer its answer must state."""

    text: str
    answer: int


@dataclass(frozen=True)
class AdditionTask:
    """Short additions with a checkable reward.

    A first turn asks ``What is a + b?`` (operands 1..``max_operand``); a second turn asks to add
    one more number to that result. The reward of a response: 0.5 for ending its turn within the
    token budget, 0.5 more when the last number it states is then the answer; 0 for a response that
    runs past the budget. At temperature 1, SmolLM2-135M-Instruct ends about one sampled turn in
    three within 32 tokens and answers right in about one in eight, so GRPO has something to learn.
    """

    max_operand: int = 9

    _NUMBER = re.compile(r"-?\d+")

    def __post_init__(self):
        if self.max_operand < 1:
            raise ValueError(f"max_operand={self.max_operand} must be >= 1")

    def draw(self, n: int, rng: random.Random) -> list[Question]:
        pairs = [
            (rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)) for _ in range(n)
        ]
        return [Question(f"What is {a} + {b}?", a + b) for a, b in pairs]

    def follow_up(self, question: Question, rng: random.Random) -> Question:
        c = rng.randint(1, self.max_operand)
        return Question(f"Now add {c} to that.", question.answer + c)

    def reward(self, text: str, ended: bool, question: Question) -> float:
        numbers = self._NUMBER.findall(text)
        if not ended:
            return 0.0
        return 1.0 if numbers and int(numbers[-1]) == question.answer else 0.5


@dataclass
class Rollout:
    """One sampled sequence: token ids of its prompt (the whole conversation before the sampled
    turn) and of its response, whether the response ended its turn, its reward and group."""

    group: int
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    ended: bool
    text: str
    reward: float


class ChatRollouts:
    """GRPO groups sampled by a HuggingFace chat model with its tokenizer's chat template.

    ``tokenizer`` must name the end-of-turn token as its EOS (the converted SmolLM2 checkpoint
    does: :func:`megatron_tree.demo.pretrained.smollm2_checkpoint`).
    """

    def __init__(self, model, tokenizer, task: AdditionTask, max_new_tokens: int):
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "the tokenizer names no EOS token: set tokenizer.eos_token to the end-of-turn token"
            )
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.max_new_tokens = max_new_tokens
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos

    def _chat(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def _group(
        self, group: int, prompt: list[int], question: Question, n: int, g, bar, greedy: bool
    ) -> list[Rollout]:
        responses, lengths, logps = sample(
            self.model,
            torch.tensor([prompt] * n),
            self.max_new_tokens,
            self.eos,
            self.pad,
            g=g,
            greedy=greedy,
            progress=bar,
        )
        out = []
        for row in range(n):
            ids = responses[row, : int(lengths[row])].tolist()
            ended = bool(ids) and ids[-1] == self.eos
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append(
                Rollout(
                    group,
                    prompt,
                    ids,
                    logps[row, : len(ids)].tolist(),
                    ended,
                    text,
                    self.task.reward(text, ended, question),
                )
            )
        return out

    def sample(
        self,
        questions: list[Question],
        samples: int,
        *,
        seed: int,
        second_turn_samples: int = 0,
        greedy: bool = False,
        label: str = "sampling",
    ) -> list[Rollout]:
        """``samples`` responses to each question (group i: question i), then, when
        ``second_turn_samples`` > 0, a second turn per question: the conversation so far (the
        question and its best-rewarded first response, one that ended its turn where there is one)
        and a follow-up question, answered ``second_turn_samples`` times (group len(questions) + i).

        A second turn's prompt starts with the whole first-turn sequence it continues, so the tree
        shares it. Sampling is seeded by ``seed`` alone (``greedy``: the most likely token at each
        step instead). A progress bar counts decoding steps.
        """
        if samples < 1 or second_turn_samples < 0:
            raise ValueError(
                f"samples={samples} must be >= 1 and second_turn_samples={second_turn_samples} >= 0"
            )
        g = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        groups = len(questions) * (2 if second_turn_samples else 1)
        bar = ProgressBar(groups * self.max_new_tokens, label)
        rollouts: list[Rollout] = []
        firsts = []
        for i, q in enumerate(questions):
            messages = [{"role": "user", "content": q.text}]
            group = self._group(i, self._chat(messages), q, samples, g, bar, greedy)
            rollouts += group
            firsts.append((messages, q, group))
        for i, (messages, q, group) in enumerate(firsts if second_turn_samples else []):
            best = max(group, key=lambda r: (r.ended, r.reward))
            follow = self.task.follow_up(q, rng)
            # The first turn's sequence as sampled (the end-of-turn token closes it, appended where
            # the response ran past the budget), then the template's next user turn.
            first = best.prompt + best.response + ([] if best.ended else [self.eos])
            full = self._chat(
                messages
                + [
                    {"role": "assistant", "content": best.text},
                    {"role": "user", "content": follow.text},
                ]
            )
            # The template re-renders the first answer; keep the tokens the model sampled and take
            # the template's tokens after the end of that answer's turn (its second-to-last EOS).
            prompt = first + full[_after_nth_last(full, self.eos, 2) :]
            rollouts += self._group(
                len(questions) + i, prompt, follow, second_turn_samples, g, bar, greedy
            )
        bar.close()
        return rollouts


def _after_nth_last(ids: list[int], token: int, n: int) -> int:
    """The index just past the ``n``-th last ``token`` in ``ids``."""
    where = [i for i, t in enumerate(ids) if t == token]
    if len(where) < n:
        raise ValueError(
            f"the chat template's rendering has {len(where)} end-of-turn tokens, fewer than {n}: "
            "the tokenizer's EOS must be the token that ends each turn"
        )
    return where[-n] + 1


def rollout_batch(rollouts: list[Rollout], pad: int) -> dict:
    """The padded GRPO batch of ``rollouts`` (each a row, in order): ``input_ids`` /
    ``attention_mask`` / rolled ``loss_mask`` (entry t weights the prediction of token t + 1, a
    response token) / ``advantages`` / rolled ``rollout_logprobs`` (the sampler's), all [B, L].

    GRPO advantages: each reward minus its group's mean, over the group's standard deviation
    (+1e-4: a group whose samples all score the same gets 0). A group of one gets 0.
    """
    if not rollouts:
        raise ValueError("rollout_batch needs at least one rollout")
    width = max(len(r.prompt) + len(r.response) for r in rollouts)
    b = len(rollouts)
    ids = torch.full((b, width), pad, dtype=torch.long)
    attention_mask = torch.zeros(b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width, dtype=torch.float32)
    rollout_logprobs = torch.zeros(b, width, dtype=torch.float32)
    for row, r in enumerate(rollouts):
        p, n = len(r.prompt), len(r.prompt) + len(r.response)
        ids[row, :n] = torch.tensor(r.prompt + r.response)
        attention_mask[row, :n] = 1
        loss_mask[row, p - 1 : n - 1] = 1.0
        rollout_logprobs[row, p - 1 : n - 1] = torch.tensor(r.logprobs)
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
    groups = torch.tensor([r.group for r in rollouts])
    adv = torch.zeros(b, dtype=torch.float64)
    for gid in groups.unique():
        members = groups == gid
        if int(members.sum()) > 1:
            vals = rewards[members]
            adv[members] = (vals - vals.mean()) / (vals.std() + 1e-4)
    return {
        "input_ids": ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "advantages": adv.float()[:, None].expand(b, width).contiguous(),
        "rollout_logprobs": rollout_logprobs,
    }
