"""Policy-gradient fine-tuning of a small GPT in float16 on FSDP2, with the loss scale chosen by
the gradient-range report (the recipe of docs/pytorch/rl-fp16.md).

    torchrun --standalone --nproc-per-node 2 docs/examples/rl_fp16.py --steps 24

Each rank samples completions for its share of the prompts from the current policy, rewards
them, and takes one REINFORCE step with a per-prompt baseline (GRPO-like, without a KL term)
through FSDP2 computing in float16, under ``cstorch.amp.GradScaler``. Before the run, a probe
of float32 backward passes on the initial policy feeds ``cstorch.amp.gradient_range_report``,
which chooses the initial loss scale, its ceiling and the growth window: no guessed constant.
``--init-scale`` and ``--steps-per-increase`` replace the choice by constants, for comparison.
Rank 0 prints one line per step; ``--out DIR`` makes every rank write what it chose and saw to
``DIR/rankR.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import torch_facade as cstorch

VOCAB, PROMPT, COMPLETION = 16, 4, 6  # tokens; the task: completions from the lowest quarter
PROBE_BATCHES = 1_000_000  # the probe's batches are numbered from here


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = (
            z.view(batch, time, self.heads, width // self.heads).transpose(1, 2)
            for z in self.qkv(self.ln1(x)).split(width, dim=-1)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT: token and position embeddings, ``layers`` blocks, a linear head whose
    logits come out in float32."""

    def __init__(self, width: int = 32, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(PROMPT + COMPLETION, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)).float()  # logits in float32, whatever the compute dtype


def prompts_of(step: int, args: argparse.Namespace) -> torch.Tensor:
    """This rank's prompts at ``step`` (the same global batch whatever the number of ranks),
    each repeated ``group`` times: ``[prompts_per_rank * group, PROMPT]``."""
    generator = torch.Generator().manual_seed(args.seed * 100_003 + step)
    world, rank = dist.get_world_size(), dist.get_rank()
    everyone = torch.randint(VOCAB, (args.prompts_per_rank * world, PROMPT), generator=generator)
    mine = everyone[rank * args.prompts_per_rank : (rank + 1) * args.prompts_per_rank]
    return mine.repeat_interleave(args.group, dim=0)


@torch.no_grad()
def rollout(policy: nn.Module, prompts: torch.Tensor, step: int, seed: int) -> torch.Tensor:
    """Completes ``prompts`` by sampling ``COMPLETION`` tokens from ``policy``."""
    generator = torch.Generator().manual_seed(seed * 7919 + 31 * step + dist.get_rank())
    ids = prompts
    for _ in range(COMPLETION):
        probabilities = torch.softmax(policy(ids)[:, -1], dim=-1)
        ids = torch.cat([ids, torch.multinomial(probabilities, 1, generator=generator)], dim=1)
    return ids


def rewards_of(ids: torch.Tensor) -> torch.Tensor:
    """The fraction of completion tokens drawn from the lowest quarter of the vocabulary (a toy
    reward model: about 0.25 for the initial policy, 1 once it has learnt)."""
    return (ids[:, PROMPT:] < VOCAB // 4).float().mean(dim=1)


def policy_loss(
    policy: nn.Module, ids: torch.Tensor, rewards: torch.Tensor, group: int
) -> torch.Tensor:
    """REINFORCE with each prompt's mean reward as baseline: ``-mean(advantage * log p)`` over
    the completion tokens."""
    logits = policy(ids[:, :-1])
    log_p = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    by_prompt = rewards.view(-1, group)
    advantages = (by_prompt - by_prompt.mean(dim=1, keepdim=True)).view(-1, 1)
    return -(advantages * log_p[:, PROMPT - 1 :]).mean()


# --8<-- [start:probe]
def probe_loss_scaling(policy: nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """The dynamic loss scaling of the run, from ``args.probe_steps`` float32 backward passes
    of the initial ``policy`` (whole on every rank, before ``fully_shard``).

    Per probe step, ``gradient_range_report`` suggests the largest power of two that leaves
    ``args.headroom`` doublings between the largest gradient element and float16's largest
    value. The run starts at the smallest suggestion of every probe step on every rank, may
    grow to the scale at which that worst step's largest element would just fit (its ceiling),
    and grows at most once per ``steps / headroom`` steps: it can reach that ceiling no sooner
    than the run's last step.
    """
    suggestions, largest = [], []
    for step in range(args.probe_steps):
        batch = PROBE_BATCHES + step  # probe batches are not training batches
        ids = rollout(policy, prompts_of(batch, args), batch, args.seed)
        policy.zero_grad(set_to_none=True)
        policy_loss(policy, ids, rewards_of(ids), args.group).backward()
        report = cstorch.amp.gradient_range_report(
            policy, half_dtype="float16", headroom=args.headroom
        )
        suggestions.append(report.suggested_loss_scale)
        largest.append(max(float(p.grad.abs().max()) for p in policy.parameters()))
    policy.zero_grad(set_to_none=True)
    lowest = torch.tensor(min(suggestions), dtype=torch.float64)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)  # every rank's local batches
    init_scale = float(lowest)
    if not math.isfinite(init_scale):
        raise RuntimeError("every probe gradient was zero: probe more steps (--probe-steps)")
    return {
        "init_scale": init_scale,
        "max_loss_scale": init_scale * 2.0**args.headroom,
        "steps_per_increase": max(1, math.ceil(args.steps / args.headroom) - 1),
        "probe_suggestions": suggestions,
        "probe_largest": largest,  # this rank's largest gradient element per probe step
    }


# --8<-- [end:probe]


def total_norm(params: list[torch.Tensor]) -> float:
    """torch's own L2 norm of the (sharded) gradients, for comparison with the scaler's."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


# --8<-- [start:train]
def shard_in_float16(policy: nn.Module, scaling: dict[str, Any], lr: float) -> tuple[Any, Any]:
    """``policy`` under FSDP2 computing in float16 (float32 shards, gradients reduced in
    float32), its optimizer, and the scaler configured by :func:`probe_loss_scaling`."""
    half = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in policy.blocks:
        fully_shard(block, mp_policy=half)
    fully_shard(policy, mp_policy=half)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    grad_scaler = cstorch.amp.GradScaler(
        loss_scale="dynamic",
        init_scale=scaling["init_scale"],
        max_loss_scale=scaling["max_loss_scale"],
        steps_per_increase=scaling["steps_per_increase"],
        max_gradient_norm=1.0,
    )
    return optimizer, grad_scaler


def policy_step(
    policy: nn.Module, optimizer: Any, grad_scaler: Any, ids: torch.Tensor, group: int
) -> float:
    """One policy-gradient step on the rollouts ``ids``; returns torch's own norm of the
    unscaled gradients (for comparison with the scaler's ``global_norm``)."""
    optimizer.zero_grad()
    loss = policy_loss(policy, ids, rewards_of(ids), group)
    grad_scaler.scale(loss).backward()
    grad_scaler.unscale_(optimizer)  # the decision, taken once for every rank
    torch_norm = total_norm(list(policy.parameters()))
    grad_scaler.step(optimizer)  # skipped on every rank if any rank overflowed
    grad_scaler.update()
    return torch_norm


# --8<-- [end:train]


def train(args: argparse.Namespace) -> dict[str, Any]:
    """The probe, then ``args.steps`` float16 policy-gradient steps on FSDP2."""
    torch.manual_seed(args.seed)  # the same initial policy on every rank
    policy = GPT()
    scaling = probe_loss_scaling(policy, args)
    if args.init_scale is not None:  # a guessed constant instead, for comparison
        scaling.update(init_scale=args.init_scale, max_loss_scale=args.init_scale)
    if args.steps_per_increase is not None:
        scaling["steps_per_increase"] = args.steps_per_increase
    optimizer, grad_scaler = shard_in_float16(policy, scaling, args.lr)
    rows = []
    for step in range(args.steps):
        ids = rollout(policy, prompts_of(step, args), step, args.seed)
        torch_norm = policy_step(policy, optimizer, grad_scaler, ids, args.group)
        mean_reward = rewards_of(ids).mean()
        dist.all_reduce(mean_reward)
        row = cstorch.amp.scaler_metrics(grad_scaler)
        row.update(step=step, reward=float(mean_reward) / dist.get_world_size())
        row.update(torch_norm=torch_norm)
        rows.append(row)
        if dist.get_rank() == 0:
            print(
                f"step {step:3d}  reward {row['reward']:.3f}  loss scale 2^"
                f"{math.log2(row['loss_scale']):g}  "
                f"{'applied' if row['isfinite'] else 'SKIPPED'}  norm {row['global_norm']:.4g}",
                flush=True,
            )
    return {"scaling": scaling, "steps": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24, help="policy-gradient steps")
    parser.add_argument("--probe-steps", type=int, default=4, help="float32 probe passes")
    parser.add_argument("--headroom", type=int, default=2, help="doublings kept (>= 1)")
    parser.add_argument("--prompts-per-rank", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-scale", type=float, help="a guessed initial scale instead")
    parser.add_argument("--steps-per-increase", type=int, help="a guessed growth window instead")
    parser.add_argument("--out", type=Path, help="write DIR/rankR.json on every rank")
    args = parser.parse_args(argv)
    for name in ("steps", "probe_steps", "headroom", "prompts_per_rank", "group"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # torchrun (or the test) sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        result = train(args)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"rank{dist.get_rank()}.json"
            path.write_text(json.dumps(result, indent=1), encoding="utf-8")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown (gloo and XLA threads): everything is written


if __name__ == "__main__":
    main()
