"""The facade's GradScaler driven by trainers: Lightning's precision plugins and accelerate.

Lightning takes a user's scaler (``MixedPrecision(..., scaler=...)``); accelerate has no
argument for one, so its test is the workaround: replace ``accelerator.scaler`` before
``prepare``. In both, the oracle is the same run with torch's own ``torch.amp.GradScaler``: with
power-of-two scales, scaling and unscaling are exact and both scalers halve on overflow, so the
two runs must agree bit for bit, skipped steps included.

What the trainers call on a scaler (Lightning 2.6.6, accelerate 1.15.0) is recorded and pinned
here too: ``scale``, ``unscale_``, ``step``, ``update``, ``state_dict``, ``load_state_dict``.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _trainer_worker import make_net
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision

import torch_facade as cstorch

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated.*"),
]

STEPS = 5
BATCH = 8
INF = float("inf")


# ----------------------------------------------------------------------------- helpers


def make_loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH, 8, generator=generator)
    y = torch.randn(STEPS * BATCH, 1, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def facade_scaler(**kwargs: Any) -> cstorch.amp.GradScaler:
    return cstorch.amp.GradScaler(loss_scale="dynamic", **kwargs)


def torch_scaler(init_scale: float) -> torch.amp.GradScaler:
    """torch's scaler with the facade's rule for a few steps: halve on overflow, no growth."""
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2000)


_NOT_TRAINER_CODE = (str(Path(cstorch.__file__).resolve().parent), str(Path(__file__).resolve()))


def record_calls(scaler: Any) -> set[str]:
    """Records the public methods of ``scaler`` that trainer code calls.

    Calls from the facade itself (``step`` calls ``step_if_finite``) and from this test module
    (its own assertions and hooks) are not recorded.
    """
    called: set[str] = set()
    for name in dir(scaler):
        method = getattr(scaler, name)
        if name.startswith("_") or not callable(method):
            continue

        def wrapper(*args: Any, __name: str = name, __method: Any = method, **kwargs: Any) -> Any:
            caller = str(Path(sys._getframe(1).f_code.co_filename).resolve())
            if not caller.startswith(_NOT_TRAINER_CODE):
                called.add(__name)
            return __method(*args, **kwargs)

        setattr(scaler, name, wrapper)
    return called


def params_of(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def assert_same_params(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e), f"{a} != {e}"


@pytest.fixture(autouse=True)
def quiet_lightning() -> Iterator[None]:
    """Lightning logs its device summary and tips at INFO; tests show only warnings."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


# ----------------------------------------------------------------------------- Lightning


class TinyModule(L.LightningModule):
    """Records, per batch, the loss, whether the parameters changed and the scale after it.

    ``poison``: batch indices whose gradient gets an inf after backward (before unscale_).
    ``fused``: train with ``AdamW(fused=True)``, which unscales in its kernel (Lightning then
    skips ``unscale_``), instead of SGD.
    """

    def __init__(self, poison: frozenset[int] = frozenset(), fused: bool = False) -> None:
        super().__init__()
        self.net = make_net()
        self.poison = poison
        self.fused = fused
        self.losses: list[float] = []
        self.changed: list[bool] = []
        self.scales: list[float] = []
        self.hidden_dtypes: list[torch.dtype] = []
        self.net[0].register_forward_hook(lambda _m, _i, out: self.hidden_dtypes.append(out.dtype))
        self._batch = -1
        self._before: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch = batch_idx
        self._before = params_of(self.net)

    def on_after_backward(self) -> None:
        if self._batch in self.poison:
            self.net[0].weight.grad[0, 0] = INF

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        after = params_of(self.net)
        self.changed.append(
            any(not torch.equal(b, a) for b, a in zip(self._before, after, strict=True))
        )
        self.scales.append(float(self.trainer.precision_plugin.scaler.get_scale()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.fused:
            return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make_trainer(plugin: Any, max_steps: int = STEPS) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def fit(scaler: Any, poison: frozenset[int] = frozenset(), fused: bool = False) -> TinyModule:
    """``Trainer.fit`` with 16-mixed on the CPU and ``scaler``."""
    module = TinyModule(poison, fused)
    plugin = MixedPrecision(precision="16-mixed", device="cpu", scaler=scaler)
    make_trainer(plugin).fit(module, make_loader())
    return module


def test_lightning_fit_with_the_facade_scaler_matches_torch_scaler():
    scaler = facade_scaler()
    called = record_calls(scaler)
    module = fit(scaler)

    assert called == {"scale", "unscale_", "step", "update"}
    assert len(module.losses) == STEPS
    assert all(torch.isfinite(torch.tensor(module.losses)))
    assert module.hidden_dtypes == [torch.float16] * STEPS  # 16-mixed autocast on the CPU
    assert not all(
        torch.equal(a, b) for a, b in zip(params_of(module.net), params_of(make_net()), strict=True)
    )

    # Default DLS starts at 2**15 (float16): with this data one step overflows float16 by
    # itself, and must be skipped exactly as torch's scaler skips it.
    assert False in module.changed
    oracle = fit(torch_scaler(init_scale=2.0**15))
    assert module.changed == oracle.changed
    assert module.scales == oracle.scales
    assert module.losses == oracle.losses
    assert_same_params(params_of(module.net), params_of(oracle.net))


def test_lightning_skips_an_injected_overflow():
    scaler = facade_scaler(init_scale=2.0**8)  # small enough that nothing overflows by itself
    module = fit(scaler, poison=frozenset({2}))

    assert module.changed == [True, True, False, True, True]
    assert module.scales == [256.0, 256.0, 128.0, 128.0, 128.0]
    assert int(scaler.get_num_skipped_steps()) == 1

    oracle = fit(torch_scaler(init_scale=2.0**8), poison=frozenset({2}))
    assert module.scales == oracle.scales
    assert_same_params(params_of(module.net), params_of(oracle.net))


def test_lightning_with_a_fused_optimizer_skips_like_torch_scaler():
    scaler = facade_scaler(init_scale=2.0**8)
    called = record_calls(scaler)
    module = fit(scaler, poison=frozenset({1, 3}), fused=True)

    assert called == {"scale", "step", "update"}  # no unscale_: the kernel unscales
    assert module.changed == [True, False, True, False, True]
    assert module.scales == [256.0, 128.0, 128.0, 64.0, 64.0]

    oracle = fit(torch_scaler(init_scale=2.0**8), poison=frozenset({1, 3}), fused=True)
    assert module.scales == oracle.scales
    assert_same_params(params_of(module.net), params_of(oracle.net))


def test_lightning_checkpoint_saves_and_restores_the_scaler(tmp_path: Path):
    scaler = facade_scaler(init_scale=2.0**8)
    called = record_calls(scaler)
    module = TinyModule(poison=frozenset({1}))
    trainer = make_trainer(MixedPrecision("16-mixed", "cpu", scaler))
    trainer.fit(module, make_loader())
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = scaler.state_dict()

    restored = facade_scaler(init_scale=2.0**8)
    restored_calls = record_calls(restored)
    resumed = make_trainer(MixedPrecision("16-mixed", "cpu", restored), max_steps=STEPS + 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*weights_only.*")
        resumed.fit(TinyModule(), make_loader(), ckpt_path=tmp_path / "last.ckpt")

    assert called == {"scale", "unscale_", "step", "update", "state_dict"}
    assert restored_calls == {"load_state_dict", "scale", "unscale_", "step", "update"}
    assert float(saved["loss_scale"]) == 128.0
    assert int(saved["num_skipped_steps"]) == 1
    # One more step after the restore: the counters go on from the checkpoint.
    assert float(restored.get_scale()) == 128.0
    assert int(restored.get_num_skipped_steps()) == 1
    assert (
        int(restored.state_dict()["steps_since_rescale"]) == int(saved["steps_since_rescale"]) + 1
    )


def test_lightning_fsdp_precision_takes_no_scaler_but_an_assigned_one_works():
    # Lightning 2.6.6 checks `self.precision` before setting it (the class default is
    # "32-true"), so FSDPPrecision rejects every scaler, torch's ShardedGradScaler included.
    with pytest.raises(ValueError, match="does not use a scaler"):
        FSDPPrecision("16-mixed", scaler=facade_scaler())

    with warnings.catch_warnings():  # its default ShardedGradScaler disables itself on the CPU
        warnings.filterwarnings("ignore", ".*CUDA is not available.*")
        plugin = FSDPPrecision("16-mixed")
    scaler = facade_scaler(init_scale=2.0**8)
    called = record_calls(scaler)
    plugin.scaler = scaler  # the workaround
    module = TinyModule(poison=frozenset({2}))
    with warnings.catch_warnings():
        # FSDPPrecision autocasts on CUDA only; here only its scaler calls are under test.
        warnings.filterwarnings("ignore", ".*CUDA is not available.*")
        make_trainer(plugin).fit(module, make_loader())

    assert called == {"scale", "unscale_", "step", "update"}
    assert module.changed == [True, True, False, True, True]
    assert module.scales == [256.0, 256.0, 128.0, 128.0, 128.0]


# ----------------------------------------------------------------------------- accelerate


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps process-wide state; each test starts and ends without it."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def accelerator_with(scaler: Any) -> Accelerator:
    """The workaround: accelerate takes no user scaler, so replace its own before ``prepare``.

    On the CPU accelerate does not enable fp16 autocast nor a scaler (``native_amp`` is False);
    setting ``native_amp`` turns on both autocast in ``prepare`` and ``unscale_gradients``.
    """
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.scaler = scaler
    accelerator.native_amp = True
    return accelerator


def accelerate_run(
    scaler: Any, poison: frozenset[int], state_dir: Path | None = None
) -> dict[str, Any]:
    """A few accelerate steps (backward, clip, step, scheduler) with inf gradients on ``poison``."""
    accelerator = accelerator_with(scaler)
    net = make_net()
    hidden_dtypes: list[torch.dtype] = []
    net[0].register_forward_hook(lambda _m, _i, out: hidden_dtypes.append(out.dtype))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    net, optimizer, loader, scheduler = accelerator.prepare(
        net, optimizer, make_loader(), scheduler
    )
    skipped: list[bool] = []
    changed: list[bool] = []
    scales: list[float] = []
    for index, (x, y) in enumerate(loader):
        before = params_of(net)
        loss = torch.nn.functional.mse_loss(net(x), y)
        accelerator.backward(loss)
        if index in poison:
            net[0].weight.grad[0, 0] = INF
        accelerator.clip_grad_norm_(net.parameters(), 10.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        skipped.append(optimizer.step_was_skipped)
        changed.append(
            any(not torch.equal(b, a) for b, a in zip(before, params_of(net), strict=True))
        )
        scales.append(float(scaler.get_scale()))
    if state_dir is not None:
        accelerator.save_state(state_dir)
    return {
        "params": params_of(net),
        "skipped": skipped,
        "changed": changed,
        "scales": scales,
        "last_epoch": scheduler.scheduler.last_epoch,
        "hidden_dtypes": hidden_dtypes,
    }


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_has_no_scaler_argument():
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    assert accelerator.scaler is None  # fp16 on the CPU: no scaler, no autocast
    assert not accelerator.native_amp


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_with_the_facade_scaler_matches_torch_scaler(tmp_path: Path):
    scaler = facade_scaler(init_scale=2.0**8)
    called = record_calls(scaler)
    run = accelerate_run(scaler, frozenset({1}), state_dir=tmp_path)

    assert called == {"scale", "unscale_", "step", "update", "state_dict"}
    assert run["hidden_dtypes"] == [torch.float16] * STEPS  # fp16 autocast on the CPU
    assert run["skipped"] == [False, True, False, False, False]
    assert run["changed"] == [True, False, True, True, True]
    assert run["scales"] == [256.0, 128.0, 128.0, 128.0, 128.0]
    assert run["last_epoch"] == STEPS - 1  # accelerate's scheduler skips with the optimizer

    AcceleratorState._reset_state(reset_partial_state=True)
    oracle = accelerate_run(torch_scaler(init_scale=2.0**8), frozenset({1}))
    assert run["scales"] == oracle["scales"]
    assert run["skipped"] == oracle["skipped"]
    assert_same_params(run["params"], oracle["params"])

    AcceleratorState._reset_state(reset_partial_state=True)
    restored = facade_scaler()
    restored_calls = record_calls(restored)
    accelerator = accelerator_with(restored)
    accelerator.prepare(torch.optim.SGD(make_net().parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*weights_only.*")
        accelerator.load_state(tmp_path)
    assert restored_calls == {"load_state_dict"}
    assert float(restored.get_scale()) == 128.0
    assert int(restored.get_num_skipped_steps()) == 1


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_fsdp2_load_state_path_restores_the_scaler(tmp_path: Path, monkeypatch):
    """accelerate's FSDP2 ``load_state`` loads the scaler first and then calls torch's private
    ``_lazy_init_scale_growth_tracker(scaler._device)``. FSDP2 needs a GPU here, so the branch
    is taken by reporting FSDP2; the scaler calls are accelerate's own, unchanged."""
    scaler = facade_scaler(init_scale=2.0**8)
    accelerate_run(scaler, frozenset({1}), state_dir=tmp_path)

    AcceleratorState._reset_state(reset_partial_state=True)
    restored = facade_scaler()
    restored_calls = record_calls(restored)
    accelerator = accelerator_with(restored)
    accelerator.prepare(torch.optim.SGD(make_net().parameters(), lr=0.1))
    monkeypatch.setattr(Accelerator, "is_fsdp2", property(lambda self: True))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*weights_only.*")
        accelerator.load_state(tmp_path)
    assert restored_calls == {"load_state_dict"}
    assert restored._device == "cpu"
    assert float(restored.get_scale()) == 128.0
    assert int(restored.get_num_skipped_steps()) == 1
