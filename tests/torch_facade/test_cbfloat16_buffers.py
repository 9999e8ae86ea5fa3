"""The eager preview's reused rounding buffers (``cbfloat16.py``'s ``_Buffers``).

``cbfloat16_numerics`` rounds weights, activations and their gradients into float32 buffers it
keeps from iteration to iteration, so that the steady state allocates none of them. The oracle
for the values is the preview without the pool (``CSTORCH_CBFLOAT16_REUSE_BUFFERS=0``: every
rounded tensor allocated anew, as before the pool), compared bit for bit; the rest checks what reuse
must never do (write into memory something still refers to, keep buffers nothing uses) on the
pool's own count of the buffers it made and holds.
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch

import torch_facade as cstorch
from torch_facade.amp import _cbfloat16_kernel

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fused_loop() -> None:
    """Buffers serve the fused CPU loop's results: it must be there (inductor on this CPU)."""
    assert _cbfloat16_kernel.prepare_fused_rounding()


def _gpt2() -> torch.nn.Module:
    """A tiny Hugging Face GPT-2: a tied embedding, Conv1D's addmm, attention's views."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.config.use_cache = False
    return model


def _tokens(step: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (batch, 16), generator=torch.Generator().manual_seed(step))


def _pool(model: torch.nn.Module) -> Any:
    """The model's buffers, as its parametrizations hold them (inside the context)."""
    owner = next(m for m in model.modules() if hasattr(m, "parametrizations"))
    parametrization = next(iter(owner.parametrizations.values()))[-1]
    return parametrization.pool


def _train(
    model: torch.nn.Module, steps: int, batch: int = 2, first: int = 0
) -> tuple[list[float], list[tuple[int, int]]]:
    """``steps`` AdamW steps of the model (inside the context); the losses, and after each
    step the pool's (buffers made, bytes held)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, counts = [], []
    for step in range(first, first + steps):
        optimizer.zero_grad()
        tokens = _tokens(step, batch)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        pool = _pool(model)
        counts.append((-1, -1) if pool is None else (pool.made, pool.held_bytes()))
    return losses, counts


def test_training_with_reused_buffers_is_bit_identical_to_fresh_ones(monkeypatch):
    """Losses, parameters and gradients after several AdamW steps: the same bits."""
    base = _gpt2()
    runs = []
    for reuse in (False, True):
        monkeypatch.setenv("CSTORCH_CBFLOAT16_REUSE_BUFFERS", "1" if reuse else "0")
        model = copy.deepcopy(base)
        with cstorch.amp.cbfloat16_numerics(model):
            assert (_pool(model) is not None) == reuse
            losses, _ = _train(model, steps=5)
        grads = [p.grad.clone() for p in model.parameters()]
        runs.append((losses, [p.detach().clone() for p in model.parameters()], grads))
    (fresh_losses, fresh_params, fresh_grads), (losses, params, grads) = runs
    assert losses == fresh_losses and len(set(losses)) > 1  # it trains
    assert all(torch.equal(a, b) for a, b in zip(params, fresh_params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads, fresh_grads, strict=True))


def test_the_steady_state_allocates_no_buffer_and_holds_a_constant_amount():
    """After the first iterations no rounding allocates: 20 iterations make no buffer and the
    pool's bytes stay the same (no leak across iterations)."""
    model = _gpt2()
    with cstorch.amp.cbfloat16_numerics(model):
        _, counts = _train(model, steps=20)
    made, held = counts[2]
    assert made > 0 and held > 0
    assert counts[2:] == [(made, held)] * 18, counts


def test_a_tensor_still_referenced_is_never_written():
    """An output the user keeps (and a view of it), a rounded weight read from the module, and
    a gradient kept past ``zero_grad``: later iterations round into other buffers, and what
    was kept keeps its values."""
    model = _gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with cstorch.amp.cbfloat16_numerics(model):
        tokens = _tokens(0)
        out = model(input_ids=tokens, labels=tokens)
        logits, view = out.logits, out.logits[0, 3:]
        weight = model.transformer.h[0].mlp.c_fc.weight  # the rounded weight (a module read)
        kept = [(t, t.detach().clone()) for t in (logits, view, weight)]
        out.loss.backward()
        grad = model.transformer.h[0].attn.c_attn.parametrizations.weight.original.grad
        kept.append((grad, grad.clone()))
        optimizer.step()
        optimizer.zero_grad()  # set to None: the gradient lives on only in ``grad``
        pool = _pool(model)
        made, taken = pool.made, pool.taken
        _train(model, steps=3, first=1)
        assert pool.taken - taken > 3 * (pool.made - made) + 100  # buffers were reused
    for tensor, value in kept:
        assert torch.equal(tensor, value)


def test_buffers_of_sizes_no_longer_used_are_dropped():
    """After the batch size changes, two iterations later the pool holds what a pool that only
    ever saw the new size holds: nothing of the old sizes is kept."""
    model = _gpt2()
    with cstorch.amp.cbfloat16_numerics(model):
        _train(model, steps=3, batch=4)
        _, counts = _train(model, steps=3, batch=2, first=3)
    fresh = _gpt2()
    with cstorch.amp.cbfloat16_numerics(fresh):
        _, fresh_counts = _train(fresh, steps=3, batch=2, first=3)
    assert counts[-1][1] == fresh_counts[-1][1]


def test_exit_releases_the_buffers_and_a_copy_has_its_own():
    """Nothing of the model refers to the pool after exit (an output the user keeps holds its
    own memory, not the pool); a copy of the model made inside the context rounds into a pool
    of its own, with the original's results."""
    model = _gpt2()
    tokens = _tokens(0)
    with cstorch.amp.cbfloat16_numerics(model), torch.no_grad():  # (a graph would hold it)
        pool = weakref.ref(_pool(model))
        logits = model(input_ids=tokens).logits
        twin = copy.deepcopy(model)
        assert _pool(twin) is not pool() and _pool(twin).made == 0
        assert torch.equal(twin(input_ids=tokens).logits, logits)
        assert _pool(twin).made > 0
    del twin
    gc.collect()
    assert pool() is None
    assert logits.isfinite().all()
