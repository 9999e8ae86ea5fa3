"""The guards on how the loss scaler is composed with ``optax.MultiSteps`` and ``optax.chain``.

Internal to amp_core (:mod:`amp_core.transforms` calls them); no stability promise.

The loss scaler must see the gradients before anything that reads their values, and it must be
the transformation MultiSteps accumulates for, not one that MultiSteps wraps (MultiSteps resets
its accumulator by a multiply by zero, which keeps an overflowed step's NaN). optax gives a
transformation no way to know where it sits: a chain's elements and MultiSteps' inner
transformation are closures. So :func:`refuse_inside_multi_steps` and
:func:`warn_if_chained_after_others` look at the call stack from ``init``, which optax calls
once per state, for the code objects of ``optax.MultiSteps.init`` and of the generator that
``optax.chain``'s ``init`` runs its elements' inits in; where optax builds these otherwise,
nothing is found and nothing is said. :func:`multi_steps_of` and :func:`is_default_skip_fn`
recognize a MultiSteps given as ``inner`` and its default (never-skip) skip function.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any

import optax


def multi_steps_of(inner: Any) -> optax.MultiSteps | None:
    """The ``optax.MultiSteps`` that ``inner`` is, or whose ``gradient_transformation()`` it is."""
    if isinstance(inner, optax.MultiSteps):
        return inner
    if isinstance(inner, optax.GradientTransformation):
        owner = getattr(inner.update, "__self__", None)
        if isinstance(owner, optax.MultiSteps) and inner.update == owner.update:
            return owner
    return None


_MULTI_STEPS_INIT = optax.MultiSteps.init.__code__


def refuse_inside_multi_steps() -> None:
    """Raises if an ``optax.MultiSteps.init`` is on the call stack (``init`` is called once).

    The wrapped transformation cannot see MultiSteps' accumulator, whose reset (a multiply by
    zero) keeps the NaN of an overflowed accumulated step: the order cannot hold the rule.
    """
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _MULTI_STEPS_INIT:
            raise ValueError(
                "optax.MultiSteps(amp_core.with_loss_scaling(tx, config), k) cannot hold the "
                "loss scaler's accumulation rule: MultiSteps resets its accumulator by "
                "multiplying it by zero, which keeps the NaN of an overflowed accumulated step, "
                "so every later step would be skipped. Put the scaler outside: "
                "amp_core.with_loss_scaling(optax.MultiSteps(tx, k), config)"
            )
        frame = frame.f_back


def _chain_init_generator() -> types.CodeType | None:
    """The code of the generator that ``optax.chain``'s ``init`` runs its elements' inits in."""
    code = getattr(optax.chain(optax.identity()).init, "__code__", None)
    found = [c for c in (code.co_consts if code else ()) if isinstance(c, types.CodeType)]
    return found[0] if len(found) == 1 else None


_CHAIN_INIT_GENERATOR = _chain_init_generator()


def warn_if_chained_after_others() -> None:
    """Warns if an ``optax.chain`` on the call stack runs other transformations before this one.

    They receive the *scaled* gradients: ``optax.chain(optax.clip_by_global_norm(1.0),
    with_loss_scaling(tx, config))`` clips gradients ``loss_scale`` times too large. Found from
    ``init`` (called once) by the element the chain's generator is initializing; a warning, not
    an error, because a transformation that is linear in the gradients (``optax.scale``) is
    harmless there. Where optax's chain is built otherwise, nothing is found and nothing warned.
    """
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and _CHAIN_INIT_GENERATOR is not None:
        if frame.f_code is _CHAIN_INIT_GENERATOR and frame.f_back is not None:
            current = frame.f_locals.get("fn")
            elements = frame.f_back.f_locals.get("init_fns", ())
            position = next((i for i, fn in enumerate(elements) if fn is current), 0)
            if position > 0:
                warnings.warn(
                    f"amp_core.with_loss_scaling is element {position} of an optax.chain: the "
                    f"{position} transformation(s) before it receive the *scaled* gradients "
                    "(a clip_by_global_norm there clips gradients loss_scale times too large). "
                    "Put them inside the scaler: amp_core.with_loss_scaling(optax.chain(..., "
                    "tx), config), or clip with DynamicLossScale(max_gradient_norm=...)",
                    UserWarning,
                    stacklevel=2,
                )
                return
        frame = frame.f_back


def is_default_skip_fn(fn: Any) -> bool:
    """Whether ``fn`` is the never-skip function MultiSteps puts in place of ``None``."""
    return getattr(fn, "__qualname__", None) == "MultiSteps.__init__.<locals>.should_skip_update_fn"
