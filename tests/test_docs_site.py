"""The documentation site builds strictly, offline, and its API reference covers the public API.

The site is built once per test session here (``mkdocs build --strict`` into a temporary
directory, the command ``make docs`` runs): this is the docs build of ``make test``. Strict mode
turns every warning (a broken link or anchor, a page missing from the nav, a docstring griffe
cannot parse, a reference mkdocstrings cannot resolve) into a failed build.

The API reference is checked against the built site's ``objects.inv`` (the inventory
mkdocstrings writes of every object it rendered), not against the Markdown that asks for them.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
from docs_helpers import MKDOCS_YML, PUBLIC_MODULES, REPO_ROOT

BUILD_TIMEOUT_S = 300


class Site:
    """A built site: its directory, the build's log, and its inventory as ``{name: role}``."""

    def __init__(self, root: Path, log: str, returncode: int) -> None:
        self.root = root
        self.log = log
        self.returncode = returncode
        self.inventory = read_inventory(root / "objects.inv") if returncode == 0 else {}


def read_inventory(path: Path) -> dict[str, str]:
    """The rendered objects of a Sphinx v2 inventory (``objects.inv``): name -> role.

    Only entries of priority 1 (the objects a page renders) count; priority 2 entries are the
    aliases mkdocstrings adds for canonical paths of objects rendered under another name.
    """
    data = path.read_bytes()
    header, sep, body = data.partition(b"zlib.\n")
    assert sep and header.startswith(b"# Sphinx inventory version 2"), f"not an inventory: {path}"
    entries: dict[str, str] = {}
    for line in zlib.decompress(body).decode("utf-8").splitlines():
        match = re.match(r"(?P<name>\S+)\s+(?P<role>\S+)\s+(?P<priority>-?\d+)\s", line)
        if match and match["priority"] == "1":
            entries[match["name"]] = match["role"]
    return entries


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    root = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    command = [
        sys.executable,
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "--config-file",
        str(MKDOCS_YML),
    ]
    result = subprocess.run(
        [*command, "--site-dir", str(root)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    return Site(root, result.stdout + result.stderr, result.returncode)


def test_the_site_builds_strictly_without_a_warning(site: Site):
    assert site.returncode == 0, f"mkdocs build --strict failed:\n{site.log[-6000:]}"
    warnings = [line for line in site.log.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert not warnings, "\n".join(warnings)
    assert (site.root / "index.html").is_file()


def test_mkdocs_yml_keeps_strict_mode_and_makes_no_network_request_at_build_time():
    """What keeps the build offline and strict, read from the config (not a network probe)."""
    config = MKDOCS_YML.read_text(encoding="utf-8")
    assert re.search(r"^strict: true$", config, re.MULTILINE)
    assert re.search(r"^  font: false$", config, re.MULTILINE)  # no Google Fonts
    # Inventories of other sites, and material's plugins that download fonts, images or assets.
    fetching = re.findall(
        r"^\s*(?:inventories:|import:|- (?:privacy|social)\b).*$", config, re.MULTILINE
    )
    assert not fetching, f"mkdocs.yml fetches at build time: {fetching}"


def test_built_pages_load_nothing_from_other_hosts(site: Site):
    """No page pulls a stylesheet, font or script from another host (links to read are fine)."""
    assert site.returncode == 0
    remote = re.compile(r"""<(?:link|script)\b[^>]*\b(?:href|src)=["'](?:https?:)?//""")
    offenders = [
        page.relative_to(site.root).as_posix()
        for page in site.root.rglob("*.html")
        if remote.search(page.read_text(encoding="utf-8"))
    ]
    assert not offenders, f"pages loading remote assets: {offenders}"


def _public_objects() -> list[tuple[str, str, Any]]:
    """(module, name, object) for every name in the public modules' ``__all__``."""
    objects = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            objects.append((module_name, name, getattr(module, name)))
    return objects


def _expected_role(obj: Any) -> str:
    if inspect.isclass(obj):
        return "py:class"
    if callable(obj):  # functions, and functions wrapped by functools.cache
        return "py:function"
    return "py:data"


def _names_of(module_name: str, name: str, obj: Any) -> list[str]:
    """The names an object may be rendered under: its public path, else its canonical one.

    The canonical path is where the object is defined (``torch_facade.amp.optimizer_step`` is a
    function of the module of the same name, so the reference renders it by its full path).
    """
    names = [f"{module_name}.{name}"]
    if callable(obj) and hasattr(obj, "__qualname__"):
        names.append(f"{obj.__module__}.{obj.__qualname__}")
    return names


def test_the_api_reference_renders_every_public_name(site: Site):
    assert site.returncode == 0
    public = _public_objects()
    assert len(public) >= 90, f"only {len(public)} public names: did an __all__ move?"
    missing = []
    for module_name, name, obj in public:
        role = _expected_role(obj)
        if not any(site.inventory.get(each) == role for each in _names_of(module_name, name, obj)):
            missing.append(f"{module_name}.{name} ({role})")
    assert not missing, "not in the API reference (docs/api/*.md):\n" + "\n".join(missing)


def test_the_api_reference_renders_every_public_method_of_the_public_classes(site: Site):
    assert site.returncode == 0
    missing = []
    for module_name, name, cls in _public_objects():
        if not inspect.isclass(cls):
            continue
        for method, value in vars(cls).items():
            if method.startswith("_") or not inspect.isfunction(value):
                continue
            names = [f"{each}.{method}" for each in _names_of(module_name, name, cls)]
            if not any(site.inventory.get(each) == "py:method" for each in names):
                missing.append(names[0])
    assert not missing, "methods not in the API reference:\n" + "\n".join(missing)


def test_the_changelog_page_is_changelog_md(site: Site):
    """docs/changelog.md includes CHANGELOG.md (one source): its headings are on the page."""
    assert site.returncode == 0
    page = (site.root / "changelog.html").read_text(encoding="utf-8")
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^##+ (.+)$", changelog, re.MULTILINE)
    assert headings
    for heading in headings[:5]:
        words = re.sub(r"[`*\[\]]", "", heading).split()[:3]
        assert " ".join(words) in re.sub(r"<[^>]+>", "", page), heading


def _griffe_extension() -> Any:
    path = REPO_ROOT / "docs" / "_griffe" / "docstrings.py"
    spec = importlib.util.spec_from_file_location("docs_griffe_docstrings", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_griffe_extension_reads_the_house_style_as_griffe_expects():
    text = (
        "Summary, see :func:`amp_core.init` and :class:`~amp_core.state.LossScaleState`.\n"
        "\n"
        "The rule::\n"
        "\n"
        "    a = b[::2]\n"
        "\n"
        "Example:\n"
        "    >>> 1 + 1\n"
        "    2\n"
    )
    assert _griffe_extension().markdown_docstring(text) == (
        "Summary, see `amp_core.init` and `LossScaleState`.\n"
        "\n"
        "The rule:\n"
        "\n"
        "    a = b[::2]\n"
        "\n"
        "Examples:\n"
        "    >>> 1 + 1\n"
        "    2\n"
    )
