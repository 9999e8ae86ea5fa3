"""The distribution as a user installs it: what the wheel and the sdist hold, and a plain install.

Both artifacts are built once, without build isolation (the pinned setuptools of the dev
install), from a copy of the files the build reads, so the checkout's own ``*.egg-info`` and
``build/`` play no part. The wheel is then installed with ``pip install --no-deps --target`` and
imported from outside the clone, with torch made unimportable: what a JAX user who ran
``pip install cstorch-amp`` gets.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

import amp_core

REPO_ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("amp_core", "torch_facade", "hardware")
BUILD_INPUTS = ("pyproject.toml", "README.md", "CHANGELOG.md", "constraints.txt", "MANIFEST.in")
PLAIN_REQUIREMENTS = {"jax", "jaxlib", "numpy", "optax", "ml_dtypes"}


def _run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    source = tmp_path_factory.mktemp("source")
    for name in BUILD_INPUTS:
        shutil.copy2(REPO_ROOT / name, source / name)
    for package in LIBRARY:
        shutil.copytree(
            REPO_ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), ".", cwd=source)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def installed(artifacts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    _run(
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-index",
        "--target",
        str(target),
        str(artifacts["wheel"]),
        cwd=target,
    )
    return target


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(name))


def test_twine_check_strict_passes_on_the_wheel_and_the_sdist(artifacts: dict[str, Path]):
    out = _run(
        sys.executable,
        "-m",
        "twine",
        "check",
        "--strict",
        str(artifacts["wheel"]),
        str(artifacts["sdist"]),
        cwd=REPO_ROOT,
    )
    assert out.count("PASSED") == 2, out


def test_the_wheel_holds_only_the_three_packages_each_with_py_typed(artifacts: dict[str, Path]):
    with zipfile.ZipFile(artifacts["wheel"]) as archive:
        names = archive.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(LIBRARY)
    for package in LIBRARY:
        assert f"{package}/py.typed" in names
    assert "torch_facade/amp/grad_scaler.py" in names
    assert "torch_facade/amp/_engine/_scaler_engine.py" in names  # the engine's subpackage too


def test_the_sdist_holds_the_library_and_no_demo_benchmarks_or_tests(artifacts: dict[str, Path]):
    with tarfile.open(artifacts["sdist"]) as archive:
        names = [n.split("/", 1)[1] for n in archive.getnames() if "/" in n]
    tops = {n.split("/")[0] for n in names}
    assert {"amp_core", "torch_facade", "hardware", "pyproject.toml", "README.md"} <= tops
    assert not tops & {"demo", "benchmarks", "device_check", "workbench", "tests", "notebooks"}
    assert "docs" not in tops
    for package in LIBRARY:
        assert f"{package}/py.typed" in names


def test_the_version_has_one_source_and_torch_is_an_extra(artifacts: dict[str, Path]):
    metadata = _metadata(artifacts["wheel"])
    assert metadata["Version"] == amp_core.__version__
    assert artifacts["wheel"].name.startswith(f"cstorch_amp-{amp_core.__version__}-")
    requires = metadata.get_all("Requires-Dist")
    plain = {r.split(">")[0].split("=")[0].split(";")[0].strip() for r in requires if ";" not in r}
    assert plain == PLAIN_REQUIREMENTS
    torch_lines = [r for r in requires if r.startswith("torch")]
    assert torch_lines and all('extra == "torch"' in r for r in torch_lines), torch_lines
    assert {"torch", "cuda12", "cuda13"} <= set(metadata.get_all("Provides-Extra"))


WITHOUT_TORCH = textwrap.dedent(
    """
    import importlib.util
    import sys

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torch":
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    site = sys.argv[1]

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import amp_core
    import hardware

    for module in (amp_core, hardware):
        assert module.__file__.startswith(site), module.__file__

    # amp_core trains with optax; the first batch holds an inf, so its step is skipped.
    config = amp_core.DynamicLossScale(init_scale=2.0**10, steps_per_increase=2)
    tx = amp_core.with_loss_scaling(optax.sgd(0.1), config)
    params = {"w": jnp.full(4, 3.0)}
    opt_state = tx.init(params)

    def loss_fn(p, x):
        return jnp.sum(p["w"].astype(jnp.float16) * x).astype(jnp.float32)

    @jax.jit
    def train_step(params, opt_state, x):
        state = amp_core.loss_scale_state(opt_state)
        grads = jax.grad(lambda p: amp_core.scale_loss(state, loss_fn(p, x)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    skipped, scales = [], []
    for x in (jnp.float16(jnp.inf), jnp.float16(1.0), jnp.float16(1.0), jnp.float16(1.0)):
        before = np.asarray(params["w"]).copy()
        params, opt_state = train_step(params, opt_state, x)
        metrics = amp_core.scaler_metrics(opt_state)
        skipped.append(not metrics["isfinite"])
        scales.append(metrics["loss_scale"])
        if skipped[-1]:
            assert (np.asarray(params["w"]) == before).all()
    # Halved at the overflow; doubled once more than steps_per_increase steps have passed.
    assert skipped == [True, False, False, False], skipped
    assert scales == [2.0**9, 2.0**9, 2.0**9, 2.0**10], scales
    assert np.allclose(np.asarray(params["w"]), 3.0 - 3 * 0.1)  # three SGD steps of 0.1 * 1

    # hardware works too: cbfloat16 rounding, with no torch.
    assert float(hardware.get_format("cbfloat16").round(jnp.float32(1.0))) == 1.0

    try:
        import torch_facade
    except ImportError as error:
        assert 'pip install "cstorch-amp[torch]"' in str(error), error
    else:
        raise AssertionError("import torch_facade worked without torch")

    for name in ("demo", "benchmarks", "device_check", "workbench", "tests"):
        spec = importlib.util.find_spec(name)
        assert spec is None, (name, spec)
    assert not [m for m in sys.modules if m.split(".")[0] == "torch"]
    print("ok")
    """
)


def test_a_plain_install_trains_with_optax_without_torch_from_outside_the_clone(
    installed: Path, tmp_path: Path
):
    for package in LIBRARY:
        assert (installed / package / "py.typed").is_file()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(installed)
    # -P: no script directory or working directory on sys.path; the working directory is outside
    # the clone, so only site-packages (the dev venv's, for jax and optax) and the wheel remain.
    out = _run(sys.executable, "-P", "-c", WITHOUT_TORCH, str(installed), cwd=tmp_path, env=env)
    assert out.strip() == "ok"
