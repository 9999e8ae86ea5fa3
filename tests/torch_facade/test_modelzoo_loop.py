"""A ModelZoo-style training run, written from the structure of its trainer (no ModelZoo code).

ModelZoo (2.3 to 2.10) configures mixed precision in a YAML ``precision:`` block that its
``MixedPrecision`` callback turns into ``cstorch.amp`` calls: ``enable_mixed_precision``,
``set_half_dtype(fp16_type)``, ``GradScaler(loss_scale=loss_scaling_factor,
init_scale=initial_loss_scale, steps_per_increase=, min_loss_scale=, max_loss_scale=)``; then
per batch ``autocast()`` for the forward pass, ``scale(loss).backward()``, ``unscale_``,
torch's ``clip_grad_norm_`` (or ``clip_grad_value_``), ``step``, ``update``, with ``get_scale()``
and ``get_non_clamped_scale()`` logged and the scaler's state saved under ``"grad_scaler"``.
Its models ask ``get_floating_point_dtype_str()`` for their embedding dtype. ModelZoo 2.0 to 2.2
read the same keys from the ``optimizer:`` block and called
``optimizer_step(loss, optimizer, grad_scaler, max_gradient_norm=, max_gradient_value=)``.

Oracles: hand-computed scale traces (SPEC section 2), a checkpoint-and-resume run against the
uninterrupted run (bit for bit), and for ``optimizer_step`` the same steps written out with
torch's ``clip_grad_norm_``/``clip_grad_value_``.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from facade_helpers import INF, assert_tensors_equal, deep_equal

import torch_facade as cstorch

# A ModelZoo 2.10 ``trainer.init.precision`` block, as its YAML loader gives it.
PRECISION = {
    "enabled": True,
    "fp16_type": "float16",
    "loss_scaling_factor": "dynamic",
    "initial_loss_scale": 2.0**10,
    "steps_per_increase": 3,
    "min_loss_scale": 2.0**-10,
    "max_loss_scale": 2.0**12,
    "max_gradient_norm": 1.0,
    "log_loss_scale": True,
}
STEPS = 10
FAULTS = {2, 6, 7}  # batches whose gradients overflow
# After each step, by SPEC section 2 (tolerance 0; doubling on the 4th update after a rescale;
# capped at max_loss_scale): (get_scale(), get_non_clamped_scale())
SCALE_TRACE = [
    (2.0**10, 2.0**10),
    (2.0**10, 2.0**10),
    (2.0**9, 2.0**9),  # overflow: halve, counters reset
    (2.0**9, 2.0**9),
    (2.0**9, 2.0**9),
    (2.0**9, 2.0**9),
    (2.0**8, 2.0**8),  # the 4th update after the rescale overflows: halve instead of double
    (2.0**7, 2.0**7),
    (2.0**7, 2.0**7),
    (2.0**7, 2.0**7),
]

_EMBEDDING_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "cbfloat16": torch.float16,  # its proxy
}


class TinyLM(torch.nn.Module):
    """An embedding and a head; the embedding computes in the dtype ModelZoo's models ask for.

    The parameters stay float32 (master weights); the embedding's output is cast to the dtype
    ``get_floating_point_dtype_str()`` names, as an activation in the half dtype.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embedding_dtype = _EMBEDDING_DTYPES[cstorch.amp.get_floating_point_dtype_str()]
        generator = torch.Generator().manual_seed(0)
        self.embedding = torch.nn.Embedding(11, 8)
        self.head = torch.nn.Linear(8, 11)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens).to(self.embedding_dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens)).float()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, 11, (6, 5), generator=generator), torch.randint(
        0, 11, (6, 5), generator=generator
    )


class PrecisionCallback:
    """The calls ModelZoo's MixedPrecision callback makes, in its order, for a CSX-style run."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params
        cstorch.amp.enable_mixed_precision(params["enabled"])
        cstorch.amp.set_half_dtype(params["fp16_type"])
        self.scaler = cstorch.amp.GradScaler(
            loss_scale=params["loss_scaling_factor"],
            init_scale=params.get("initial_loss_scale"),
            steps_per_increase=params.get("steps_per_increase"),
            min_loss_scale=params.get("min_loss_scale"),
            max_loss_scale=params.get("max_loss_scale"),
        )
        self.logged: list[tuple[float, float]] = []

    def autocast_context_manager(self) -> Any:
        return cstorch.amp.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def clip_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.params.get("max_gradient_norm") is not None:
            torch.nn.utils.clip_grad_norm_(params, self.params["max_gradient_norm"])
        elif self.params.get("max_gradient_value") is not None:
            torch.nn.utils.clip_grad_value_(params, self.params["max_gradient_value"])

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()

    def on_train_batch_end(self) -> None:
        scale, non_clamped = self.scaler.get_scale(), self.scaler.get_non_clamped_scale()
        self.logged.append((float(scale), float(non_clamped)))
        if non_clamped < scale:  # ModelZoo's check_non_recoverable_nan
            raise RuntimeError("dynamic loss scaling is not recovering")

    def on_save_checkpoint(self, state_dict: dict[str, Any]) -> None:
        state_dict["grad_scaler"] = self.scaler.state_dict()

    def on_load_checkpoint(self, state_dict: dict[str, Any]) -> None:
        if "grad_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["grad_scaler"])


class Run:
    """Model, optimizer, LR scheduler and precision callback, as a trainer holds them."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.precision = PrecisionCallback(params)
        self.model = TinyLM()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=4, gamma=0.5)

    def train_step(self, step: int) -> None:
        tokens, targets = batch(step)
        self.optimizer.zero_grad()
        with self.precision.autocast_context_manager():
            logits = self.model(tokens)
            loss = torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten()
            )
        self.precision.backward(loss)
        if step in FAULTS:
            self.model.head.weight.grad[0, 0] = INF
        self.precision.on_before_optimizer_step(self.optimizer)
        self.precision.clip_gradients(self.optimizer)
        self.precision.optimizer_step(self.optimizer)
        if self.precision.scaler.get_isfinite():  # the scheduler recipe of docs/pytorch/index.md
            self.scheduler.step()
        self.precision.on_train_batch_end()

    def checkpoint(self) -> bytes:
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.scheduler.state_dict(),
        }
        self.precision.on_save_checkpoint(state)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def resume(self, checkpoint: bytes) -> None:
        state = torch.load(io.BytesIO(checkpoint), weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self.precision.on_load_checkpoint(state)


@pytest.fixture(autouse=True)
def cpu_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_models_dtype_queries_follow_the_precision_block():
    PrecisionCallback(PRECISION)
    assert cstorch.amp.mixed_precision() is True
    assert cstorch.amp.get_floating_point_dtype_str() == "float16"
    assert cstorch.amp.get_floating_point_dtype() is torch.float16
    assert cstorch.amp.get_half_dtype() is torch.float16
    assert TinyLM().embed(torch.tensor([1])).dtype is torch.float16
    PrecisionCallback({**PRECISION, "fp16_type": "cbfloat16", "initial_loss_scale": 2.0**15})
    assert cstorch.amp.get_floating_point_dtype_str() == "cbfloat16"
    assert cstorch.amp.is_cbfloat16_tensor(TinyLM().embed(torch.tensor([1])))
    assert cstorch.amp.enable_mixed_precision(False) is False  # ``enabled: false``
    assert cstorch.amp.get_floating_point_dtype_str() == "float32"
    assert cstorch.amp.get_floating_point_dtype() is torch.float32
    assert TinyLM().embed(torch.tensor([1])).dtype is torch.float32


def test_the_scaler_is_built_from_the_yaml_keys():
    config = PrecisionCallback(PRECISION).scaler.config
    assert config.is_dynamic
    assert (config.init_scale, config.steps_per_increase) == (2.0**10, 3)
    assert (config.min_loss_scale, config.max_loss_scale) == (2.0**-10, 2.0**12)
    static = PrecisionCallback({**PRECISION, "loss_scaling_factor": 128.0}).scaler
    assert static.get_scale() == 128.0


def test_the_precision_callback_loop_logs_the_hand_computed_scales():
    run = Run(PRECISION)
    for step in range(STEPS):
        run.train_step(step)
    assert run.precision.logged == SCALE_TRACE
    assert int(run.precision.scaler.get_num_skipped_steps()) == len(FAULTS)
    assert run.scheduler.last_epoch == STEPS - len(FAULTS)
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


@pytest.mark.parametrize("resume_at", [3, 6, 7])
def test_a_checkpoint_and_resume_continue_bit_for_bit(resume_at: int):
    uninterrupted = Run(PRECISION)
    for step in range(STEPS):
        uninterrupted.train_step(step)

    first = Run(PRECISION)
    for step in range(resume_at):
        first.train_step(step)
    checkpoint = first.checkpoint()
    resumed = Run(PRECISION)  # a new process: everything built again, then loaded
    resumed.resume(checkpoint)
    for step in range(resume_at, STEPS):
        resumed.train_step(step)

    assert_tensors_equal(uninterrupted.model.parameters(), resumed.model.parameters())
    assert deep_equal(uninterrupted.optimizer.state_dict(), resumed.optimizer.state_dict())
    assert deep_equal(
        uninterrupted.precision.scaler.state_dict(), resumed.precision.scaler.state_dict()
    )
    assert first.precision.logged + resumed.precision.logged == uninterrupted.precision.logged
    assert resumed.scheduler.state_dict() == uninterrupted.scheduler.state_dict()


def test_a_run_stuck_at_the_minimum_scale_trips_modelzoos_check():
    params = {**PRECISION, "initial_loss_scale": 2.0**-9, "min_loss_scale": 2.0**-10}
    run = Run(params)
    run.train_step(2)  # an overflow: 2**-9 halves to 2**-10, the minimum
    with pytest.raises(RuntimeError, match="not recovering"):
        run.train_step(6)  # again: the non-clamped scale 2**-11 is below the scale


# ---------------------------------------------------------------- ModelZoo 2.0-2.2's call

# A ModelZoo 2.0 ``optimizer:`` block (the scaler keys and the clipping keys live there).
OPTIMIZER_PARAMS = {
    "loss_scaling_factor": "dynamic",
    "initial_loss_scale": 2.0**10,
    "steps_per_increase": 3,
    "min_loss_scale": 2.0**-10,
    "max_loss_scale": 2.0**12,
}
CLIPS = {
    "norm": {"max_gradient_norm": 0.5},
    "value": {"max_gradient_value": 0.01},
    "none": {},
}


def zoo_scaler(params: dict[str, Any]) -> cstorch.amp.GradScaler:
    return cstorch.amp.GradScaler(
        loss_scale=params.get("loss_scaling_factor"),
        init_scale=params.get("initial_loss_scale"),
        steps_per_increase=params.get("steps_per_increase"),
        min_loss_scale=params.get("min_loss_scale"),
        max_loss_scale=params.get("max_loss_scale"),
    )


def lm_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    tokens, targets = batch(step)
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_optimizer_step_as_modelzoo_2_0_calls_it(clip: str):
    cstorch.amp.enable_mixed_precision(False)  # a float32 model, as the 2.0 GPU/CPU runs
    params = {**OPTIMIZER_PARAMS, **CLIPS[clip]}
    model = TinyLM()
    manual = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manual_optimizer = torch.optim.SGD(manual.parameters(), lr=0.1, momentum=0.9)
    scaler, manual_scaler = zoo_scaler(params), zoo_scaler(params)
    for step in range(6):
        poison = step == 2
        loss = lm_loss(model, step)
        if poison:  # an overflow this step: the call must skip it, as the manual loop does
            loss = loss * INF
        cstorch.amp.optimizer_step(
            loss,
            optimizer,
            scaler,
            max_gradient_norm=params.get("max_gradient_norm"),
            max_gradient_value=params.get("max_gradient_value"),
        )
        # The oracle: the documented loop with torch's own clipping.
        manual_loss = lm_loss(manual, step) * (INF if poison else 1.0)
        manual_scaler.scale(manual_loss).backward()
        manual_scaler.unscale_(manual_optimizer)
        if "max_gradient_norm" in params:
            torch.nn.utils.clip_grad_norm_(manual.parameters(), params["max_gradient_norm"])
        elif "max_gradient_value" in params:
            torch.nn.utils.clip_grad_value_(manual.parameters(), params["max_gradient_value"])
        manual_scaler.step(manual_optimizer)
        manual_scaler.update()
        manual_optimizer.zero_grad()
        assert all(p.grad is None for p in model.parameters())  # optimizer_step zeroed them
    assert int(scaler.get_num_skipped_steps()) == 1
    assert deep_equal(scaler.state_dict(), manual_scaler.state_dict())
    if clip == "norm":  # the fused clip coefficient is computed in float32 by amp_core
        torch.testing.assert_close(
            list(model.parameters()), list(manual.parameters()), rtol=1e-5, atol=1e-7
        )
    else:
        assert_tensors_equal(manual.parameters(), model.parameters())
