"""Device facts: backend, native half dtypes, recommendations, and torch -> JAX device mapping."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from hardware import backend, jax_device_for, native_half_dtypes, recommended_half_dtype
from hardware import devices as devices_module

HARDWARE_DIR = pathlib.Path(devices_module.__file__).parent
requires_no_gpu = pytest.mark.skipif(
    jax.default_backend() == "gpu", reason="checks the error raised when JAX has no GPU"
)


def test_backend_names_the_default_platform() -> None:
    assert backend() in ("cpu", "gpu", "tpu")
    assert backend() == {"cuda": "gpu", "rocm": "gpu"}.get(
        jax.default_backend(), jax.default_backend()
    )


def test_facts_are_consistent_and_cached() -> None:
    half = native_half_dtypes()
    assert half and set(half) <= {"float16", "bfloat16"}
    assert recommended_half_dtype() in half
    assert "cbfloat16" not in half
    for fact in (backend, native_half_dtypes, recommended_half_dtype):
        assert fact() is fact()
        assert fact.cache_info().currsize == 1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU facts")
def test_cpu_facts() -> None:
    assert backend() == "cpu"
    assert native_half_dtypes() == ("bfloat16", "float16")
    assert recommended_half_dtype() == "bfloat16"


@pytest.mark.parametrize(
    ("platform", "capabilities", "expected"),
    [
        ("cpu", [None], ("bfloat16", "float16")),
        ("tpu", [None], ("bfloat16",)),
        ("gpu", ["9.0"], ("float16", "bfloat16")),
        ("gpu", ["8.0", "8.6"], ("float16", "bfloat16")),
        ("gpu", ["7.0"], ("float16",)),
        ("gpu", ["9.0", "7.5"], ("float16",)),  # mixed: only what every device has
        ("gpu", [None], ("float16", "bfloat16")),  # ROCm reports no CUDA capability
        ("METAL", [None], ()),
    ],
)
def test_native_half_dtypes_per_platform(platform, capabilities, expected) -> None:
    fake_devices = [SimpleNamespace(compute_capability=c) for c in capabilities]
    assert devices_module._native_half_dtypes_for(platform, fake_devices) == expected


@pytest.mark.parametrize(
    ("platform", "expected"),
    [("cpu", "bfloat16"), ("tpu", "bfloat16"), ("gpu", "float16"), ("METAL", "bfloat16")],
)
def test_recommended_half_dtype_per_platform(platform, expected) -> None:
    assert devices_module._recommended_half_dtype_for(platform) == expected


def test_nothing_runs_at_import_time_and_no_torch() -> None:
    code = (
        "import sys\n"
        "import hardware\n"
        "from jax._src import xla_bridge\n"
        "from hardware import devices\n"
        "assert not xla_bridge.backends_are_initialized(), 'a JAX backend was initialised'\n"
        "assert devices.backend.cache_info().currsize == 0\n"
        "assert 'torch' not in sys.modules, 'hardware imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=HARDWARE_DIR.parent)


def test_hardware_sources_never_import_torch() -> None:
    for path in HARDWARE_DIR.glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            assert words[:2] not in (["import", "torch"], ["from", "torch"]), path


# ---------------------------------------------------------------------------------------------
# jax_device_for.


@pytest.mark.parametrize(
    "torch_device",
    ["cpu", SimpleNamespace(type="cpu", index=None), SimpleNamespace(type="cpu", index=0)],
    ids=["string", "no-index", "index-0"],
)
def test_cpu_maps_to_the_jax_cpu_device(torch_device) -> None:
    device = jax_device_for(torch_device)
    assert device.platform == "cpu"
    assert device in jax.local_devices(backend="cpu")


def test_dlpack_from_a_real_torch_tensor_lands_on_that_device() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.arange(6, dtype=torch.float32)
    device = jax_device_for(tensor.device)
    array = jax.dlpack.from_dlpack(tensor)
    assert array.devices() == {device}
    np.testing.assert_array_equal(np.asarray(array), np.arange(6, dtype=np.float32))


@requires_no_gpu
@pytest.mark.parametrize(
    ("torch_device", "described"),
    [
        (SimpleNamespace(type="cuda", index=0), "cuda:0"),
        (SimpleNamespace(type="cuda", index=None), "cuda"),
        ("cuda:1", "cuda:1"),
    ],
)
def test_cuda_tensor_with_cpu_only_jaxlib_raises_naming_both_devices(
    torch_device, described
) -> None:
    with pytest.raises(RuntimeError) as error:
        jax_device_for(torch_device)
    message = str(error.value)
    assert f"torch device {described!r} has no matching JAX device" in message
    assert "no GPU backend" in message and "cpu:0" in message


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a JAX GPU")
def test_cuda_maps_to_the_jax_gpu_with_that_index() -> None:
    device = jax_device_for(SimpleNamespace(type="cuda", index=0))
    assert device.platform == "gpu" and device.local_hardware_id == 0
    with pytest.raises(RuntimeError, match="cuda:4096' has no matching JAX device"):
        jax_device_for("cuda:4096")


def test_unsupported_torch_device_type_raises() -> None:
    with pytest.raises(RuntimeError, match=r"'mps:0' has no JAX counterpart.*JAX devices"):
        jax_device_for(SimpleNamespace(type="mps", index=0))


@pytest.mark.parametrize("bad", [42, SimpleNamespace(index=0), "cuda:x"])
def test_malformed_torch_device_raises_value_error(bad) -> None:
    with pytest.raises(ValueError, match="torch_device"):
        jax_device_for(bad)
