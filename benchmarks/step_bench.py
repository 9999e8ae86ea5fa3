"""The JAX train step as users write it: ``amp_core`` against plain optax, the floor and the peers.

Every variant is one jitted step over forward, backward and update, with the parameters and
optimizer state donated: float32 master weights, float16 compute, ``optax.adamw``, on the
parameters of a size's GPT-2-like layout (:func:`workbench.sizes.shape_list`; at ``M`` 28.0M
parameters in 148 leaves). Two losses:

* ``real forward`` (:func:`real_loss`): an MLP over the size's layers on 64 tokens (embedding,
  per block layer norm, the attention projections used as an MLP, the feed-forward MLP, the tied
  output head and a float32 cross-entropy): the dots' backward produces the gradients;
* ``synthetic loss`` (:func:`synthetic_loss`): ``0.5 * sum(p16**2)`` per leaf, whose gradient is
  element-wise in the parameters, so that XLA fuses the backward into the optimizer's passes:
  the step is the optimizer's memory traffic alone.
* ``real forward, 4 micro-batches`` (:data:`ACCUMULATED`): the real forward on 4 micro-batches,
  their gradients summed in a ``lax.scan``, then one update (gradient accumulation in one jit;
  flax's ``DynamicScale`` and mpx cannot take one decision over several micro-batches and are
  left out of it).

The variants (:data:`VARIANTS`): plain optax AdamW; the floor, plain AdamW plus the gradients'
global sum of squares returned and unused (what computing a global norm costs on its own); the
two ``amp_core`` front doors (``with_loss_scaling`` + ``optax.apply_updates``, and
``apply_scaled_gradients``); and three other JAX loss scalers written as their documentation
writes them: jmp (``DynamicLossScale``, ``all_finite``, ``select_tree``), flax's
``DynamicScale`` (as flax's ``examples/imagenet/train.py``: ``value_and_grad``, then
``jnp.where`` over parameters and optimizer state) and mpx (``filter_value_and_grad`` and
``optimizer_update``, as its README). Each scaler is built by a :class:`ScalerSpec`, so that the
behaviour checks of :mod:`benchmarks.scaler_checks` run exactly the code that is timed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import amp_core
from benchmarks.jax_bench import gate_by
from workbench.internals import in_step_sum_of_unscaled_squares
from workbench.sizes import SizeSpec, shape_list
from workbench.timing import CompileCounter, FirstStep, Plan, Timing, Variant, measure_group
from workbench.whole_loop import LEARNING_RATE, LOSS_SCALE, NEVER

TOKENS = 64
"""Tokens of the real forward (one sequence)."""

MICRO_BATCHES = 4
"""Micro-batches of the accumulated step."""

ACCUMULATED = f"real forward, {MICRO_BATCHES} micro-batches"
"""The accumulated step: the real forward's gradients summed over :data:`MICRO_BATCHES`
micro-batches in a ``lax.scan`` (each loss divided by the count), then one update."""

LOSSES = ("real forward", "synthetic loss", ACCUMULATED)
"""The losses, each timed as its own interleaved group."""

PLAIN = "optax adamw"
FLOOR = "plain + global norm (floor)"
GATED_FLOOR = "plain + global norm gating the update"
WITH_LOSS_SCALING = "amp_core with_loss_scaling"
APPLY_SCALED = "amp_core apply_scaled_gradients"
JMP = "jmp"
FLAX = "flax DynamicScale"
MPX = "mpx"

SCALERS = (WITH_LOSS_SCALING, APPLY_SCALED, JMP, FLAX, MPX)
"""The loss scalers, in table order."""

VARIANTS = (PLAIN, FLOOR, GATED_FLOOR, *SCALERS)
"""Every timed variant, in table order."""

ACCUMULATING = (PLAIN, FLOOR, GATED_FLOOR, WITH_LOSS_SCALING, APPLY_SCALED, JMP)
"""The variants of the accumulated step. flax's ``DynamicScale`` and mpx take the gradient
inside their own ``value_and_grad``, which decides (and adjusts the scale) on every call: they
cannot take one decision over several micro-batches."""


def variants_of(loss: str) -> tuple[str, ...]:
    """The variants timed on ``loss``.

    Example:
        >>> from benchmarks import step_bench
        >>> step_bench.variants_of(step_bench.ACCUMULATED) == step_bench.ACCUMULATING
        True
    """
    return ACCUMULATING if loss == ACCUMULATED else VARIANTS


PEER_PACKAGES = {JMP: "jmp", FLAX: "flax", MPX: "mixed-precision-for-JAX"}
"""The distribution each peer comes from (its version goes into the report)."""

Params = dict[str, jax.Array]
Loss = Callable[[Params, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class Usage:
    """What a scaler's user writes to skip an overflowed step, and whether skips are counted."""

    skip: str
    counts_skips: bool


USAGE: dict[str, Usage] = {
    PLAIN: Usage("(no loss scaling)", False),
    FLOOR: Usage("(no loss scaling; the norm is computed and returned, never used)", False),
    GATED_FLOOR: Usage(
        "(no loss scaling; the gradients enter AdamW multiplied by `1 + min(norm**2, 0)`, "
        "exactly 1: the update waits for the norm, as any skip decision makes it)",
        False,
    ),
    WITH_LOSS_SCALING: Usage(
        "nothing: `tx.update` + `optax.apply_updates` skip inside (`-0.0` updates, old state)",
        True,
    ),
    APPLY_SCALED: Usage("nothing: one call returns the new (or old) parameters and state", True),
    JMP: Usage(
        "`jmp.all_finite(grads)`, `loss_scale.adjust(finite)`, then `jmp.select_tree` over the "
        "new parameters *and* optimizer state (the README's recipe selects only the parameters)",
        False,
    ),
    FLAX: Usage(
        "`is_fin` from `dynamic_scale.value_and_grad`, then `jnp.where(is_fin, new, old)` over "
        "parameters and optimizer state (`tree_map`, as flax's imagenet example)",
        False,
    ),
    MPX: Usage(
        "`mpx.optimizer_update(model, optimizer, opt_state, grads, grads_finite)` (a "
        "`select_tree` over model and optimizer state)",
        False,
    ),
}


def peer_versions() -> dict[str, str | None]:
    """The installed version of each peer's distribution (``None``: not installed)."""
    versions: dict[str, str | None] = {}
    for name, dist in PEER_PACKAGES.items():
        try:
            versions[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


# --- The model -----------------------------------------------------------------------------


def make_params(spec: SizeSpec, seed: int = 0) -> dict[str, np.ndarray]:
    """The size's parameters as float32 NumPy arrays (GPT-2 initialisation), by name.

    Example:
        >>> from workbench.sizes import SIZES
        >>> from benchmarks.step_bench import make_params
        >>> params = make_params(SIZES["S"])
        >>> len(params), sum(p.size for p in params.values())
        (20, 1068800)
    """
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in shape_list(spec):
        if name.endswith("bias"):
            value = np.zeros(shape, np.float32)
        elif ".ln_" in name or name.startswith("ln_"):
            value = np.ones(shape, np.float32)
        else:
            value = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        params[name] = value
    return params


def make_tokens(spec: SizeSpec, seed: int = 0, micro_batches: int | None = None) -> jax.Array:
    """``TOKENS + 1`` random token ids: the inputs and their next-token targets; with
    ``micro_batches``, that many such rows (``[micro_batches, TOKENS + 1]``)."""
    rng = np.random.default_rng(seed + 1)
    shape = (TOKENS + 1,) if micro_batches is None else (micro_batches, TOKENS + 1)
    return jnp.asarray(rng.integers(0, spec.vocab, shape), jnp.int32)


def _layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * weight + bias


def _linear(x: jax.Array, p: Params, name: str) -> jax.Array:
    return x @ p[name + ".weight"].T + p[name + ".bias"]


def real_loss(params: Params, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy of an MLP over the GPT-2 layout, computed in float16.

    Every block is ``x += attn_proj(gelu(qkv(ln_1(x))))`` (the query, key and value
    projections summed: no attention) and ``x += mlp_proj(gelu(c_fc(ln_2(x))))``; the output
    head is the tied embedding, the cross-entropy float32.
    """
    p = {name: value.astype(jnp.float16) for name, value in params.items()}
    inputs = tokens[:-1]
    x = p["wte.weight"][inputs] + p["wpe.weight"][: inputs.shape[0]]
    blocks = sorted({int(name.split(".")[1]) for name in p if name.startswith("blocks.")})
    for block in blocks:
        pre = f"blocks.{block}."
        h = _layer_norm(x, p[pre + "ln_1.weight"], p[pre + "ln_1.bias"])
        if pre + "c_attn.weight" in p:
            h = _linear(h, p, pre + "c_attn")
            h = h.reshape(h.shape[0], 3, -1).sum(axis=1)
        else:
            h = sum(_linear(h, p, pre + part) for part in ("q", "k", "v"))
        x = x + _linear(jax.nn.gelu(h), p, pre + "attn_proj")
        h = _layer_norm(x, p[pre + "ln_2.weight"], p[pre + "ln_2.bias"])
        x = x + _linear(jax.nn.gelu(_linear(h, p, pre + "c_fc")), p, pre + "mlp_proj")
    x = _layer_norm(x, p["ln_f.weight"], p["ln_f.bias"])
    logits = (x @ p["wte.weight"].T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[1:]).mean()


def synthetic_loss(params: Params, tokens: jax.Array) -> jax.Array:
    """``0.5 * sum(p16**2)`` over every leaf (float16 squares, float32 sums); ignores ``tokens``."""
    del tokens
    total = jnp.zeros((), jnp.float32)
    for value in params.values():
        total = total + 0.5 * jnp.sum(jnp.square(value.astype(jnp.float16)), dtype=jnp.float32)
    return total


LOSS_FUNCTIONS: dict[str, Loss] = {
    "real forward": real_loss,
    "synthetic loss": synthetic_loss,
    ACCUMULATED: real_loss,
}


def _grad(loss: Loss, params: Params, batch: jax.Array) -> Params:
    """``jax.grad(loss)(params, batch)``; for a batch of micro-batches (2-d tokens), the sum
    over a ``lax.scan`` of the gradients of ``loss(params, micro_batch) / count``: one
    accumulated step's gradients, as torch's ``scale(loss / k).backward()`` loop sums them."""
    if jnp.ndim(batch) != 2:
        return jax.grad(loss)(params, batch)
    count = batch.shape[0]

    def micro_batch(acc: Params, tokens: jax.Array) -> tuple[Params, None]:
        grads = jax.grad(lambda p: loss(p, tokens) / count)(params)
        return jax.tree_util.tree_map(jnp.add, acc, grads), None

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return jax.lax.scan(micro_batch, zeros, batch)[0]


# --- The scalers ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScalerSettings:
    """The dynamic loss scale every scaler is given, in its own terms.

    Attributes:
        init_scale: the first loss scale.
        period: finite steps between increases (``steps_per_increase``, ``period``,
            ``growth_interval``).
        max_scale: where the library has one, the upper bound.
        min_scale: where the library has one, the lower bound.
    """

    init_scale: float = LOSS_SCALE
    period: int = NEVER
    max_scale: float = LOSS_SCALE
    min_scale: float = 1.0


class Runner:
    """One scaler's jitted train step with its carry (parameters, optimizer state, scaler).

    ``step(batch)`` runs one step and waits for it; the accessors read the current state for
    the behaviour checks. ``traces`` counts how often the step function was traced. By
    default the carry is a tuple ``(params, opt_state, ...)`` that ``_step(*carry, batch)``
    maps to the next one; runners whose step is shaped otherwise override these.
    """

    def __init__(self) -> None:
        self.traces = 0
        self.carry: Any = ()
        self._step: Callable[..., Any] = lambda *args: args[:-1]

    def step(self, batch: Any) -> None:
        """One train step on ``batch``, finished when it returns."""
        self.carry = self._step(*self.carry, batch)
        _block(self.carry)

    def params(self) -> Params:
        """The current parameters."""
        return self.carry[0]

    def opt_state(self) -> Any:
        """The current inner (optax) optimizer state."""
        return self.carry[1]

    def scale(self) -> float:
        """The current loss scale."""
        raise NotImplementedError

    def skipped(self) -> int | None:
        """Steps skipped so far, where the scaler counts them."""
        return None

    def _traced(self) -> None:
        self.traces += 1


def _copy(params: dict[str, np.ndarray]) -> Params:
    return {name: jnp.array(value, copy=True) for name, value in params.items()}


def _block(tree: Any) -> None:
    jax.block_until_ready(jax.tree_util.tree_leaves(tree))


class _Plain(Runner):
    """Plain optax; ``norm``: with the global sum of squares returned and unused (``"unused"``)
    or gating the update (``"gating"``)."""

    def __init__(
        self, loss: Loss, tx: optax.GradientTransformation, params: Params, norm: str | None
    ):
        super().__init__()
        self.carry = (params, tx.init(params))

        def step(params: Params, opt_state: Any, batch: Any) -> tuple[Any, ...]:
            self._traced()
            grads = _grad(loss, params, batch)
            if norm is None:
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state
            leaves = jax.tree_util.tree_leaves(grads)
            if norm == "unused":
                total = sum(jnp.sum(jnp.square(g)) for g in leaves)
            else:  # one leaf after the other, as amp_core does it inside a step
                total = in_step_sum_of_unscaled_squares(leaves, jnp.float32(1.0))
                grads = gate_by(total, grads)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, total

        self._step = jax.jit(step, donate_argnums=(0, 1))

    def step(self, batch: Any) -> None:
        out = self._step(*self.carry, batch)
        _block(out)
        self.carry = out[:2]

    def scale(self) -> float:
        return 1.0


def amp_core_config(settings: ScalerSettings) -> amp_core.DynamicLossScale:
    """The ``amp_core`` configuration of ``settings``."""
    return amp_core.DynamicLossScale(
        init_scale=settings.init_scale,
        steps_per_increase=settings.period,
        max_loss_scale=settings.max_scale,
        min_loss_scale=settings.min_scale,
    )


class _AmpCore(Runner):
    def __init__(
        self,
        loss: Loss,
        inner: optax.GradientTransformation,
        params: Params,
        settings: ScalerSettings,
        fused_apply: bool,
    ):
        super().__init__()
        config = amp_core_config(settings)
        tx = amp_core.with_loss_scaling(inner, config)
        self.carry = (params, tx.init(params))

        def step(params: Params, opt_state: Any, batch: Any) -> tuple[Any, Any]:
            self._traced()
            scaler = amp_core.loss_scale_state(opt_state)
            grads = _grad(lambda p, b: amp_core.scale_loss(scaler, loss(p, b)), params, batch)
            if fused_apply:
                return amp_core.apply_scaled_gradients(inner, config, grads, opt_state, params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._step = jax.jit(step, donate_argnums=(0, 1))

    def opt_state(self) -> Any:
        return self.carry[1].inner_state

    def scale(self) -> float:
        return float(amp_core.loss_scale_state(self.carry[1]).loss_scale)

    def skipped(self) -> int | None:
        return int(amp_core.loss_scale_state(self.carry[1]).num_skipped_steps)


class _Jmp(Runner):
    """jmp 0.0.4 as its README's dynamic loss scaling recipe, with the optimizer state selected
    too. The scale is a float32 array: the README's ``jmp.half_dtype()(2 ** 15)`` raises a
    ``TypeError`` in ``adjust`` (see :mod:`benchmarks.scaler_checks`)."""

    def __init__(
        self,
        loss: Loss,
        tx: optax.GradientTransformation,
        params: Params,
        settings: ScalerSettings,
    ):
        super().__init__()
        import jmp

        loss_scale = jmp.DynamicLossScale(
            jnp.asarray(settings.init_scale, jnp.float32),
            period=settings.period,
            min_loss_scale=jnp.asarray(settings.min_scale, jnp.float32),
        )
        self.carry = (params, tx.init(params), loss_scale)

        def step(params: Params, opt_state: Any, loss_scale: Any, batch: Any) -> tuple[Any, ...]:
            self._traced()
            grads = _grad(lambda p, b: loss_scale.scale(loss(p, b)), params, batch)
            grads = loss_scale.unscale(grads)
            grads_finite = jmp.all_finite(grads)
            loss_scale = loss_scale.adjust(grads_finite)
            updates, new_opt_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            params = jmp.select_tree(grads_finite, new_params, params)
            opt_state = jmp.select_tree(grads_finite, new_opt_state, opt_state)
            return params, opt_state, loss_scale

        self._step = jax.jit(step, donate_argnums=(0, 1, 2))

    def scale(self) -> float:
        return float(self.carry[2].loss_scale)


class _Flax(Runner):
    """flax's ``DynamicScale`` as ``examples/imagenet/train.py`` uses it (without ``pmap``)."""

    def __init__(
        self,
        loss: Loss,
        tx: optax.GradientTransformation,
        params: Params,
        settings: ScalerSettings,
    ):
        super().__init__()
        from flax.training import dynamic_scale as dynamic_scale_lib
        from flax.training import train_state

        class TrainState(train_state.TrainState):
            dynamic_scale: dynamic_scale_lib.DynamicScale

        dynamic_scale = dynamic_scale_lib.DynamicScale(
            growth_interval=settings.period,
            scale=settings.init_scale,
            minimum_scale=settings.min_scale,
        )
        self.carry = TrainState.create(
            apply_fn=None, params=params, tx=tx, dynamic_scale=dynamic_scale
        )

        def step(state: Any, batch: Any) -> Any:
            self._traced()
            dynamic_scale = state.dynamic_scale
            grad_fn = dynamic_scale.value_and_grad(lambda p: loss(p, batch))
            dynamic_scale, is_fin, _, grads = grad_fn(state.params)
            new_state = state.apply_gradients(grads=grads)
            select = functools.partial(jnp.where, is_fin)
            return new_state.replace(
                opt_state=jax.tree_util.tree_map(select, new_state.opt_state, state.opt_state),
                params=jax.tree_util.tree_map(select, new_state.params, state.params),
                dynamic_scale=dynamic_scale,
            )

        self._step = jax.jit(step, donate_argnums=(0,))

    def step(self, batch: Any) -> None:
        self.carry = self._step(self.carry, batch)
        _block(self.carry)

    def params(self) -> Params:
        return self.carry.params

    def opt_state(self) -> Any:
        return self.carry.opt_state

    def scale(self) -> float:
        return float(self.carry.dynamic_scale.scale)


class _Mpx(Runner):
    """mpx 0.1.8 as its README: ``filter_value_and_grad`` (which casts the model's floating
    arrays to float16 before the forward) and ``optimizer_update``, under ``eqx.filter_jit``
    (every array but the batch donated)."""

    def __init__(
        self,
        loss: Loss,
        tx: optax.GradientTransformation,
        params: Params,
        settings: ScalerSettings,
    ):
        super().__init__()
        import equinox as eqx
        import mpx

        mpx.set_half_precision_datatype(jnp.float16)
        loss_scaling = mpx.DynamicLossScaling(
            loss_scaling=jnp.asarray(settings.init_scale, jnp.float32),
            min_loss_scaling=jnp.asarray(settings.min_scale, jnp.float32),
            period=settings.period,
        )
        self.carry = (params, tx.init(params), loss_scaling)

        def step(batch: Any, model: Params, opt_state: Any, loss_scaling: Any) -> tuple[Any, ...]:
            self._traced()
            grad_fn = mpx.filter_value_and_grad(loss, scaling=loss_scaling)
            _, loss_scaling, grads_finite, grads = grad_fn(model, batch)
            model, opt_state = mpx.optimizer_update(model, tx, opt_state, grads, grads_finite)
            return model, opt_state, loss_scaling

        self._step = eqx.filter_jit(step, donate="all-except-first")

    def step(self, batch: Any) -> None:
        self.carry = self._step(batch, *self.carry)
        _block(self.carry)

    def scale(self) -> float:
        return float(self.carry[2].loss_scaling)


def build(
    name: str,
    loss: Loss,
    tx: optax.GradientTransformation,
    params: dict[str, np.ndarray],
    settings: ScalerSettings | None = None,
) -> Runner:
    """The runner of variant ``name`` (one of :data:`VARIANTS`) on a copy of ``params``.

    Args:
        name: the variant.
        loss: ``loss(params, batch)``, float32 scalar (computed in float16 inside).
        tx: the optax optimizer (plain, or the one the scaler wraps).
        params: float32 parameters; each runner gets its own copy (its steps donate them).
        settings: the dynamic loss scale (default: :class:`ScalerSettings`'s, about 1 and never
            changing, as the timing wants it).

    Raises:
        ValueError: an unknown variant name.
    """
    settings = settings or ScalerSettings()
    own = _copy(params)
    if name in (PLAIN, FLOOR, GATED_FLOOR):
        norm = {PLAIN: None, FLOOR: "unused", GATED_FLOOR: "gating"}[name]
        return _Plain(loss, tx, own, norm)
    if name in (WITH_LOSS_SCALING, APPLY_SCALED):
        return _AmpCore(loss, tx, own, settings, fused_apply=name == APPLY_SCALED)
    peers: dict[str, type[_Jmp | _Flax | _Mpx]] = {JMP: _Jmp, FLAX: _Flax, MPX: _Mpx}
    if name not in peers:
        raise ValueError(f"unknown variant {name!r}; choose from {list(VARIANTS)}")
    return peers[name](loss, tx, own, settings)


# --- Timing --------------------------------------------------------------------------------


@dataclasses.dataclass
class StepGroup:
    """The measurements of one loss: first steps, timed rounds and traces per variant."""

    loss: str
    first: dict[str, FirstStep]
    timings: dict[str, Timing]
    traces: dict[str, int]


def run_group(
    spec: SizeSpec,
    loss: str,
    plan: Plan,
    counter: CompileCounter,
    on_round: Callable[[], object] = lambda: None,
    seed: int = 0,
    variants: tuple[str, ...] | None = None,
) -> StepGroup:
    """Times every variant's whole train step on ``loss``, interleaved.

    Args:
        spec: the size whose layout the parameters take.
        loss: one of :data:`LOSSES`.
        plan: rounds, steps per round and warm-up.
        counter: a listening compile counter.
        on_round: progress callback, once per round.
        seed: seeds the parameters and tokens.
        variants: which of :data:`VARIANTS` to time (default :func:`variants_of` ``loss``).
    """
    params = make_params(spec, seed)
    accumulated = loss == ACCUMULATED
    tokens = make_tokens(spec, seed, MICRO_BATCHES if accumulated else None)
    variants = variants_of(loss) if variants is None else variants
    loss_fn = LOSS_FUNCTIONS[loss]
    runners: dict[str, Runner] = {}

    def make(name: str) -> Variant:
        runner = build(name, loss_fn, optax.adamw(LEARNING_RATE), params)
        runners[name] = runner
        return Variant(name, functools.partial(runner.step, tokens))

    first, timings = measure_group(variants, make, plan, counter, on_round)
    traces = {name: runner.traces for name, runner in runners.items()}
    return StepGroup(loss, first, timings, traces)
