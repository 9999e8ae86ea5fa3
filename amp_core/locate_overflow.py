"""Which layer overflowed, for flax NNX and linen models: outputs and input gradients by module.

:func:`locate_overflow` is a context manager over a debugging pass (a forward, and a gradient
when one is taken inside it). While it is open, every module call

* reports the largest magnitude of its output's floating-point leaves (a **forward** event when
  it is inf or NaN or above the threshold), through an ordered ``jax.debug.callback``;
* passes each floating-point array argument through an identity with a custom VJP whose
  backward reports the cotangent: the gradient w.r.t. that input *through this module*, which
  is what the module's backward produced (a **backward** event when out of range).

Callbacks run eagerly, under ``jax.grad`` and ``jax.jit`` alike, in program order (they are
ordered effects): forward events in the order modules return (a layer before the block that
holds it), then backward events from the last layer back. The values reach the host as the
program runs; reading the result waits for the callbacks (``jax.effects_barrier``).

The mechanisms, and what each cannot see:

* **flax NNX**: the ``__call__`` of each module class in the model is wrapped while the context
  is open, and each module of ``nnx.iter_modules(model)`` carries its name as a static
  attribute, so the names survive ``nnx.split``/``merge`` inside ``nnx.jit`` and ``nnx.grad``
  (which then retrace once on entry and once after exit). Methods other than ``__call__`` are
  not recorded; a class's other instances outside the model pass through unrecorded.
* **flax linen**: ``flax.linen.intercept_methods`` records every method of every linen module
  called inside the block (``setup`` aside), named by the module's path. A function that
  ``jax.jit`` traced *before* the block keeps its compiled program without the callbacks and
  shows nothing: apply the model eagerly, or jit a function defined inside the block. A
  function jitted inside the block keeps its callbacks after it, which then report to no one.
* **equinox** is not supported: its modules are immutable pytrees, rebuilt from their leaves
  under ``jax.grad`` and ``eqx.filter_jit``, so neither an attribute nor an identity can carry a
  module's name into the traced call.

Only arrays passed directly as arguments get a backward tap (not arrays inside a tuple or dict
argument), ``jax.vmap`` of the pass is not supported (ordered effects), and forward-mode
differentiation (``jax.jvp``, ``jax.jacfwd``) of a tapped module fails (custom VJP). On exit
every wrapper, tag and interceptor is removed, also when the block raises.

``import amp_core`` does not import this module's flax dependency: flax is looked up only
when the model is a flax module, and never imported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import numbers
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hardware import DEFAULT_HALF_DTYPE, canonical_half_dtype, get_format

_FORWARD = "forward"
_BACKWARD = "backward"
_TAG = "_amp_core_locate_overflow_tag"


@dataclasses.dataclass(frozen=True)
class OverflowEvent:
    """One module output (forward) or input gradient (backward) that left the range.

    Attributes:
        name: the module's qualified name, its path joined with ``"."`` (``""``: the model).
        module_type: the module's class name (linen: ``Class.method`` for a method other
            than ``__call__``).
        kind: ``"forward"`` (its output) or ``"backward"`` (the gradient w.r.t. its inputs).
        abs_max: the largest absolute value (``inf``; ``nan`` when a NaN was present).
        call: the position of this check among all checks in the context, forward and
            backward together, counting the healthy ones (0-based): the order they ran in.

    Example:
        >>> from amp_core.locate_overflow import OverflowEvent
        >>> OverflowEvent("mid", "Linear", "forward", float("inf"), 3).kind
        'forward'
    """

    name: str
    module_type: str
    kind: str
    abs_max: float
    call: int


class LocatedOverflow:
    """What a ``locate_overflow`` context recorded: the overflowed modules, in the order they ran.

    Shared by the JAX door and ``cstorch.amp.locate_overflow``.

    Attributes:
        threshold: the largest magnitude that counts as in range.
        dtype: the half format the threshold is the maximum of, or ``None`` for an explicit
            ``threshold``.

    Example:
        >>> from amp_core.locate_overflow import LocatedOverflow
        >>> found = LocatedOverflow(65504.0, "float16")
        >>> found.first is None, found.calls
        (True, 0)
    """

    def __init__(self, threshold: float, dtype: str | None) -> None:
        self.threshold = threshold
        self.dtype = dtype
        self._calls = 0
        self._events: list[OverflowEvent] = []
        self._lock = threading.Lock()

    @property
    def calls(self) -> int:
        """How many module outputs and input gradients were checked (healthy ones included).

        Example:
            >>> from amp_core.locate_overflow import LocatedOverflow
            >>> LocatedOverflow(1.0, None).calls
            0
        """
        self._resolve()
        return self._calls

    @property
    def events(self) -> list[OverflowEvent]:
        """The checks that held inf or NaN or exceeded :attr:`threshold`, in the order they ran.

        Example:
            >>> from amp_core.locate_overflow import LocatedOverflow
            >>> LocatedOverflow(1.0, None).events
            []
        """
        self._resolve()
        return sorted(self._events, key=lambda event: event.call)

    @property
    def first(self) -> str | None:
        """The qualified name of the module of the first event, or ``None`` when there is none.

        Example:
            >>> from amp_core.locate_overflow import LocatedOverflow
            >>> LocatedOverflow(1.0, None).first is None
            True
        """
        events = self.events
        return events[0].name if events else None

    def __bool__(self) -> bool:
        return bool(self.events)

    def __str__(self) -> str:
        events, calls = self.events, self.calls
        limit = f"{self.threshold:g}"
        if self.dtype is not None:
            limit += f" (the {self.dtype} maximum)"
        summary = (
            f"{len(events)} of {calls} module outputs and input gradients checked held "
            f"inf or NaN or exceeded {limit}"
        )
        if not events:
            hint = "" if calls else " (no module call was seen inside the block)"
            return f"no overflow: {summary}{hint}"
        head = events[0]
        lines = [
            f"first overflow: {_display(head.name)} ({head.module_type}, {head.kind})",
            f"{'call':>6}  {'kind':<8}  {'abs max':>10}  module",
        ]
        for event in events:
            lines.append(
                f"{event.call:>6}  {event.kind:<8}  {event.abs_max:>10.3e}  "
                f"{_display(event.name)} ({event.module_type})"
            )
        lines.append(summary)
        return "\n".join(lines)

    def _next_call(self) -> int:
        with self._lock:
            call = self._calls
            self._calls += 1
        return call

    def _add(self, name: str, module_type: str, kind: str, value: float, call: int) -> None:
        """Keeps the check ``call`` as an event if ``value`` is out of range."""
        if math.isnan(value) or value > self.threshold:
            with self._lock:
                self._events.append(OverflowEvent(name, module_type, kind, value, call))

    def _resolve(self) -> None:
        """Brings the recorded values up to date (here: waits for the pending callbacks)."""
        jax.effects_barrier()


def _display(name: str) -> str:
    return name if name else "<model>"


def resolve_threshold(dtype: Any, threshold: Any, default_dtype: str) -> tuple[float, str | None]:
    """The threshold and the format it is the maximum of, from the ``locate_overflow`` arguments.

    Args:
        dtype: a half dtype (name or dtype object), or ``None``.
        threshold: an explicit positive threshold, or ``None``.
        default_dtype: the half dtype to use when both are ``None``.

    Returns:
        ``(threshold, dtype name or None)``.

    Raises:
        TypeError: ``threshold`` is not a real number.
        ValueError: ``dtype`` names no half dtype, ``threshold`` is not positive, or both given.

    Example:
        >>> from amp_core.locate_overflow import resolve_threshold
        >>> resolve_threshold(None, None, "float16"), resolve_threshold(None, 10, "float16")
        ((65504.0, 'float16'), (10.0, None))
    """
    if dtype is not None and threshold is not None:
        raise ValueError(
            f"locate_overflow: give dtype or threshold, not both; got dtype={dtype!r} and "
            f"threshold={threshold!r}"
        )
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
            raise TypeError(
                "locate_overflow: threshold must be a positive real number (a float or an int); "
                f"got {type(threshold).__name__} {threshold!r}"
            )
        value = float(threshold)
        if math.isnan(value) or value <= 0:
            raise ValueError(
                f"locate_overflow: threshold must be a positive number (inf: inf and NaN only); "
                f"got {threshold!r}"
            )
        return value, None
    name = default_dtype if dtype is None else canonical_half_dtype(dtype, argument="dtype")
    return float(get_format(name).max), name


# --------------------------------------------------------------------------------------------
# The taps: an ordered host callback per output, an identity with a reporting VJP per input.

_SESSIONS: dict[int, LocatedOverflow] = {}  # the open contexts, by id: callbacks look them up
_SESSION_IDS = itertools.count()


def _report(session: int, name: str, module_type: str, kind: str, value: Any) -> None:
    found = _SESSIONS.get(session)
    if found is not None:  # a program compiled in a closed context reports to no one
        found._add(name, module_type, kind, float(np.asarray(value)), found._next_call())


def _is_float_array(value: Any) -> bool:
    return (
        isinstance(value, jax.Array)
        and jnp.issubdtype(value.dtype, jnp.floating)
        and value.size > 0
    )


def _abs_max(arrays: list[jax.Array]) -> jax.Array:
    maxima = [jnp.max(jnp.abs(a)).astype(jnp.float32) for a in arrays]
    return maxima[0] if len(maxima) == 1 else jnp.max(jnp.stack(maxima))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gradient_tap(report: Callable[[Any], None], x: jax.Array) -> jax.Array:
    return x


def _gradient_tap_fwd(report: Callable[[Any], None], x: jax.Array) -> tuple[jax.Array, None]:
    return x, None


def _gradient_tap_bwd(
    report: Callable[[Any], None], _: None, cotangent: jax.Array
) -> tuple[jax.Array]:
    jax.debug.callback(report, _abs_max([cotangent]), ordered=True)
    return (cotangent,)


_gradient_tap.defvjp(_gradient_tap_fwd, _gradient_tap_bwd)


def _tapped_call(
    session: int,
    name: str,
    module_type: str,
    call: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``call(*args, **kwargs)`` with its array arguments and its output tapped."""
    backward = functools.partial(_report, session, name, module_type, _BACKWARD)

    def tap(value: Any) -> Any:
        return _gradient_tap(backward, value) if _is_float_array(value) else value

    output = call(*(tap(a) for a in args), **{k: tap(v) for k, v in kwargs.items()})
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(output) if _is_float_array(leaf)]
    if leaves:
        forward = functools.partial(_report, session, name, module_type, _FORWARD)
        jax.debug.callback(forward, _abs_max(leaves), ordered=True)
    return output


# --------------------------------------------------------------------------------------------
# The public entry point and the per-library mechanisms.


def locate_overflow(
    model: Any, *, dtype: Any = None, threshold: float | None = None
) -> contextlib.AbstractContextManager[LocatedOverflow]:
    """Records which modules' outputs or input gradients overflow during the block.

    The JAX door of ``cstorch.amp.locate_overflow``, for a flax NNX module (its submodules are
    watched) or a flax linen module (every linen module applied inside the block is watched);
    the module docstring says how, and what each mechanism cannot see. A debugging tool in the
    spirit of transformers' ``DebugUnderflowOverflow`` (huggingface/transformers#11076,
    #12225); on exit nothing of it remains.

    Args:
        model: an ``nnx.Module`` or a ``flax.linen.Module``.
        dtype: the half format whose maximum is the threshold (``"float16"``, ``"bfloat16"``,
            ``"cbfloat16"``, ``jnp.float16``, ``jnp.bfloat16``); ``None`` means float16.
        threshold: an explicit largest in-range magnitude instead (``math.inf``: record inf
            and NaN only). Give ``dtype`` or ``threshold``, not both.

    Returns:
        A context manager whose ``__enter__`` returns the :class:`LocatedOverflow` it fills.

    Raises:
        TypeError: ``model`` is not a flax module (an equinox module: not supported), or
            ``threshold`` is not a number.
        ValueError: ``dtype`` names no half dtype, ``threshold`` is not positive, or both
            were given.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from amp_core.locate_overflow import locate_overflow
        >>> model = nnx.Sequential(
        ...     nnx.Linear(4, 8, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0)),
        ...     nnx.Linear(8, 8, kernel_init=nnx.initializers.constant(1e4), rngs=nnx.Rngs(0)),
        ...     nnx.Linear(8, 1, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0)),
        ... )
        >>> with locate_overflow(model) as found:
        ...     grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((2, 4)))))(model)
        >>> found.first
        'layers.1'
        >>> [(e.name, e.kind, e.abs_max) for e in found.events]  # doctest: +NORMALIZE_WHITESPACE
        [('layers.1', 'forward', 320000.0), ('layers.2', 'forward', 2560000.0),
         ('', 'forward', 2560000.0), ('layers.1', 'backward', 80000.0)]
    """
    library = _library_of(model)
    limit, name = resolve_threshold(dtype, threshold, DEFAULT_HALF_DTYPE)
    found = LocatedOverflow(limit, name)
    if library == "nnx":
        return _nnx_session(model, found)
    return _linen_session(found)


def _library_of(model: Any) -> str:
    flax_loaded = "flax" in sys.modules  # a flax module exists only once flax is imported
    if flax_loaded:
        from flax import linen, nnx

        if isinstance(model, nnx.Module):
            return "nnx"
        if isinstance(model, linen.Module):
            return "linen"
    if "equinox" in sys.modules:
        import equinox

        if isinstance(model, equinox.Module):
            raise TypeError(
                "locate_overflow: equinox modules are not supported (they are rebuilt from "
                "their leaves under jax.grad and eqx.filter_jit, so no name reaches the traced "
                "call); expected a flax nnx.Module or flax.linen.Module, got "
                f"{type(model).__name__}"
            )
    raise TypeError(
        "locate_overflow: model must be a flax nnx.Module or flax.linen.Module (for torch "
        f"models use cstorch.amp.locate_overflow); got {type(model).__name__}"
    )


def _joined(path: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in path)


@contextlib.contextmanager
def _nnx_session(model: Any, found: LocatedOverflow) -> Iterator[LocatedOverflow]:
    from flax import nnx

    session = next(_SESSION_IDS)
    prefix = f"{session}:"
    in_progress: set[str] = set()  # a super().__call__ of a wrapped class is the same call
    tagged: list[tuple[Any, Any]] = []  # (module, the tag it had before, or _MISSING)
    patched: list[tuple[type, Callable[..., Any]]] = []

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            tag = getattr(self, _TAG, None)
            if not isinstance(tag, str) or not tag.startswith(prefix) or tag in in_progress:
                return original(self, *args, **kwargs)
            in_progress.add(tag)
            try:
                call = functools.partial(original, self)
                name = tag.removeprefix(prefix)
                return _tapped_call(session, name, type(self).__name__, call, args, kwargs)
            finally:
                in_progress.discard(tag)

        return __call__

    _SESSIONS[session] = found
    try:
        owners: dict[type, Callable[..., Any]] = {}
        for path, module in nnx.iter_modules(model):
            tagged.append((module, getattr(module, _TAG, _MISSING)))
            setattr(module, _TAG, prefix + _joined(path))
            owner = next((c for c in type(module).__mro__ if "__call__" in vars(c)), None)
            if owner is not None and owner is not object and owner not in owners:
                owners[owner] = vars(owner)["__call__"]
        for owner, original in owners.items():
            setattr(owner, "__call__", wrap(original))  # noqa: B010 (a class attribute)
            patched.append((owner, original))
        yield found
    finally:
        for owner, original in reversed(patched):
            setattr(owner, "__call__", original)  # noqa: B010
        for module, previous in reversed(tagged):
            if previous is _MISSING:
                delattr(module, _TAG)
            else:
                setattr(module, _TAG, previous)
        jax.effects_barrier()
        _SESSIONS.pop(session, None)


_MISSING = object()


@contextlib.contextmanager
def _linen_session(found: LocatedOverflow) -> Iterator[LocatedOverflow]:
    from flax import linen

    session = next(_SESSION_IDS)

    def interceptor(
        next_fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: Any,
    ) -> Any:
        if context.method_name == "setup":
            return next_fun(*args, **kwargs)
        module_type = type(context.module).__name__
        if context.method_name != "__call__":
            module_type += f".{context.method_name}"
        name = _joined(tuple(context.module.path))
        return _tapped_call(session, name, module_type, next_fun, args, kwargs)

    _SESSIONS[session] = found
    try:
        with linen.intercept_methods(interceptor):
            yield found
    finally:
        jax.effects_barrier()
        _SESSIONS.pop(session, None)
