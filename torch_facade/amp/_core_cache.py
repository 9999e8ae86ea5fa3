"""The facade's compiled decision core, kept on disk between runs of a script.

The first decision of a process used to trace, lower and compile the jitted core: 0.3-0.6 s on
a 2-core CPU, paid again by every run of the same script (and by every DDP rank). Here the
compiled executable is serialized (``jax.experimental.serialize_executable``) into a file whose
name is a digest of everything that decides what XLA compiled, and the next run loads it
instead: about 10 ms, with no tracing, no lowering and no compile.

Why not JAX's own persistent compilation cache: JAX computes its key from the lowered module,
so a hit still pays the tracing, the lowering and the start of MLIR (100-250 ms here), and its
configuration is process-wide: turning it on for the facade would cache the user's own
functions too, in a directory they never chose. This cache holds the facade's core only.

Where (the "Start-up" section of ``docs/performance.md`` says the same):

* ``CSTORCH_AMP_CACHE_DIR`` in the environment: that directory; ``off`` (or ``0``, ``false``,
  ``none``, empty) turns the cache off;
* else, if the user set JAX's ``jax_compilation_cache_dir``: its ``cstorch-amp`` subdirectory
  (JAX's own eviction ignores it), so that compiled code lives where the user put it;
* else, if the user turned JAX's cache off (``jax_enable_compilation_cache=False``): off;
* else ``$XDG_CACHE_HOME/cstorch-amp/xla`` (``~/.cache/cstorch-amp/xla``).

The key covers: this cache's format; the versions of jax and jaxlib; the backend's platform and
version, the device kind, the device and the device count; the host CPU (XLA:CPU compiles for
its instruction set); ``XLA_FLAGS``; the JAX options that change lowering (x64, matmul
precision, dtype promotion); the library's version and a digest of the source of ``amp_core``,
``hardware`` and ``torch_facade`` (whose code is traced); the core's name and configuration; and every
argument's shape and dtype. A stored entry repeats its key in full and is used only if it
matches. An entry that cannot be read or loaded is compiled again and replaced; a directory
that cannot be written leaves the run uncached. Like JAX's cache, the directory is trusted:
loading an executable from it runs its code.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

__all__ = ["ENV_VAR", "PersistentCore", "cache_dir", "persistent"]

ENV_VAR = "CSTORCH_AMP_CACHE_DIR"
"""The environment variable that moves the cache (a directory) or turns it off (``off``)."""

_OFF = ("", "0", "off", "false", "none", "no")
_FORMAT = "cstorch-amp core cache 1"
_PACKAGES = ("amp_core", "hardware", "torch_facade")


def cache_dir() -> Path | None:
    """The directory the facade's compiled cores are kept in, or ``None`` when it is off.

    Read when a core is first made and at each compile (not at import), so a script may set
    ``CSTORCH_AMP_CACHE_DIR`` or JAX's options before its first decision.

    Example:
        >>> from unittest import mock
        >>> from torch_facade.amp import _core_cache
        >>> with mock.patch.dict("os.environ", {"CSTORCH_AMP_CACHE_DIR": "off"}):
        ...     print(_core_cache.cache_dir())
        None
        >>> with mock.patch.dict("os.environ", {"CSTORCH_AMP_CACHE_DIR": "/tmp/cores"}):
        ...     print(_core_cache.cache_dir())
        /tmp/cores
    """
    chosen = os.environ.get(ENV_VAR)
    if chosen is not None:
        return None if chosen.strip().lower() in _OFF else Path(chosen).expanduser()
    jax_dir = _jax_option("jax_compilation_cache_dir")
    if jax_dir:
        return Path(str(jax_dir)).expanduser() / "cstorch-amp"
    if _jax_option("jax_enable_compilation_cache") is False:
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cstorch-amp" / "xla"


def _jax_option(name: str) -> Any:
    try:
        return getattr(jax.config, name)
    except AttributeError:
        return None


class PersistentCore:
    """A jitted core whose executables are loaded from the disk cache, one per argument structure.

    Called like the jitted function. The steady call is the loaded executable's own call (one
    ``try`` around it); another argument structure makes it look up, load or compile the
    executable for that structure (kept in memory from then on).

    Args:
        jitted: the ``jax.jit``-wrapped core.
        name: the core's name and static configuration, part of the key.
    """

    __slots__ = ("_by_structure", "_current", "_jitted", "_name")

    def __init__(self, jitted: Any, name: str) -> None:
        self._jitted = jitted
        self._name = name
        self._current: Callable[..., Any] | None = None
        self._by_structure: dict[str, Callable[..., Any]] = {}

    def __call__(self, *args: Any) -> Any:
        current = self._current
        if current is not None:
            try:
                return current(*args)
            except TypeError:  # another structure (JAX checks before running anything)
                pass
        structure = _structure(args)
        current = self._by_structure.get(structure)
        if current is None:
            current = self._by_structure[structure] = self._executable(args, structure)
        self._current = current
        return current(*args)

    def _executable(self, args: tuple[Any, ...], structure: str) -> Callable[..., Any]:
        directory = cache_dir()
        if directory is None:
            return self._jitted  # no cache: jit's own dispatch, as without this class
        device = _device_of(args)
        key = _key(self._name, structure, device)
        path = directory / (hashlib.sha256(key.encode()).hexdigest() + ".xla")
        loaded = _load(path, key, device)
        if loaded is not None:
            return loaded
        compiled = self._jitted.lower(*args).compile()
        _store(path, key, compiled)
        return compiled


def persistent(jitted: Any, name: str) -> Any:
    """``jitted`` with its executables kept in the disk cache (:class:`PersistentCore`), or
    ``jitted`` itself when the cache is off (:func:`cache_dir`)."""
    if cache_dir() is None:
        return jitted
    return PersistentCore(jitted, name)


def _structure(args: tuple[Any, ...]) -> str:
    leaves, tree = jax.tree_util.tree_flatten(args)
    shapes = ",".join(f"{leaf.dtype}{list(leaf.shape)}" for leaf in leaves)
    return f"{tree} {shapes}"


def _device_of(args: tuple[Any, ...]) -> jax.Device:
    for leaf in jax.tree_util.tree_leaves(args):
        devices = leaf.devices()
        if len(devices) == 1:
            return next(iter(devices))
    return jax.devices()[0]


def _key(name: str, structure: str, device: jax.Device) -> str:
    client = device.client
    return "\n".join(
        [
            _FORMAT,
            f"jax {jax.__version__} jaxlib {_jaxlib_version()}",
            f"backend {client.platform} {client.platform_version} {device.device_kind}",
            f"device {device.id} of {len(client.devices())}",
            f"host {_host_cpu()}",
            f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}",
            f"options {_lowering_options()}",
            f"source {_library_version()} {_source_digest()}",
            f"core {name}",
            f"arguments {structure}",
        ]
    )


def _library_version() -> str:
    module = sys.modules.get("amp_core")
    return str(getattr(module, "__version__", "?"))


def _jaxlib_version() -> str:
    import jaxlib

    return str(getattr(jaxlib, "__version__", "?"))


def _lowering_options() -> str:
    names = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion")
    return " ".join(f"{name}={_jax_option(name)}" for name in names)


@functools.cache
def _host_cpu() -> str:
    """The host's processor and its instruction-set flags (XLA:CPU compiles for them)."""
    described = f"{platform.system()} {platform.machine()} {platform.processor()}"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            first = cpuinfo.read().split("\n\n", 1)[0]
    except OSError:
        return described
    wanted = ("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU part")
    lines = [line for line in first.splitlines() if line.split(":", 1)[0].strip() in wanted]
    return described + " " + hashlib.sha256("\n".join(lines).encode()).hexdigest()


@functools.cache
def _source_digest() -> str:
    """A digest of the Python source of the packages whose code a core traces."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        module = sys.modules.get(package)
        if module is None or module.__file__ is None:
            continue
        root = Path(module.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _load(path: Path, key: str, device: jax.Device) -> Callable[..., Any] | None:
    """The executable stored at ``path`` for ``key``, or ``None`` (absent, unreadable, stale)."""
    try:
        with open(path, "rb") as stored:
            stored_key, serialized, in_tree, out_tree = pickle.load(stored)
        if stored_key != key:
            return None
        from jax.experimental import serialize_executable

        return serialize_executable.deserialize_and_load(
            serialized, in_tree, out_tree, backend=device.client, execution_devices=[device]
        )
    except Exception:  # absent, truncated, from another jax: compile again
        return None


def _store(path: Path, key: str, compiled: Any) -> None:
    """Writes ``compiled`` to ``path`` atomically; a directory that cannot be written (or a
    compile that cannot be serialized) leaves the run uncached, silently."""
    try:
        from jax.experimental import serialize_executable

        serialized, in_tree, out_tree = serialize_executable.serialize(compiled)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as out:
                pickle.dump((key, serialized, in_tree, out_tree), out)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except Exception:
        return
