"""Shared pieces of the torch facade tests: a tiny model, its data, and deep comparisons.

The oracle of most tests is a plain torch run without any loss scaling: with loss scales that
are powers of two, scaling and unscaling are exact, so a facade run must reproduce it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import torch

INF = float("inf")
NAN = float("nan")

# One DLS configuration shared by most tests, so the jitted core compiles once per gradient
# structure for the whole suite. A power of two: scaling is exact.
DLS = {"loss_scale": "dynamic", "init_scale": 2.0**8}


class TinyNet(torch.nn.Module):
    """Two linear layers and one parameter set that the forward pass never uses."""

    def __init__(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(4, 3)
        self.fc2 = torch.nn.Linear(3, 2)
        self.unused = torch.nn.Linear(2, 2)  # its grads stay None
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (input, target) pair for ``step``."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(5, 4, generator=generator)
    y = torch.randn(5, 2, generator=generator)
    return x.to(dtype), y.to(dtype)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    """The mean squared error of ``model`` on ``batch(step)`` (in the model's dtype)."""
    dtype = next(model.parameters()).dtype
    x, y = batch(step, dtype)
    return (model(x) - y).square().mean()


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One training step without any loss scaling: the oracle."""
    optimizer.zero_grad()
    loss_of(model, step).backward()
    optimizer.step()


def one_step(
    scaler: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int = 0,
    poison: bool = False,
) -> None:
    """One scaled training step through ``scaler``; ``poison`` puts an inf into a gradient."""
    optimizer.zero_grad()
    scaler.scale(loss_of(model, step)).backward()
    if poison:
        model.fc1.weight.grad[0, 0] = INF
    scaler.step(optimizer)
    scaler.update()


def poison_on(param: torch.Tensor, steps: set[int], counter: list[int]) -> Any:
    """A backward hook that writes an inf into ``param``'s gradient on the given steps."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if counter[0] in steps:
            grad = grad.clone()
            grad.view(-1)[0] = INF
        return grad

    return param.register_hook(hook)


def parameters_of(*models: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for model in models for p in model.parameters()]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor`` (so that NaN equals NaN and -0.0 differs from 0.0)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def assert_tensors_equal(expected: Iterable[torch.Tensor], actual: Iterable[torch.Tensor]) -> None:
    """Bit-identical (same dtype, same values; NaN only where NaN)."""
    expected, actual = list(expected), list(actual)
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert e.dtype == a.dtype, f"tensor {i}: dtype {a.dtype} != {e.dtype}"
        assert e.shape == a.shape, f"tensor {i}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        assert torch.equal(bits(e), bits(a)), f"tensor {i} differs: {a} != {e}"


def deep_equal(a: Any, b: Any) -> bool:
    """Structural equality of nested containers, tensors compared bit for bit (dtype included)."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and list(a.keys()) == list(b.keys())
            and all(deep_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(deep_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(bits(a), bits(b))
        )
    return type(a) is type(b) and a == b


def optimizer_snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A deep copy of ``optimizer.state_dict()``: later steps cannot change it."""
    return copy.deepcopy(optimizer.state_dict())


def state_tensor_count(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        isinstance(v, torch.Tensor) for state in optimizer.state.values() for v in state.values()
    )


# JAX's monitoring events for one backend compilation and one jaxpr trace.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


@contextlib.contextmanager
def jax_compile_events() -> Iterator[list[str]]:
    """Collects the names of JAX's compile-time events (see ``COMPILE_EVENT``) in the block."""
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, timeout: float = 120, **env: str) -> dict:
    """Runs ``code`` in a fresh interpreter (JAX not started yet), without the caller's JAX
    memory settings (plus ``env``); ``code`` prints one JSON line, returned as a dict."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT")}
    environment.pop("XLA_CLIENT_MEM_FRACTION", None)
    environment.update(env)
    environment["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=environment,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def tiny_gpt2(
    *, vocab: int = 64, positions: int = 16, width: int = 32, heads: int = 2, seed: int = 0
) -> torch.nn.Module:
    """A randomly initialised two-layer Hugging Face ``GPT2LMHeadModel`` without dropout, drawn
    from torch's generator at ``seed`` (dropout would make runs that must match differ)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=2, n_head=heads,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def quiet_cpu_training_arguments(output_dir: Any, **overrides: Any) -> Any:
    """Hugging Face ``TrainingArguments`` for a float16 run on the CPU that saves, logs and
    reports nothing (seed 0); ``overrides`` set the rest (batch size, steps, ...)."""
    from transformers import TrainingArguments

    quiet = dict(fp16=True, use_cpu=True, report_to="none", save_strategy="no")
    quiet |= dict(logging_strategy="no", disable_tqdm=True, seed=0)
    return TrainingArguments(output_dir=str(output_dir), **(quiet | overrides))
