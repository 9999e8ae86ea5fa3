"""Interleaved timing of benchmark variants, summary statistics and a JAX compile counter."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax.monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""The event JAX records (with its duration) once per XLA backend compilation.

Defined as ``jax._src.dispatch.BACKEND_COMPILE_EVENT``; a persistent-cache hit does not record it.
"""


class CompileCounter:
    """Counts XLA backend compilations and their seconds while :meth:`listening`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from workbench.timing import CompileCounter
        >>> counter = CompileCounter()
        >>> with counter.listening():
        ...     _ = jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()
        >>> counter.count >= 1
        True
    """

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0

    def _listener(self, event: str, duration: float, **_: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    @contextlib.contextmanager
    def listening(self) -> Iterator[CompileCounter]:
        """Registers the listener for the duration of the ``with`` block."""
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        try:
            yield self
        finally:
            jax.monitoring.unregister_event_duration_listener(self._listener)

    def snapshot(self) -> tuple[int, float]:
        """``(count, seconds)`` so far."""
        return self.count, self.seconds


@dataclasses.dataclass
class Variant:
    """One thing to time.

    Attributes:
        name: unique within one interleaved group.
        step: the timed call; it must return only once its work is complete.
        refill: untimed preparation before every timed call (e.g. copying gradients back).
        part: if given, read after every timed call: the seconds of a part of that call timed
            in place by the step itself (e.g. a scaler's calls inside a whole iteration).
    """

    name: str
    step: Callable[[], Any]
    refill: Callable[[], Any] = lambda: None
    part: Callable[[], float] | None = None


@dataclasses.dataclass
class Stats:
    """Median, minimum and maximum over rounds (``nan`` where no round gave a value)."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        """Statistics of the finite values in ``values``.

        Example:
            >>> from workbench.timing import Stats
            >>> Stats.of([3.0, 1.0, 2.0, float("nan")])
            Stats(median=2.0, min=1.0, max=3.0)
        """
        finite = [v for v in values if math.isfinite(v)]
        if not finite:
            return cls(math.nan, math.nan, math.nan)
        return cls(statistics.median(finite), min(finite), max(finite))

    def as_dict(self) -> dict[str, float]:
        """``{"median": ..., "min": ..., "max": ...}``."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Timing:
    """What :func:`run_interleaved` measured for one variant.

    Attributes:
        rounds: one value per round, the median of that round's timed calls (seconds).
        samples: every timed call, per round (seconds).
        compiles: XLA compilations during the timed rounds (must be 0).
        iters: timed calls per round.
        part_rounds: per round, the median of :attr:`Variant.part` over the timed calls (empty
            for a variant without one).
    """

    rounds: list[float] = dataclasses.field(default_factory=list)
    samples: list[list[float]] = dataclasses.field(default_factory=list)
    part_rounds: list[float] = dataclasses.field(default_factory=list)
    compiles: int = 0
    iters: int = 0

    @property
    def stats(self) -> Stats:
        """Statistics over rounds."""
        return Stats.of(self.rounds)


@dataclasses.dataclass
class FirstStep:
    """The first call of a variant, and the compilations it (and its construction) caused.

    Attributes:
        seconds: wall time of the first timed call.
        compiles: XLA compilations during construction and the first call.
        compile_seconds: their total duration, as JAX reports it.
    """

    seconds: float
    compiles: int
    compile_seconds: float


def first_step(variant: Variant, counter: CompileCounter, since: tuple[int, float]) -> FirstStep:
    """Times ``variant``'s first call; compilations are counted from the ``since`` snapshot.

    Args:
        variant: the variant, just constructed.
        counter: a listening compile counter.
        since: ``counter.snapshot()`` taken before the variant was constructed.
    """
    variant.refill()
    start = time.perf_counter()
    variant.step()
    seconds = time.perf_counter() - start
    count, compile_seconds = counter.snapshot()
    return FirstStep(seconds, count - since[0], compile_seconds - since[1])


def warm_up(variants: Sequence[Variant], steps: int) -> float:
    """Calls every variant ``steps`` times (after its refill), untimed for the report.

    Returns:
        The slowest variant's fastest warm-up call (seconds; 0 without warm-up): a step time
        that one stray pause of the machine does not inflate.
    """
    fastest = {v.name: math.inf for v in variants}
    for _ in range(steps):
        for variant in variants:
            variant.refill()
            start = time.perf_counter()
            variant.step()
            fastest[variant.name] = min(fastest[variant.name], time.perf_counter() - start)
    return max(fastest.values(), default=0.0) if steps else 0.0


ROUND_TARGET_S = 0.5
"""Aimed-at seconds of one variant's timed calls in one round (bounds the run on a busy machine)."""

MIN_ROUND_S = 0.2
"""The least seconds of one variant's timed calls in one round: shorter rounds make a median of
noise (one or two steps of a few ms, where the machine's hiccups are as long)."""

MAX_ITERS = 10_000
"""No round times more calls than this, however short a call."""


def choose_iters(max_iters: int, step_s: float, fixed: bool) -> int:
    """Timed calls per variant and round: ``max_iters``, fewer when steps are slow, and more
    when ``max_iters`` steps would take less than :data:`MIN_ROUND_S`.

    Args:
        max_iters: the size's count (or the user's ``--iters``).
        step_s: the group's step time from :func:`warm_up`.
        fixed: use ``max_iters`` as is (the user asked for it).

    Example:
        >>> from workbench.timing import choose_iters
        >>> choose_iters(5, 0.05, False), choose_iters(5, 1.5, False), choose_iters(5, 1.5, True)
        (5, 1, 5)
        >>> choose_iters(5, 0.004, False)  # 5 steps are 0.02 s: 50 make 0.2 s
        50
    """
    if fixed or step_s <= 0:
        return max_iters
    at_least = min(MAX_ITERS, math.ceil(MIN_ROUND_S / step_s))
    return max(1, at_least, min(max_iters, int(ROUND_TARGET_S / step_s)))


def run_interleaved(
    variants: Sequence[Variant],
    rounds: int,
    iters: int,
    counter: CompileCounter,
    on_round: Callable[[], Any] = lambda: None,
    run: int = 0,
) -> dict[str, Timing]:
    """Times the variants round by round, interleaved, in this process.

    Each round runs every variant ``iters`` times in a row (each call after its untimed refill),
    or with ``run`` in runs of ``run`` timed calls, each run after one untimed call of the same
    variant, the variants taking turns run by run until each has made ``iters`` timed calls; the
    variants' order rotates from round to round so that none always follows the same one.
    Python's garbage collector is paused while timing, as ``timeit`` does.

    Args:
        variants: the variants, already warmed up.
        rounds: number of rounds.
        iters: timed calls per variant and round.
        counter: a listening compile counter (compilations are attributed to variants).
        on_round: called after every round (progress).
        run: interleave in runs of this many calls (see :class:`Plan`); 0: variant by variant.

    Returns:
        One :class:`Timing` per variant name.
    """
    timings = {v.name: Timing(iters=iters) for v in variants}
    for round_index in range(rounds):
        shift = round_index % len(variants)
        order = list(variants[shift:]) + list(variants[:shift])
        samples: dict[str, list[float]] = {v.name: [] for v in order}
        parts: dict[str, list[float]] = {v.name: [] for v in order}
        gc.collect()
        gc.disable()
        try:
            for variant, calls, untimed in _blocks(order, iters, run):
                for call in range(untimed + calls):
                    before = counter.count
                    variant.refill()
                    start = time.perf_counter()
                    variant.step()
                    seconds = time.perf_counter() - start
                    if call >= untimed:
                        samples[variant.name].append(seconds)
                        if variant.part is not None:
                            parts[variant.name].append(variant.part())
                    timings[variant.name].compiles += counter.count - before
        finally:
            gc.enable()
        for variant in order:
            timing = timings[variant.name]
            timing.samples.append(samples[variant.name])
            timing.rounds.append(statistics.median(samples[variant.name]))
            if parts[variant.name]:
                timing.part_rounds.append(statistics.median(parts[variant.name]))
        on_round()
    return timings


def _blocks(order: Sequence[Variant], iters: int, run: int) -> list[tuple[Variant, int, int]]:
    """One round's ``(variant, timed calls, untimed calls before them)``, in the order run."""
    if run <= 0:
        return [(variant, iters, 0) for variant in order]
    blocks = []
    for start in range(0, iters, run):
        blocks += [(variant, min(run, iters - start), 1) for variant in order]
    return blocks


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one group of variants is timed.

    Attributes:
        rounds: timed rounds.
        max_iters: timed calls per variant and round (fewer when steps are slow, unless fixed).
        warmup: untimed calls per variant after its first call (at least one is made, to size
            the rounds).
        fixed_iters: always use ``max_iters``.
        run: interleave within a round in runs of this many timed calls per variant, each run
            after one untimed call of the same variant, instead of variant by variant (0): a
            drift of the machine's speed over a round (large on shared virtual machines:
            ``docs/performance-notes.md``) then reaches every variant alike, while each
            timed call still follows a call of its own variant, as in a training loop. For steps
            of a millisecond or two, where such a drift is larger than the differences
            measured. (Alternating call by call would put the other variants' iterations
            between two of a variant's: their code and data evict its own from the caches,
            which a training loop never sees. On the host-cost model two identical facade loops
            measured that way, one right after torch's loop and one right after the other,
            differed by a sizeable share of torch's scaler overhead (the figure:
            ``docs/performance-notes.md``): the facade's iteration also runs JAX, whose code
            and data the other loops do not touch.)
    """

    rounds: int
    max_iters: int
    warmup: int
    fixed_iters: bool = False
    run: int = 0


def measure(
    variants: Sequence[Variant],
    plan: Plan,
    counter: CompileCounter,
    on_round: Callable[[], Any] = lambda: None,
) -> dict[str, Timing]:
    """Warms the variants up, picks the calls per round, and times them interleaved."""
    slowest = warm_up(variants, max(1, plan.warmup))
    iters = choose_iters(plan.max_iters, slowest, plan.fixed_iters)
    return run_interleaved(variants, plan.rounds, iters, counter, on_round, plan.run)


def measure_group(
    names: Sequence[str],
    make: Callable[[str], Variant],
    plan: Plan,
    counter: CompileCounter,
    on_round: Callable[[], Any] = lambda: None,
) -> tuple[dict[str, FirstStep], dict[str, Timing]]:
    """Builds the named variants, timing each one's first call, then measures them together.

    Args:
        names: the variant names, in order.
        make: builds the variant of a name (its compilations count towards its first step).
        plan: rounds, calls per round and warm-up.
        counter: a listening compile counter.
        on_round: called after every timed round (progress).

    Returns:
        The first step of every variant, and its timed rounds.
    """
    variants = []
    first = {}
    for name in names:
        since = counter.snapshot()
        variant = make(name)
        first[name] = first_step(variant, counter, since)
        variants.append(variant)
    return first, measure(variants, plan, counter, on_round)


class CpuShare:
    """CPU time used by *other* processes while this one runs (Linux ``/proc/stat``).

    ``other_cores()`` is the average number of cores other processes kept busy since
    construction: the machine's busy time minus this process's own CPU time, over wall time.
    ``None`` where ``/proc/stat`` is unavailable.
    """

    def __init__(self) -> None:
        self._start = self._snapshot()

    @staticmethod
    def _snapshot() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as stat:
                fields = [float(x) for x in stat.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        ticks = os.sysconf("SC_CLK_TCK")
        busy = (user + nice + system + irq + softirq + steal) / ticks
        own = os.times()
        return time.perf_counter(), busy, own.user + own.system

    def other_cores(self) -> float | None:
        """Average cores busy with other processes since construction."""
        end = self._snapshot()
        if self._start is None or end is None or end[0] <= self._start[0]:
            return None
        wall = end[0] - self._start[0]
        other = (end[1] - self._start[1]) - (end[2] - self._start[2])
        return max(0.0, other / wall)


def per_round(
    op: Callable[[float, float], float], left: Sequence[float], right: Sequence[float]
) -> list[float]:
    """``op`` applied round by round (``nan`` where it is undefined).

    Example:
        >>> from workbench.timing import per_round, ratio
        >>> per_round(ratio, [2.0, 3.0], [1.0, 0.0])
        [2.0, nan]
    """
    return [op(a, b) for a, b in zip(left, right, strict=True)]


def ratio(a: float, b: float) -> float:
    """``a / b``, or ``nan`` unless ``b > 0``."""
    return a / b if b > 0 else math.nan


def difference(a: float, b: float) -> float:
    """``a - b``."""
    return a - b


MS = 1e3
"""Milliseconds per second."""


def milliseconds(values: Sequence[float]) -> list[float]:
    """``values`` (seconds) in milliseconds."""
    return [v * MS for v in values]


def stats_dict(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of the finite values of ``values`` (see :meth:`Stats.of`).

    Example:
        >>> from workbench.timing import milliseconds, stats_dict
        >>> stats_dict(milliseconds([0.5, 0.25, 1.0, float("nan")]))
        {'median': 500.0, 'min': 250.0, 'max': 1000.0}
    """
    return Stats.of(values).as_dict()
