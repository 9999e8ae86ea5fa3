"""Test-suite setup shared by every package's tests.

XLA reads ``XLA_FLAGS`` when its CPU backend starts, so the flag that gives the sharding tests
eight host devices is set here, before any test module imports (and initialises) JAX.

The amp_core tests run under JAX's strict dtype promotion (as equinox's tests do): every implicit
promotion is an error, so a float16 gradient that silently became float32, or a float64 constant
leaking into float32 arithmetic, fails a test. (This lives here rather than in
``tests/amp_core/conftest.py``: two ``conftest.py`` files outside packages clash under
``--doctest-modules``.)
"""

import os
import sys
from pathlib import Path

import pytest

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _with_host_device_count(flags: str, count: int = 8) -> str:
    """Returns ``flags`` with the host device count flag added unless it is already there."""
    if _DEVICE_COUNT_FLAG in flags:
        return flags
    return f"{flags} {_DEVICE_COUNT_FLAG}={count}".strip()


os.environ["XLA_FLAGS"] = _with_host_device_count(os.environ.get("XLA_FLAGS", ""))

# Under pytest-xdist (``make test`` runs 2 workers on the 2-core machines) each worker's torch
# computes on one thread, unless the developer chose otherwise: with torch's default of a thread
# per core, the workers' OpenMP threads (and the ranks they start, which inherit this) wait on
# each other's cores. Measured on 5 torch-heavy files at ``-n 2`` (AMD EPYC, 2 cores): 155 s wall
# and 175 s of CPU with the default, 105 s and 107 s with one thread. Set before any test module
# imports torch, which reads it when it starts its thread pool.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The facade's disk cache of compiled cores (torch_facade/amp/_engine/_core_cache.py) stays off in
# the suite, whatever the developer's environment says: nothing is written into the home directory
# or the checkout, and tests that count compiles see them. tests/torch_facade/test_startup.py
# turns it on, in temporary directories.
os.environ["CSTORCH_AMP_CACHE_DIR"] = "off"

# pytest puts this directory on sys.path, where tests/amp_core (no __init__.py) would shadow the
# amp_core package as a namespace package when pytest runs as ``pytest`` rather than
# ``python -m pytest``. The repository root on sys.path keeps the real packages importable.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

_STRICT_PROMOTION_DIR = Path(__file__).resolve().parent / "amp_core"


@pytest.fixture(autouse=True, scope="module")
def _amp_core_dtype_promotion(request):
    """Strict dtype promotion for each module under tests/amp_core, restored afterwards.

    A module that drives third-party code relying on implicit promotion (optax's adamw computes
    ``decay ** count`` with an int32 count) opts out with ``DTYPE_PROMOTION = "standard"``.
    """
    if _STRICT_PROMOTION_DIR not in Path(request.path).resolve().parents:
        yield
        return
    import jax

    previous = jax.config.jax_numpy_dtype_promotion
    mode = getattr(request.module, "DTYPE_PROMOTION", "strict")
    jax.config.update("jax_numpy_dtype_promotion", mode)
    yield
    jax.config.update("jax_numpy_dtype_promotion", previous)


# The files that take longest, longest first (CPU seconds of a full run on the 2-core machines,
# 2026-12-07). ``make test`` runs ``--dist loadfile --no-loadscope-reorder``: pytest-xdist hands
# whole files to the two workers in collection order, so the long ones start first and the short
# ones fill in at the end, where xdist's default order (most tests first) left the long files
# with few tests (the demo's, the launchers') to run last on one worker while the other idled.
LONGEST_FIRST = (
    "tests/test_docs_pages.py",
    "tests/demo/test_demo.py",
    "tests/benchmarks/test_bench_harness.py",
    "tests/torch_facade/test_cbfloat16_compile.py",
    "tests/torch_facade/test_torchrun.py",
    "tests/demo/test_demo_distributed.py",
    "tests/device_check/test_device_check.py",
    "tests/amp_core/test_optax.py",
    "tests/amp_core/test_accumulation.py",
    "tests/notebooks/test_notebooks_execute.py",
    "tests/amp_core/test_multiprocess_sharded.py",
    "tests/benchmarks/test_memory_bench.py",
    "tests/benchmarks/test_startup_cbfloat16_bench.py",
    "tests/torch_facade/test_master_weights.py",
    "tests/torch_facade/test_startup.py",
    "tests/torch_facade/test_trainers_multiprocess.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Moves the files of :data:`LONGEST_FIRST` to the front, in that order (a stable sort: the
    tests of a file, and the other files, keep their order)."""
    root = Path(str(config.rootpath))
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        path = Path(str(item.path))
        name = path.relative_to(root).as_posix() if path.is_relative_to(root) else ""
        return rank.get(name, len(rank))

    items.sort(key=key)
