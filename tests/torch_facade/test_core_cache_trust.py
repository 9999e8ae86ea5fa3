"""The compiled-core cache reads only folders and entries no one else may write.

Loading an entry runs its code (it is a pickle and an executable), so an entry another user
could have written must never be read. The scenarios run in a child process as a user who is
not root (``nobody`` when the suite runs as root: the child starts as root, imports what it
needs, then gives up root with ``os.setresuid``), since root may write any folder and a
read-only folder would not be read-only to it. Each child is forked from one process that has
imported those modules (``tests/forked_python.py``): a fresh process without the imports' cost.

The oracle that nothing was unpickled: entries whose pickle, once loaded, creates a marker
(``os.mkdir(marker)``). A control scenario shows that such an entry, in a folder of the
user's own with the right key, does create the marker: the checks are what keep it from running.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from tests.forked_python import ForkedPython, last_json
from torch_facade.amp._engine import _core_cache

_ROOT = os.geteuid() == 0
_NOBODY = 65534
_CHILD_UID = _NOBODY if _ROOT else os.geteuid()
_CHILD_GID = _NOBODY if _ROOT else os.getegid()
_STRANGER = 4242  # owns the foreign folders (only root can give a file to another user)
_CORE_NAME = "trust test double_sum"

# What the child imports, as root (the server it is forked from has imported them already).
_CHILD_IMPORTS = (
    "json", "os", "sys", "traceback", "warnings", "jax", "jax.numpy",
    "jax.experimental.serialize_executable", "torch_facade.amp._engine._core_cache",
)  # fmt: skip
_CHILD = """
import json, os, sys, traceback, warnings
import jax, jax.numpy as jnp
from jax.experimental import serialize_executable  # imported before root is given up
from torch_facade.amp._engine import _core_cache

def run_scenarios():
    ones_3, ones_2 = jnp.ones(3), (jnp.ones(2), jnp.ones(2))  # made (compiled) before counting
    uid, gid = {uid}, {gid}
    if os.geteuid() != uid:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append(name)
    )
    report = {{"uid": os.geteuid()}}
    for label, folder in json.loads(sys.argv[1]):
        def double_sum(xs):  # a new function each time: no compile is shared between scenarios
            return sum(2 * x for x in xs)
        os.environ["CSTORCH_AMP_CACHE_DIR"] = folder
        before = len(events)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jitted = jax.jit(double_sum)
            first = _core_cache.persistent(jitted, {name!r})(ones_3)
            # a second core and a second structure in the same folder: still one warning
            second = _core_cache.persistent(jitted, {name!r} + " again")(ones_2)
        report[label] = {{
            "compiles": events[before:].count("/jax/core/compile/backend_compile_duration"),
            "warnings": [f"{{w.category.__name__}}: {{w.message}}" for w in caught],
            "values": [first.tolist(), second.tolist()],
        }}
    return report

def forked(count):
    # The scenarios in ``count`` processes forked at once (JAX not started yet in this one:
    # each starts its own), as the processes of one job; their reports once all have ended.
    children = []
    for _ in range(count):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            code = 0
            try:
                data = json.dumps(run_scenarios()).encode()
            except BaseException:
                data, code = traceback.format_exc().encode(), 1
            with os.fdopen(write, "wb") as pipe:
                pipe.write(data)
            os._exit(code)
        os.close(write)
        children.append((pid, read))
    reports = []
    for pid, read in children:
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read().decode()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, data
        reports.append(json.loads(data))
    return reports

if len(sys.argv) > 2:  # waves of processes: each wave forked at once, after the previous ended
    print(json.dumps([forked(count) for count in json.loads(sys.argv[2])]))
else:
    print(json.dumps(run_scenarios()))
"""


def _double_sum(xs):
    return sum(2 * x for x in xs)


class _Marker:
    """Unpickled, it creates ``path`` (as a malicious entry would run any code)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.path),))


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes]:
    """The file name and bytes of a real entry for ``_CORE_NAME`` on ``jnp.ones(3)``, made here
    (the key does not depend on the user, so the child computes the same one)."""
    folder = tmp_path_factory.mktemp("genuine")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(_core_cache.ENV_VAR, str(folder))
        _core_cache.persistent(jax.jit(_double_sum), _CORE_NAME)(jnp.ones(3))
    (entry,) = folder.iterdir()
    return entry.name, entry.read_bytes()


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder every user may traverse (pytest's own are root's alone), removed afterwards."""
    made = Path(tempfile.mkdtemp(prefix="cstorch-trust-"))
    made.chmod(0o755)
    yield made
    for path in [made, *made.rglob("*")]:
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o755)
    shutil.rmtree(made)


def _header(data: bytes) -> bytes:
    """An entry's header: the format line, the key's length (8 bytes) and the key."""
    line = data.index(b"\n") + 1
    length = int.from_bytes(data[line : line + 8], "big")
    return data[: line + 8 + length]


def _folder(path: Path, mode: int, owner: int = _CHILD_UID) -> Path:
    path.mkdir()
    path.chmod(mode)
    if _ROOT:
        os.chown(path, owner, owner)
    return path


def _entry(path: Path, data: bytes, mode: int = 0o600, owner: int = _CHILD_UID) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    if _ROOT:
        os.chown(path, owner, owner)
    return path


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkedPython]:
    """Starts the children: each forked from one process that has imported the child's modules
    (JAX not started; root until the child gives it up)."""
    server = ForkedPython(tmp_path_factory.mktemp("children"), _CHILD_IMPORTS)
    yield server
    server.close()


def _run_child(
    child: ForkedPython, scenarios: list[tuple[str, Path]], waves: list[int] | None = None
) -> Any:
    """Runs ``scenarios`` in a child; with ``waves``, in processes the child forks: ``waves[i]``
    of them at once, each wave once the previous has ended (its report: one list per wave)."""
    code = _CHILD.format(uid=_CHILD_UID, gid=_CHILD_GID, name=_CORE_NAME)
    scenario_list = json.dumps([(label, str(folder)) for label, folder in scenarios])
    forks = [] if waves is None else [json.dumps(waves)]
    child.submit(code, 300, argv=[scenario_list, *forks], HOME=tempfile.gettempdir())
    status, output = child.outcome()
    assert status == 0, output[-3000:]
    report = last_json(output)
    for each in [r for wave in report for r in wave] if isinstance(report, list) else [report]:
        assert each["uid"] == _CHILD_UID and each["uid"] != 0
    return report


def _expect_untrusted(outcome: dict, *words: str) -> None:
    """Compiled (not loaded), the right values, and exactly one warning, saying why and how."""
    assert outcome["compiles"] == 2
    assert outcome["values"] == [6.0, [4.0, 4.0]]  # sum(2 * x) over 3 ones; 2 * 1 + 2 * 1
    (warning,) = outcome["warnings"]
    assert warning.startswith("RuntimeWarning: The facade's compiled-core cache in ")
    assert "is not used in this run" in warning
    for word in words:
        assert word in warning, (word, warning)


def test_a_folder_or_an_entry_others_may_write_is_not_read(base, genuine, child):
    """As a user who is not root: group- or world-writable folders, a symbolic link to one, an
    entry that is a symbolic link or that others may write are not read (nothing unpickled),
    with one warning each; the user's own folder still loads, read-only or not."""
    name, data = genuine
    header = _header(data)
    markers = _folder(base / "markers", 0o700)
    evil = {
        label: header + pickle.dumps(_Marker(markers / label))
        for label in (
            "control",
            "world",
            "group",
            "linked",
            "link_entry",
            "writable_entry",
            "wrong_key",
        )
    }
    _entry(_folder(base / "control", 0o700) / name, evil["control"])
    _entry(_folder(base / "world", 0o777) / name, evil["world"])
    _entry(_folder(base / "group", 0o770) / name, evil["group"])
    _entry(_folder(base / "linked_target", 0o1777) / name, evil["linked"])
    (base / "linked").symlink_to(base / "linked_target")
    elsewhere = _folder(base / "elsewhere", 0o700)
    _entry(elsewhere / name, evil["link_entry"])
    (_folder(base / "link_entry", 0o700) / name).symlink_to(elsewhere / name)
    if _ROOT:
        os.lchown(base / "link_entry" / name, _CHILD_UID, _CHILD_GID)
    _entry(_folder(base / "writable_entry", 0o700) / name, evil["writable_entry"], mode=0o666)
    own_read_only = base / "own_read_only"
    _entry(_folder(own_read_only, 0o700) / name, data)
    own_read_only.chmod(0o500)
    empty_read_only = _folder(base / "empty_read_only", 0o500)
    wrong_key = _folder(base / "wrong_key", 0o700)
    another_key = header.replace(b"core trust", b"core TRUST")  # same length, another key
    _entry(wrong_key / name, another_key + evil["wrong_key"][len(header) :])
    before = {label: sorted(os.listdir(base / label)) for label in ("world", "group", "linked")}

    report = _run_child(
        child,
        [
            (label, base / label)
            for label in (
                "control",
                "world",
                "group",
                "linked",
                "link_entry",
                "writable_entry",
                "own_read_only",
                "empty_read_only",
                "wrong_key",
            )
        ],
    )

    # the control: an entry of the user's own is unpickled (and fails to load: compiled)
    assert (markers / "control").exists()
    assert report["control"]["warnings"] == [] and report["control"]["compiles"] == 2
    for label in ("world", "group", "linked", "link_entry", "writable_entry", "wrong_key"):
        assert not (markers / label).exists(), label
    _expect_untrusted(report["world"], "may be written by its group or by others (mode 777)")
    _expect_untrusted(report["world"], f"chmod -R go-w {base / 'world'}", "CSTORCH_AMP_CACHE_DIR")
    _expect_untrusted(report["group"], "(mode 770)", f"chmod -R go-w {base / 'group'}")
    _expect_untrusted(report["linked"], "the folder may be written", "(mode 1777)")
    _expect_untrusted(report["link_entry"], f"its entry {name} is a symbolic link")
    _expect_untrusted(report["writable_entry"], f"its entry {name} may be written", "(mode 666)")
    # nothing was written into a folder that is not trusted
    assert {label: sorted(os.listdir(base / label)) for label in before} == before

    # read-only folders of the user's own: loaded when the entry is there, compiled and left
    # as they were when it is not, without a word
    assert report["own_read_only"]["compiles"] == 1  # the second core only: not stored
    assert report["own_read_only"]["warnings"] == []
    assert sorted(os.listdir(own_read_only)) == [name]
    assert report["empty_read_only"]["compiles"] == 2
    assert report["empty_read_only"]["warnings"] == [] and os.listdir(empty_read_only) == []
    # an entry under another key is not unpickled, and is replaced by the right one
    assert report["wrong_key"]["warnings"] == [] and report["wrong_key"]["compiles"] == 2
    assert (wrong_key / name).read_bytes().startswith(header)


@pytest.mark.skipif(not _ROOT, reason="only root can give a folder to another user")
def test_a_folder_or_an_entry_of_another_user_is_not_read(base, genuine, child):
    """As a user who is not root, a folder owned by another user (not root), or an entry of
    another user's in the user's own folder, is not read, however closed its mode; one owned by
    root and closed to others (a cache prepared in an image) is read."""
    name, data = genuine
    header = _header(data)
    markers = _folder(base / "markers", 0o700)
    _entry(
        _folder(base / "foreign", 0o755, owner=_STRANGER) / name,
        header + pickle.dumps(_Marker(markers / "foreign")),
        mode=0o644,
        owner=_STRANGER,
    )
    _entry(
        _folder(base / "foreign_entry", 0o700) / name,
        header + pickle.dumps(_Marker(markers / "foreign_entry")),
        mode=0o644,
        owner=_STRANGER,
    )
    _entry(_folder(base / "roots", 0o755, owner=0) / name, data, mode=0o644, owner=0)

    labels = ("foreign", "foreign_entry", "roots")
    report = _run_child(child, [(label, base / label) for label in labels])

    assert not (markers / "foreign").exists() and not (markers / "foreign_entry").exists()
    _expect_untrusted(
        report["foreign"],
        f"the folder belongs to user id {_STRANGER}, not to this process's user ({_NOBODY})",
        f"chown -R {_NOBODY} {base / 'foreign'}",
    )
    _expect_untrusted(report["foreign_entry"], f"its entry {name} belongs to user id {_STRANGER}")
    assert report["roots"]["warnings"] == []
    assert report["roots"]["compiles"] == 1  # loaded; the second core cannot be stored there
    assert os.listdir(base / "roots") == [name]


def test_processes_starting_at_once_on_a_cold_cache_share_it(base, child):
    """Four processes (as ranks starting together: forked at once by one child, each starting
    JAX itself) on one empty folder of their user's: each computes, none warns, and the folder
    ends with one whole entry per core, no leftovers; a fifth, forked once they have ended,
    loads both entries."""
    shared = _folder(base / "cold", 0o700)
    together, later = _run_child(child, [("cold", shared)], waves=[4, 1])
    reports = [report["cold"] for report in together]
    assert len(reports) == 4
    assert all(r["warnings"] == [] and r["values"] == [6.0, [4.0, 4.0]] for r in reports)
    entries = sorted(os.listdir(shared))
    assert len(entries) == 2 and all(entry.endswith(".xla") for entry in entries)
    assert all(os.stat(shared / entry).st_mode & 0o777 == 0o600 for entry in entries)
    after = later[0]["cold"]  # a later run loads both: compiles nothing
    assert after == {"compiles": 0, "warnings": [], "values": [6.0, [4.0, 4.0]]}
