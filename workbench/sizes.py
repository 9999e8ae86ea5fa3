"""Benchmark sizes, their models, and gradients produced once by a real backward pass.

Every size is a GPT-2-like stack of ``Embedding``/``LayerNorm``/``Linear`` modules with a tied
output head, trained with a next-token cross-entropy loss on random tokens
(:func:`next_token_loss`). The whole-iteration section trains that model (:func:`model_spec`);
the scaler-only section saves the gradients of one backward pass and copies them back into
``.grad`` before every timed step. For the scaler-only section the ``tiny`` size has the tensor
count of ``M`` with one element per tensor (its gradients come from a backward pass through a small
element-wise loss); for the whole iteration it is ``M``'s layout at width 16. Both expose the fixed
per-step cost.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class SizeSpec:
    """One benchmark size.

    Attributes:
        name: short name used on the command line and in the tables (``S``, ``M``, ``L``, ``tiny``).
        d_model: model width.
        layers: transformer blocks.
        vocab: vocabulary size (the embedding is tied to the output head).
        context: positional-embedding rows.
        split_qkv: separate query/key/value projections (16 tensors per block) instead of one fused
            projection (12 tensors per block, as GPT-2).
        iters: timed steps per variant and round (the round's value is their median).
        tiny: one element per tensor, with the tensor names of the sized model.
    """

    name: str
    d_model: int
    layers: int
    vocab: int
    context: int
    split_qkv: bool
    iters: int
    tiny: bool = False


SIZES: dict[str, SizeSpec] = {
    # 20 tensors, 1.07M parameters.
    "S": SizeSpec("S", d_model=256, layers=1, vocab=1024, context=64, split_qkv=True, iters=20),
    # 148 tensors, 28.0M parameters (GPT-2 layout at d=384).
    "M": SizeSpec("M", d_model=384, layers=12, vocab=16384, context=1024, split_qkv=False, iters=5),
    # 292 tensors, 124M parameters.
    "L": SizeSpec("L", d_model=640, layers=24, vocab=8192, context=1024, split_qkv=False, iters=3),
    # M's 148 tensors, one element each.
    "tiny": SizeSpec(
        "tiny",
        d_model=384,
        layers=12,
        vocab=16384,
        context=1024,
        split_qkv=False,
        iters=20,
        tiny=True,
    ),
}
"""Known sizes, by name."""

FULL_SIZES = ("S", "M", "tiny")
"""What ``python -m benchmarks --full`` runs without ``--sizes`` (the documented numbers);
``--large`` adds ``L``."""

QUICK_SIZES = ("S",)
"""What ``python -m benchmarks`` (``make bench``) runs without ``--sizes``: minutes, not a
quarter of an hour. ``tiny`` (the fixed cost of 148 tensors) is left to ``--full``: the quick
run's host section measures that cost on 148 one-element gradients, and XLA compiles the jax
section's gated floor over ``tiny``'s 148 one-element leaves for minutes."""

DEFAULT_SIZES = QUICK_SIZES

_TOKENS = 64  # sequence length of the single backward pass

TINY_WIDTH = 16
"""Width, vocabulary and context of the ``tiny`` size's model in the whole-iteration section."""

FLUSH_BELOW = 2.0**-58
"""Gradient values smaller than this in magnitude are set to zero once, after the backward pass.

torch's CPU kernels slow down many times on denormal operands and results (the factor measured:
``docs/performance-notes.md``) while XLA flushes them to zero (``../shared/PERFORMANCE.md`` item 9). With ``|g| >= 2**-58``, AdamW's first second moment
``(1 - 0.999) * g**2`` and SGD's ``lr * g`` (``lr = 1e-12``) stay normal float32 numbers.
"""


class _Block(nn.Module):
    """A pre-norm transformer block (causal self-attention and a 4x MLP)."""

    def __init__(self, d_model: int, split_qkv: bool) -> None:
        super().__init__()
        self.heads = max(1, d_model // 64)
        self.ln_1 = nn.LayerNorm(d_model)
        if split_qkv:
            self.q = nn.Linear(d_model, d_model)
            self.k = nn.Linear(d_model, d_model)
            self.v = nn.Linear(d_model, d_model)
        else:
            self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.split_qkv = split_qkv
        self.attn_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the block to ``x`` of shape ``(batch, tokens, d_model)``."""
        h = self.ln_1(x)
        if self.split_qkv:
            q, k, v = self.q(h), self.k(h), self.v(h)
        else:
            q, k, v = self.c_attn(h).chunk(3, dim=-1)
        batch, tokens, width = h.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2)

        attn = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.attn_proj(attn.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPTLike(nn.Module):
    """A GPT-2-like language model with a tied embedding and output head.

    Args:
        spec: the size to build (``spec.tiny`` is ignored here).
    """

    def __init__(self, spec: SizeSpec) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab, spec.d_model)
        self.wpe = nn.Embedding(spec.context, spec.d_model)
        self.blocks = nn.ModuleList(
            _Block(spec.d_model, spec.split_qkv) for _ in range(spec.layers)
        )
        self.ln_f = nn.LayerNorm(spec.d_model)
        for module in self.modules():  # GPT-2 initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, tokens, vocab)`` for integer ``tokens``."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T


def model_spec(spec: SizeSpec) -> SizeSpec:
    """The spec of the model that ``spec``'s whole iterations train.

    ``spec`` itself, except for ``tiny``: ``M``'s layers and layout at width, vocabulary and
    context :data:`TINY_WIDTH` (a real model with ``M``'s tensor count and almost no arithmetic).

    Example:
        >>> from workbench.sizes import SIZES, model_spec, parameter_count
        >>> model_spec(SIZES["S"]) == SIZES["S"], parameter_count(model_spec(SIZES["tiny"]))
        (True, 39904)
    """
    if not spec.tiny:
        return spec
    return dataclasses.replace(
        spec, d_model=TINY_WIDTH, vocab=TINY_WIDTH, context=TINY_WIDTH, tiny=False
    )


def random_tokens(
    spec: SizeSpec, batch: int, tokens: int, generator: torch.Generator
) -> torch.Tensor:
    """Random token ids of shape ``(batch, tokens + 1)``: inputs and their next-token targets."""
    return torch.randint(0, spec.vocab, (batch, tokens + 1), generator=generator)


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of ``model`` (a :class:`GPTLike`, possibly wrapped) on
    ``tokens`` of shape ``(batch, n + 1)``."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@dataclasses.dataclass
class GradientSet:
    """Parameters and the gradients of one real backward pass, for one size.

    Attributes:
        names: parameter names, in optimizer order.
        values: the parameter values (float32, contiguous).
        grads: the gradients, same shapes (float32, contiguous, all finite).
        loss: the loss value of the backward pass.
        flushed: how many gradient values below ``FLUSH_BELOW`` in magnitude were set to zero.
    """

    names: list[str]
    values: list[torch.Tensor]
    grads: list[torch.Tensor]
    loss: float
    flushed: int

    @property
    def tensors(self) -> int:
        """Number of parameter tensors."""
        return len(self.values)

    @property
    def numel(self) -> int:
        """Total number of parameters."""
        return sum(v.numel() for v in self.values)

    def new_parameters(self) -> list[nn.Parameter]:
        """Fresh copies of the parameters, each with a copy of its gradient in ``.grad``."""
        params = []
        for value, grad in zip(self.values, self.grads, strict=True):
            param = nn.Parameter(value.clone())
            param.grad = grad.clone()
            params.append(param)
        return params


def shape_list(spec: SizeSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of ``spec``'s model (one element per tensor for ``tiny``).

    Example:
        >>> from workbench.sizes import SIZES, shape_list
        >>> len(shape_list(SIZES["S"])), len(shape_list(SIZES["tiny"])) == len(shape_list(SIZES["M"]))
        (20, True)
    """
    with torch.device("meta"):
        model = GPTLike(spec)
    return [(n, (1,) if spec.tiny else tuple(p.shape)) for n, p in model.named_parameters()]


def parameter_count(spec: SizeSpec) -> int:
    """Total parameters of ``spec`` without allocating them.

    Example:
        >>> from workbench.sizes import SIZES, parameter_count
        >>> parameter_count(SIZES["S"])
        1068800
    """
    return sum(math.prod(shape) for _, shape in shape_list(spec))


def make_gradients(spec: SizeSpec, seed: int = 0) -> GradientSet:
    """Builds ``spec``'s parameters and runs one forward and backward pass to get gradients.

    Args:
        spec: the size.
        seed: seeds the initialisation, the tokens and the tiny loss.

    Returns:
        The parameters and their gradients (detached copies).

    Raises:
        RuntimeError: a gradient is missing or not finite (never expected).
    """
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if spec.tiny:
        names = [name for name, _ in shape_list(spec)]
        params = [nn.Parameter(torch.randn(1, generator=generator)) for _ in names]
        a = torch.randn(len(params), generator=generator)
        b = torch.randn(len(params), generator=generator)
        loss = sum((torch.tanh(p * a[i]) * b[i]).sum() for i, p in enumerate(params)) + sum(
            (p * p).sum() for p in params
        )
    else:
        model = GPTLike(spec)
        names = [name for name, _ in model.named_parameters()]
        params = list(model.parameters())
        loss = next_token_loss(model, random_tokens(spec, 2, _TOKENS, generator))
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    grads = []
    flushed = 0
    for name, param in zip(names, params, strict=True):
        if param.grad is None or not bool(torch.isfinite(param.grad).all()):
            raise RuntimeError(f"gradient of {name} is missing or not finite")
        grad = param.grad.detach().clone().contiguous()
        small = (grad != 0) & (grad.abs() < FLUSH_BELOW)
        flushed += int(small.sum())
        grads.append(grad.masked_fill_(small, 0.0))
    values = [p.detach().clone().contiguous() for p in params]
    return GradientSet(names, values, grads, float(loss.detach()), flushed)
