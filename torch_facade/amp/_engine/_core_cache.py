"""The facade's compiled decision core, kept on disk between runs of a script.

The first decision of a process used to trace, lower and compile the jitted core, paid again by
every run of the same script (and by every DDP rank). Here the
compiled executable is serialized (``jax.experimental.serialize_executable``) into a file whose
name is a digest of everything that decides what XLA compiled, and the next run loads it
instead, with no tracing, no lowering and no compile (the costs of both: the "Start-up"
section of ``docs/performance.md``).

Why not JAX's own persistent compilation cache: JAX computes its key from the lowered module,
so a hit still pays the tracing, the lowering and the start of MLIR, and its
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
argument's shape and dtype. A stored entry starts with its key in full, compared before anything
is unpickled. An entry that cannot be read or loaded is compiled again and replaced (a new file
renamed over it: concurrent processes never read half an entry); a directory that cannot be
written leaves the run uncached.

Like JAX's cache, the directory is trusted: loading an executable from it runs its code. So,
before reading an entry, the folder and the entry (checked on the opened descriptors: a folder
reached through a symbolic link is checked at its target, an entry that is a symbolic link is
refused) must belong to the process's user or to root (who could change the user's files
anyway; a cache prepared by root in an image is usable), and neither their group nor others may
write them. Otherwise the cache is not read or written for the rest of the run, with one
``RuntimeWarning`` that says why and how to fix it.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import pickle
import platform
import secrets
import stat
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from torch_facade.amp import _caller
from torch_facade.amp._trusted_folder import owner_and_mode_problem

__all__ = ["ENV_VAR", "PersistentCore", "cache_dir", "persistent"]

ENV_VAR = "CSTORCH_AMP_CACHE_DIR"
"""The environment variable that moves the cache (a directory) or turns it off (``off``)."""

_OFF = ("", "0", "off", "false", "none", "no")
_FORMAT = "cstorch-amp core cache 2"
_PACKAGES = ("amp_core", "hardware", "torch_facade")
_CHECKABLE = hasattr(os, "geteuid") and hasattr(os, "O_NOFOLLOW") and os.open in os.supports_dir_fd
"""Whether this platform lets the cache check who owns its folder and entries (POSIX)."""


def cache_dir() -> Path | None:
    """The directory the facade's compiled cores are kept in, or ``None`` when it is off.

    Read when a core is first made and at each compile (not at import), so a script may set
    ``CSTORCH_AMP_CACHE_DIR`` or JAX's options before its first decision. Always ``None`` on a
    platform where the owner of a file cannot be checked (not POSIX: Windows).

    Example:
        >>> from unittest import mock
        >>> from torch_facade.amp._engine import _core_cache
        >>> with mock.patch.dict("os.environ", {"CSTORCH_AMP_CACHE_DIR": "off"}):
        ...     print(_core_cache.cache_dir())
        None
        >>> with mock.patch.dict("os.environ", {"CSTORCH_AMP_CACHE_DIR": "/tmp/cores"}):
        ...     print(_core_cache.cache_dir())
        /tmp/cores
    """
    if not _CHECKABLE:
        return None
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
        if directory is None or directory in _distrusted:
            return self._jitted  # no cache: jit's own dispatch, as without this class
        device = _device_of(args)
        key = _key(self._name, structure, device)
        name = hashlib.sha256(key.encode()).hexdigest() + ".xla"
        try:
            loaded = _load(directory, name, key, device)
        except _Untrusted as untrusted:
            _distrust(directory, untrusted)
            return self._jitted
        if loaded is not None:
            return loaded
        compiled = self._jitted.lower(*args).compile()
        try:
            _store(directory, name, key, compiled)
        except _Untrusted as untrusted:
            _distrust(directory, untrusted)
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


# ------------------------------------------------------------------------- the trusted folder


class _Untrusted(Exception):
    """The cache's folder or an entry in it may have been written by someone else."""

    def __init__(self, why: str, fix: str) -> None:
        super().__init__(why)
        self.why, self.fix = why, fix


_distrusted: set[Path] = set()
"""The folders found untrusted in this process: not read or written again, warned about once."""


def _distrust(directory: Path, untrusted: _Untrusted) -> None:
    if directory in _distrusted:
        return
    _distrusted.add(directory)
    warnings.warn(
        f"The facade's compiled-core cache in {directory} is not used in this run: "
        f"{untrusted.why}. Loading a cache entry runs its code, so the folder and its entries "
        f"must belong to you (or root) and no one else may write them. To fix it: "
        f"{untrusted.fix}; or choose another folder with {ENV_VAR}=..., or turn the cache off "
        f"with {ENV_VAR}=off.",
        RuntimeWarning,
        stacklevel=_caller.stacklevel(),
    )


def _check_owner_and_mode(info: os.stat_result, what: str, directory: Path) -> None:
    """Raises :class:`_Untrusted` unless ``info`` belongs to this process's user or to root and
    neither its group nor others may write it."""
    problem = owner_and_mode_problem(info, what, str(directory))
    if problem is not None:
        raise _Untrusted(*problem)


def _open_folder(directory: Path) -> int | None:
    """A descriptor of ``directory`` once it is trusted, or ``None`` if it cannot be opened
    (absent, unreadable: nothing to load). The checks are made on the opened folder (a
    symbolic link is followed, and its target checked), and entries are opened relative to it,
    so the folder cannot be swapped between the check and the read."""
    try:
        folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        _check_owner_and_mode(os.fstat(folder), "the folder", directory)
    except BaseException:
        os.close(folder)
        raise
    return folder


def _header(key: str) -> bytes:
    """What an entry starts with: the format, the key's length and the key, before the pickle."""
    encoded = key.encode()
    return _FORMAT.encode() + b"\n" + len(encoded).to_bytes(8, "big") + encoded


def _load(directory: Path, name: str, key: str, device: jax.Device) -> Callable[..., Any] | None:
    """The executable stored as ``name`` in ``directory`` for ``key``, or ``None`` (absent,
    unreadable, stale, damaged). Raises :class:`_Untrusted` before reading anything from a
    folder or an entry someone else may have written; the key is compared before unpickling."""
    folder = _open_folder(directory)
    if folder is None:
        return None
    try:
        try:
            entry = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise _Untrusted(
                    f"its entry {name} is a symbolic link", f"rm {directory / name}"
                ) from None
            return None  # absent or unreadable: compiled
    finally:
        os.close(folder)
    with os.fdopen(entry, "rb") as stored:
        info = os.fstat(stored.fileno())
        _check_owner_and_mode(info, f"its entry {name}", directory)
        if not stat.S_ISREG(info.st_mode):
            return None
        data = stored.read()
    header = _header(key)
    if not data.startswith(header):
        return None  # another format or another key: not unpickled
    try:
        serialized, in_tree, out_tree = pickle.loads(data[len(header) :])
        from jax.experimental import serialize_executable

        return serialize_executable.deserialize_and_load(
            serialized, in_tree, out_tree, backend=device.client, execution_devices=[device]
        )
    except Exception:  # truncated, damaged, from another jax: compile again
        return None


def _store(directory: Path, name: str, key: str, compiled: Any) -> None:
    """Writes ``compiled`` as ``name`` in ``directory`` atomically (a new file, then a rename).
    A folder that cannot be written (or a compile that cannot be serialized) leaves the run
    uncached, silently; a folder someone else may write raises :class:`_Untrusted`."""
    try:
        from jax.experimental import serialize_executable

        serialized, in_tree, out_tree = serialize_executable.serialize(compiled)
        data = _header(key) + pickle.dumps((serialized, in_tree, out_tree))
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except Exception:
        return
    folder = _open_folder(directory)
    if folder is None:
        return
    temporary = f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        out = os.open(temporary, flags, 0o600, dir_fd=folder)
        try:
            with os.fdopen(out, "wb") as written:
                written.write(data)
            os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            os.unlink(temporary, dir_fd=folder)
            raise
    except Exception:
        return
    finally:
        os.close(folder)
