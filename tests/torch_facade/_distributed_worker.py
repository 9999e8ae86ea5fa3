"""One rank of the 2-process ``torch.distributed`` job driven by ``test_distributed.py``.

Run as a script::

    python _distributed_worker.py OUT_FILE PORT RANK WORLD_SIZE

Each rank joins a gloo job on ``127.0.0.1:PORT`` and runs every case of :data:`CASES` (DDP with
and without bucket views, accumulation without gradient sync under DDP and FSDP2, a job that
all-reduces gradients itself, FSDP2 with float32, bfloat16 and float16 compute and several
optimizers), then the bad-input checks (:func:`run_errors`) and the timing of the collective
(:func:`measure_collective`). It pickles what it recorded to ``OUT_FILE``. The test module runs
the same cases in one process on the full batch (``run_case(case, None)``): that is the oracle.

Every case trains a small MLP for :data:`STEPS` steps under ``GradScaler(loss_scale="dynamic")``
on a global batch of :data:`BATCH` rows, each rank training on its half with the mean loss of
its rows (DDP, FSDP2 and the all-reduce job average the ranks' gradients, so the result is the
full-batch mean). At :data:`FAULT_STEP` one rank writes an inf or NaN into its own gradient after
the backward pass (after DDP's all-reduce): every rank must skip that step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import pickle
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from _ranks import join_gloo

STEPS = 6
BATCH = 8
FEATURES, HIDDEN, OUTPUTS = 6, 16, 3  # OUTPUTS is odd: FSDP2 shards its layer unevenly
FAULT_STEP = 2
FAULT_INDEX = (12, 3)  # of the first weight (16 x 6): row 12 lies in rank 1's FSDP2 shard
BIG_TARGET = 1.0e5  # a target whose float16 backward overflows (float16 cases)
INIT_SCALE, STEPS_PER_INCREASE = 2.0**8, 2
LEARNING_RATE = 1e-2
SCALES = {
    None: [256.0, 256.0, 128.0, 128.0, 128.0, 256.0],
    4: [256.0, 256.0, 128.0, 128.0, 64.0, 64.0],
}
"""The loss scale after each step, by ``big_target_step``: 2**8, halving at each skipped step,
doubling after 2 + 1 steps."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One distributed training run and its one-process counterpart.

    Attributes:
        wrapper: ``"ddp"``, ``"all_reduce"`` (no wrapper; the loop averages the gradients) or
            ``"fsdp2"``.
        optimizer: a key of :data:`OPTIMIZERS`.
        bucket_view: DDP's ``gradient_as_bucket_view``.
        accumulate: micro-batches per step (all but the last without gradient sync: DDP's
            ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``).
        compute_dtype: the forward dtype (FSDP2: ``MixedPrecisionPolicy(param_dtype=...)``;
            one process: the parameters and input cast in ``forward``).
        max_gradient_norm: DLS + GCC.
        unscale_first: call ``unscale_`` before ``step`` (else ``step`` unscales, and a fused
            optimizer gets the scale as ``grad_scale``).
        fault_rank: the rank whose gradient gets the fault (any value in one process).
        fault_value: inf or NaN.
        big_target_step: a step whose target overflows the float16 backward on rank 0's rows.
        resume_at: rebuild the scaler from a saved ``state_dict`` before this step.
        rtol, atol: how close to the one-process parameters the job must end.
        mesh: FSDP2's device mesh as a grid of global ranks (``None``: the default 1-D mesh
            over every rank); a 2-D grid is HSDP, its rows the replica groups
            (``mesh_dim_names=("replicate", "shard")``).
    """

    wrapper: str
    optimizer: str
    bucket_view: bool = False
    accumulate: int = 1
    compute_dtype: torch.dtype = torch.float32
    max_gradient_norm: float | None = None
    unscale_first: bool = True
    fault_rank: int = 1
    fault_value: float = math.inf
    big_target_step: int | None = None
    resume_at: int | None = None
    rtol: float = 1e-5
    atol: float = 1e-6
    mesh: tuple[tuple[int, ...], ...] | None = None


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=LEARNING_RATE, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=LEARNING_RATE),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=LEARNING_RATE, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=LEARNING_RATE, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=LEARNING_RATE, fused=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=LEARNING_RATE, momentum=0.9, fused=True),
}

CASES: dict[str, Case] = {
    "ddp": Case("ddp", "adam"),
    "ddp_bucket_view": Case("ddp", "adam", bucket_view=True, fault_value=math.nan),
    "ddp_no_sync": Case("ddp", "sgd", bucket_view=True, accumulate=2),
    "all_reduce": Case("all_reduce", "sgd", fault_rank=0, fault_value=math.nan),
    "fsdp2_sgd_gcc": Case("fsdp2", "sgd", max_gradient_norm=0.05),
    "fsdp2_adam_foreach": Case("fsdp2", "adam_foreach"),
    "fsdp2_accumulate": Case("fsdp2", "adam_foreach", accumulate=2),
    "fsdp2_adam_fused": Case("fsdp2", "adam_fused", unscale_first=False),
    "fsdp2_adamw_fused_gcc": Case(
        "fsdp2", "adamw_fused", max_gradient_norm=0.05, unscale_first=False
    ),
    "fsdp2_resume": Case("fsdp2", "adam_fused", unscale_first=False, resume_at=4),
    "fsdp2_bf16": Case("fsdp2", "adam_foreach", compute_dtype=torch.bfloat16, rtol=0.0, atol=2e-3),
    "fsdp2_fp16": Case(
        "fsdp2", "adam_fused", compute_dtype=torch.float16, big_target_step=4, atol=2e-4
    ),
}


class MLP(torch.nn.Module):
    """``Linear -> tanh -> Linear -> tanh -> Linear``, computing in ``compute_dtype``.

    In one process the parameters and the input are cast in ``forward``; under FSDP2
    (``cast=False``) the layers are called as modules, so that FSDP2's hooks gather their
    parameters, already cast by its mixed-precision policy: both compute the same way.
    """

    def __init__(self, compute_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.compute_dtype = compute_dtype
        self.cast = True
        sizes = ((FEATURES, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, OUTPUTS))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in sizes)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.compute_dtype)
        for i, layer in enumerate(self.layers):
            if self.cast:
                w, b = layer.weight.to(self.compute_dtype), layer.bias.to(self.compute_dtype)
                h = torch.nn.functional.linear(h, w, b)
            else:
                h = layer(h)
            if i < len(self.layers) - 1:
                h = torch.tanh(h)
        return h


NORM_RTOL = {torch.float32: 1e-6, torch.float16: 2e-4, torch.bfloat16: 5e-3}
"""How close a job's global norm must come to one process's, by compute dtype."""
STATE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 3e-2}
"""How close a job's optimizer state must come to one process's, by compute dtype, relative to
the largest element of each tensor."""
COPY_KEYS = ("torch_norm", "grads_unscaled", "grads_final")
"""What a rank records of its own copy of the gradients (the fault's step differs there)."""


def check_same_bits(first: dict[str, Any], other: dict[str, Any], copies_differ: bool) -> None:
    """Asserts that two ranks' runs of one case recorded the same bits: flags, norms, scaler
    state dicts, parameters and optimizer state; and their gradients, but at the fault's step
    where ``copies_differ`` (a fault written into one rank's copy of replicated values)."""
    shared = [k for k in first if k not in ("spies", "optimizer_state", "local_numel")]
    assert "global_norm" in shared and "state.loss_scale" in shared and "params" in shared
    for key in shared:
        a, b = np.asarray(first[key]), np.asarray(other[key])
        if copies_differ and key in COPY_KEYS:
            a, b = (np.delete(v, FAULT_STEP, axis=0) for v in (a, b))
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert a.tobytes() == b.tobytes(), f"{key}: {a} != {b}"
    assert first["optimizer_state"].keys() == other["optimizer_state"].keys()
    for key, value in first["optimizer_state"].items():
        assert value.tobytes() == other["optimizer_state"][key].tobytes(), key


def check_matches_oracle(
    run: dict[str, Any], reference: dict[str, Any], case: Case, finite_norms_only: bool = False
) -> None:
    """Asserts that a rank's run of ``case`` took the one-process run's decisions: the same
    skips, scale and counters; the norm (of the finite steps only, if ``finite_norms_only``),
    parameters and optimizer state within the compute dtype's rounding."""
    assert run["isfinite"].tolist() == reference["isfinite"].tolist()
    assert run["unchanged"].tolist() == reference["unchanged"].tolist()
    for key in reference:
        if key.startswith("state."):
            np.testing.assert_array_equal(run[key], reference[key], err_msg=key)
    steps = reference["isfinite"] if finite_norms_only else slice(None)
    np.testing.assert_allclose(
        run["global_norm"][steps],
        reference["global_norm"][steps],
        rtol=NORM_RTOL[case.compute_dtype],
    )
    np.testing.assert_allclose(run["params"], reference["params"], rtol=case.rtol, atol=case.atol)
    tolerance = STATE_TOLERANCE[case.compute_dtype]
    for key, value in reference["optimizer_state"].items():
        np.testing.assert_allclose(
            run["optimizer_state"][key], value, rtol=0, atol=tolerance * np.abs(value).max()
        )


def check_oracle(reference: dict[str, Any], case: Case) -> None:
    """Asserts what the one-process run of ``case`` must do: skip the fault's step (and the
    float16 overflow's) keeping every bit, skip nothing else, and scale as :data:`SCALES`."""
    faulty = {FAULT_STEP, case.big_target_step}
    expected = [step not in faulty for step in range(STEPS)]
    assert reference["isfinite"].tolist() == expected
    assert reference["unchanged"].tolist() == [not finite for finite in expected]
    assert reference["state.loss_scale"].tolist() == SCALES[case.big_target_step]


def global_batch(step: int, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch of ``step``, the same in every process."""
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, FEATURES, generator=generator)
    y = torch.randn(BATCH, OUTPUTS, generator=generator)
    if step == case.big_target_step:
        y[1, 0] = BIG_TARGET
    return x, y


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error, reduced in float32."""
    return (outputs.float() - targets).square().mean()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor is gathered: a collective every rank must call)."""
    from torch_facade.amp._engine._dtensor import is_dtensor

    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's values (a DTensor's local shard)."""
    from torch_facade.amp._engine._dtensor import is_dtensor

    return tensor.to_local() if is_dtensor(tensor) else tensor


def flat(tensors: list[torch.Tensor]) -> np.ndarray:
    """The tensors (whole, gathered if sharded) as one float32 vector."""
    return torch.cat([full(t).detach().float().reshape(-1) for t in tensors]).numpy().copy()


def local_bits(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[bytes]:
    """This rank's parameters and optimizer state tensors, as raw bytes."""
    tensors = [local(p).detach() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    return [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]


def gradient_norm(params: list[torch.Tensor], multiplier: float = 1.0) -> float:
    """The oracle: the L2 norm of every (whole) gradient times ``multiplier``, in float64."""
    total = sum(
        float((full(p.grad).double() * multiplier).square().sum())
        for p in params
        if p.grad is not None
    )
    return math.sqrt(total)


class Spies:
    """Records what the scaler imports into JAX and what it gathers across ranks."""

    def __init__(self) -> None:
        self.imports: list[tuple[int, int, int]] = []  # (torch pointer, numel, JAX pointer)
        self.gathers: list[tuple[int, ...]] = []  # the shape of each gathered partials tensor
        self.buckets: list[tuple[int, int]] = []  # DDP bucket buffers (pointer, numel)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Wraps ``_dlpack.import_tensors`` and ``Collective.gather`` while active."""
        from torch_facade.amp._engine import _distributed, _dlpack, _storage

        import_tensors, gather = _dlpack.import_tensors, _distributed.Collective.gather
        # These spies pin where torch keeps each gradient; the small ones' packed copy
        # (_storage.SMALL_GRADIENT) would hide that, so it is off while they watch.
        small_gradient, _storage.SMALL_GRADIENT = _storage.SMALL_GRADIENT, 0

        def spy_import(tensors: Any) -> Any:
            arrays = import_tensors(tensors)
            for tensor, array in zip(tensors, arrays, strict=True):
                self.imports.append(
                    (tensor.data_ptr(), tensor.numel(), array.unsafe_buffer_pointer())
                )
            return arrays

        def spy_gather(collective: Any, partials: torch.Tensor) -> torch.Tensor:
            self.gathers.append(tuple(partials.shape))
            return gather(collective, partials)

        _dlpack.import_tensors = spy_import
        _distributed.Collective.gather = spy_gather  # type: ignore[method-assign]
        try:
            yield
        finally:
            _dlpack.import_tensors = import_tensors
            _distributed.Collective.gather = gather  # type: ignore[method-assign]
            _storage.SMALL_GRADIENT = small_gradient

    def bucket_hook(self, state: Any, bucket: Any) -> Any:
        """A DDP comm hook: records the bucket's buffer, then DDP's default all-reduce."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buffer = bucket.buffer()
        self.buckets.append((buffer.data_ptr(), buffer.numel()))
        return allreduce_hook(state, bucket)

    def take(self) -> dict[str, list[Any]]:
        """What was recorded since the last call (and forgets it)."""
        taken = {"imports": self.imports, "gathers": self.gathers, "buckets": self.buckets}
        self.imports, self.gathers, self.buckets = [], [], []
        return taken


def wrap(model: MLP, case: Case, distributed: bool, spies: Spies) -> torch.nn.Module:
    """The model as the case's distributed wrapper holds it (unchanged in one process)."""
    if not distributed or case.wrapper == "all_reduce":
        return model
    if case.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            model, gradient_as_bucket_view=case.bucket_view, bucket_cap_mb=0.001
        )
        # A lambda: DDP rejects a hook whose annotations are not GradBucket and Future.
        ddp.register_comm_hook(None, lambda state, bucket: spies.bucket_hook(state, bucket))
        return ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=None if case.compute_dtype == torch.float32 else case.compute_dtype
    )
    model.cast = False
    mesh = device_mesh(case.mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def device_mesh(grid: tuple[tuple[int, ...], ...] | None) -> Any:
    """The 2-D mesh of ``grid`` (``init_device_mesh`` when its ranks come in order), or ``None``
    for FSDP2's default 1-D mesh."""
    if grid is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    names = ("replicate", "shard")
    shape = (len(grid), len(grid[0]))
    if [rank for row in grid for rank in row] == list(range(shape[0] * shape[1])):
        return init_device_mesh("cpu", shape, mesh_dim_names=names)
    return DeviceMesh("cpu", torch.tensor(grid), mesh_dim_names=names)


def new_scaler(case: Case) -> Any:
    """The case's scaler: DLS from 2**8, growing after 2 + 1 steps, GCC if configured."""
    import torch_facade as cstorch

    return cstorch.amp.GradScaler(
        loss_scale="dynamic",
        init_scale=INIT_SCALE,
        steps_per_increase=STEPS_PER_INCREASE,
        max_gradient_norm=case.max_gradient_norm,
    )


def run_case(
    name: str, rank: int | None, world: int = 2, cases: dict[str, Case] | None = None
) -> dict[str, Any]:
    """Trains case ``name`` of ``cases`` (default :data:`CASES`): as ``rank`` of a
    ``world``-rank job, or in one process (``None``).

    Returns:
        Per step (arrays with a leading step axis): ``isfinite``, ``global_norm``, the scaler's
        ``state_dict`` values (``state.<key>``), ``torch_norm`` (the oracle norm of the whole
        unscaled gradients), ``grads_unscaled`` (whole, as the scaler left them after unscaling)
        and ``grads_final`` (as the optimizer saw them), ``unchanged`` (this rank's parameters
        and optimizer state bit-identical after the step), ``local_numel`` (elements of this
        rank's gradients), ``fused`` (the step ran with
        ``grad_scale``/``found_inf``), ``params`` (whole, after the step; row 0 is the start),
        ``spies`` (what the scaler imported and gathered; DDP's buckets); and ``optimizer_state``
        (whole, at the end).
    """
    case = (CASES if cases is None else cases)[name]
    distributed = rank is not None
    spies = Spies()
    model = MLP(case.compute_dtype)
    wrapped = wrap(model, case, distributed, spies)
    params = list(model.parameters())
    optimizer = OPTIMIZERS[case.optimizer](params)
    fused_steps: list[bool] = []
    optimizer.register_step_pre_hook(lambda opt, *_: fused_steps.append(hasattr(opt, "grad_scale")))
    scaler = new_scaler(case)
    rows = (
        slice(None) if rank is None else slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    )
    record: dict[str, list[Any]] = {"params": [flat(params)]}

    def add(key: str, value: Any) -> None:
        record.setdefault(key, []).append(value)

    with spies.installed():
        for step in range(STEPS):
            if step == case.resume_at:
                scaler = resume(scaler, case)
            optimizer.zero_grad()
            x, y = global_batch(step, case)
            x, y = x[rows], y[rows]
            micro = len(x) // case.accumulate
            for k in range(case.accumulate):
                with gradient_sync(wrapped, k == case.accumulate - 1):
                    part = slice(k * micro, (k + 1) * micro)
                    loss = mse(wrapped(x[part]), y[part]) / case.accumulate
                    scaler.scale(loss).backward()
            if distributed and case.wrapper == "all_reduce":
                average_gradients(params, world)
            if step == FAULT_STEP and rank in (None, case.fault_rank):
                inject_fault(
                    params[0], case.fault_value, rank is not None and case.wrapper == "fsdp2"
                )
            add("local_numel", sum(local(p.grad).numel() for p in params))
            before = local_bits(model, optimizer)
            scale = float(scaler.get_scale())
            if case.unscale_first:
                scaler.unscale_(optimizer)
                add("torch_norm", gradient_norm(params))
            else:
                add("torch_norm", gradient_norm(params, 1.0 / scale))
            add(
                "grads_unscaled",
                flat([p.grad for p in params]) / (1.0 if case.unscale_first else scale),
            )
            scaler.step(optimizer)
            add("grads_final", flat([p.grad for p in params]))
            scaler.update()
            add("isfinite", bool(scaler.get_isfinite()))
            add("global_norm", np.float32(scaler.get_global_norm()))
            for key, value in scaler.state_dict().items():
                add(f"state.{key}", value.numpy().copy())
            add("unchanged", before == local_bits(model, optimizer))
            add("params", flat(params))
            add("spies", spies.take())
    result: dict[str, Any] = {k: v if k == "spies" else np.asarray(v) for k, v in record.items()}
    result["fused"] = np.asarray(fused_steps)
    result["optimizer_state"] = {
        f"{i}.{key}": flat([value]) if value.dim() else np.asarray(float(value))
        for i, state in enumerate(optimizer.state[p] for p in params)
        for key, value in state.items()
    }
    result["bucket_grads"] = grads_in_buckets(params, result["spies"][-1]["buckets"])
    return result


def gradient_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    """Where ``sync`` is false, a backward pass that only accumulates: DDP's ``no_sync()``, or
    FSDP2's ``set_requires_gradient_sync(False)``; nothing to do elsewhere."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
    elif not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def resume(scaler: Any, case: Case) -> Any:
    """A fresh scaler loaded from ``scaler``'s ``state_dict``, saved and read back as a file."""
    buffer = io.BytesIO()
    torch.save(scaler.state_dict(), buffer)
    buffer.seek(0)
    fresh = new_scaler(case)
    fresh.load_state_dict(torch.load(buffer))
    return fresh


def average_gradients(params: list[torch.Tensor], world: int) -> None:
    """What a job without DDP does: sum every gradient across ranks and divide."""
    import torch.distributed as dist

    for param in params:
        dist.all_reduce(param.grad)
        param.grad.div_(world)


def inject_fault(weight: torch.Tensor, value: float, sharded: bool) -> None:
    """Writes ``value`` at :data:`FAULT_INDEX` of ``weight``'s gradient (a row of the last
    shard: rank 1's on a 1-D mesh of 2, the last column's of an HSDP mesh)."""
    row, col = FAULT_INDEX
    grad = local(weight.grad)
    if sharded:
        row -= weight.shape[0] - grad.shape[0]  # rank 1 holds the last rows (even dim 0)
    with torch.no_grad():
        grad[row, col] = value


def grads_in_buckets(params: list[torch.Tensor], buckets: list[tuple[int, int]]) -> np.ndarray:
    """Per parameter: whether its gradient lies inside one of DDP's bucket buffers."""
    result = []
    for param in params:
        start, size = param.grad.data_ptr(), param.grad.numel() * param.grad.element_size()
        inside = any(base <= start and start + size <= base + numel * 4 for base, numel in buckets)
        result.append(inside)
    return np.asarray(result)


def fused_sgd_errors() -> dict[str, str]:
    """Fused SGD on FSDP2's DTensor parameters, with the scaler and with torch alone."""
    errors = {}
    for label, use_scaler in (("scaler", True), ("torch", False)):
        model = wrap(MLP(), Case("fsdp2", "sgd_fused"), True, Spies())
        optimizer = OPTIMIZERS["sgd_fused"](model.parameters())
        scaler = new_scaler(CASES["fsdp2_adam_foreach"])
        x, y = global_batch(0, CASES["fsdp2_adam_foreach"])
        loss = mse(model(x[:4]), y[:4])
        try:
            if use_scaler:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
            else:
                loss.backward()
                optimizer.step()
            errors[label] = "no error"
        except Exception as err:  # what torch raises is the finding
            errors[label] = f"{type(err).__name__}: {err}"
    return errors


def caught(function: Callable[[], Any]) -> str:
    """``"ok"``, or the type and message of what ``function`` raised."""
    try:
        function()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
    """One scaled step of ``model`` on this rank's half of batch 0."""
    x, y = global_batch(0, CASES["ddp"])
    optimizer.zero_grad()
    scaler.scale(mse(model(x[:4]), y[:4])).backward()
    scaler.step(optimizer)
    scaler.update()


def run_errors(rank: int, world: int) -> dict[str, str]:
    """The bad inputs, each giving its error on the ranks concerned (``"ok"`` elsewhere)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    import torch_facade as cstorch

    found = {}
    first = dist.new_group([0])
    own = [dist.new_group([r]) for r in range(world)][rank]

    def member_check() -> None:
        scaler = cstorch.amp.GradScaler(loss_scale="dynamic", process_group=first)
        model = MLP()  # rank 0 alone: a one-rank group
        one_step(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler)

    found["outside_group"] = caught(member_check)

    def mesh_check() -> None:
        model = wrap(MLP(), CASES["fsdp2_sgd_gcc"], True, Spies())
        scaler = cstorch.amp.GradScaler(loss_scale="dynamic", process_group=own)
        one_step(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler)

    found["mesh_group"] = caught(mesh_check)

    def disagree_check() -> None:
        model = DistributedDataParallel(MLP())
        scaler = new_scaler(CASES["ddp"])
        if rank == 1:
            scaler.load_state_dict({"loss_scale": 2 * INIT_SCALE})
        one_step(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler)

    found["disagree"] = caught(disagree_check)

    def fsdp1_check() -> None:
        model = FullyShardedDataParallel(MLP(), use_orig_params=True, device_id=torch.device("cpu"))
        one_step(model, torch.optim.SGD(model.parameters(), lr=0.1), new_scaler(CASES["ddp"]))

    found["fsdp1"] = caught(fsdp1_check)
    return found


def measure_collective(repeats: int = 100) -> dict[str, float]:
    """Median seconds of: the all-gather of 3 float32, and one DDP decision with and without it.

    The decision is ``unscale_`` on a DDP model's gradients (the scaler's whole read, gather and
    finish); "without" replaces the collective by the one-process path (``collective`` returns
    ``None``), so the difference is what taking the decision together costs per iteration.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from torch_facade.amp._engine import _distributed

    partials, gathered = torch.zeros(3), torch.empty(3 * dist.get_world_size())
    timings: dict[str, list[float]] = {"all_gather": [], "decision": [], "decision_local": []}
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        _distributed.Collective(None).gather(partials)
        timings["all_gather"].append(time.perf_counter() - start)
    del gathered
    model = DistributedDataParallel(MLP())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = new_scaler(CASES["ddp"])
    x, y = global_batch(0, CASES["ddp"])
    collective = _distributed.collective
    for i in range(2 * repeats):
        local_path = i % 2 == 1
        optimizer.zero_grad()
        scaler.scale(mse(model(x[:4]), y[:4])).backward()
        dist.barrier()
        _distributed.collective = (lambda group: None) if local_path else collective
        start = time.perf_counter()
        scaler.unscale_(optimizer)
        elapsed = time.perf_counter() - start
        _distributed.collective = collective
        timings["decision_local" if local_path else "decision"].append(elapsed)
        scaler.step(optimizer)
        scaler.update()
    warm = repeats // 10  # compilation and first-call costs
    return {key: statistics.median(values[warm:]) for key, values in timings.items()}


def run_cases(cases: dict[str, Case], rank: int, world: int) -> dict[str, Any]:
    """Every case of ``cases`` as ``rank`` of the job: ``{"cases": ..., "seconds": ...}``."""
    results: dict[str, Any] = {"cases": {}, "seconds": {}}
    for name in cases:
        start = time.perf_counter()
        results["cases"][name] = run_case(name, rank, world, cases)
        results["seconds"][name] = time.perf_counter() - start
        print(f"rank {rank}: {name} {results['seconds'][name]:.2f} s", flush=True)
    return results


def finish(results: dict[str, Any], out_file: str) -> None:
    """Leaves the job once every rank is done, pickles ``results`` and exits."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    with open(out_file, "wb") as out:
        pickle.dump(results, out)
    os._exit(0)  # skip interpreter teardown (gloo and XLA threads): the results are written


def main(out_file: str, port: str, rank: str, world: str) -> None:
    """Runs every case, the error checks and the timing as one rank; pickles the results."""
    join_gloo(port, rank, world)
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        results = run_cases(CASES, int(rank), int(world))
    results["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught_warnings]
    results["fused_sgd"] = fused_sgd_errors()
    results["errors"] = run_errors(int(rank), int(world))
    results["timing"] = measure_collective()
    finish(results, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:])
