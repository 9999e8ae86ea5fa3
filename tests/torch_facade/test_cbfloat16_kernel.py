"""The torch cbfloat16 kernel against ``hardware``'s JAX rounding (the specification), bit for
bit: every cbfloat16 code, every rounding tie and its float32 neighbours, float32 subnormals,
infs, NaNs and 10**7 random float32 bit patterns. Each set goes through the whole kernel (which
sends a tensor holding any value outside the integer path's range down the carrier path),
through the carrier path alone (the one a GPU takes) and, the patterns the integer path takes,
through that path alone. On the CPU the whole kernel is the fused loop (a contiguous tensor),
compiled here once per session.

The oracle is ``hardware.get_format("cbfloat16").round``, itself tested against ml_dtypes and
hand derivations in ``tests/hardware/test_formats.py``. Bits are compared as uint32, so the sign
of zero and the NaN's bits count.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hardware import get_format
from torch_facade.amp import _cbfloat16_kernel
from torch_facade.amp._cbfloat16_kernel import (
    _round_on_integers,
    _round_with_carrier,
    round_float32,
)

FORMAT = get_format("cbfloat16")
RANDOM_PATTERNS = 10**7
CHUNK = 2**21


def _jax_bits(bits: np.ndarray) -> np.ndarray:
    out = [
        np.asarray(FORMAT.round(jnp.asarray(bits[i : i + CHUNK].view(np.float32))))
        for i in range(0, len(bits), CHUNK)
    ]
    return np.concatenate(out).view(np.uint32)


def _torch_bits(bits: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(bits.view(np.float32).copy())
    return round_float32(x).numpy().view(np.uint32)


def _integer_path_takes(values: np.ndarray) -> np.ndarray:
    """Which values the integer path rounds: zeros, and magnitudes in ``[2**-30, 2**31)``."""
    magnitudes = np.abs(values.astype(np.float64))
    return (magnitudes == 0) | ((magnitudes >= 2.0**-30) & (magnitudes < 2.0**31))


def _assert_equal_bits(bits: np.ndarray, expected: np.ndarray, got: np.ndarray, path: str) -> None:
    wrong = np.nonzero(expected != got)[0]
    shown = [(hex(bits[i]), hex(expected[i]), hex(got[i])) for i in wrong[:5]]
    assert wrong.size == 0, f"{path}: {wrong.size} differ (input, hardware, torch): {shown}"


def _assert_same_bits(bits: np.ndarray) -> None:
    bits = np.ascontiguousarray(bits, dtype=np.uint32)
    expected = _jax_bits(bits)
    assert _cbfloat16_kernel.prepare_fused_rounding(), "the fused loop did not compile here"
    _assert_equal_bits(bits, expected, _torch_bits(bits), "round_float32 (the fused loop)")
    # The carrier path alone on every pattern: what a GPU runs on every tensor.
    carried = _round_with_carrier(torch.from_numpy(bits.view(np.float32).copy()))
    _assert_equal_bits(bits, expected, carried.numpy().view(np.uint32), "the carrier path")
    taken = _integer_path_takes(bits.view(np.float32))
    if taken.any():
        x = torch.from_numpy(bits[taken].view(np.float32).copy())
        rounded = _round_on_integers(x)
        assert rounded is not None, "the integer path refused values in its range"
        got = rounded.numpy().view(np.uint32)
        _assert_equal_bits(bits[taken], expected[taken], got, "the integer path")


def _codes() -> np.ndarray:
    return np.arange(2**16, dtype=np.uint32)


def _finite_magnitudes() -> np.ndarray:
    """Every finite non-negative cbfloat16 value, ascending, as float32."""
    values = np.asarray(FORMAT.decode(jnp.asarray(_codes()[: 2**15].astype(np.uint16))))
    return values[np.isfinite(values)].astype(np.float32)


def test_every_code_decodes_to_a_fixed_point():
    decoded = np.asarray(FORMAT.decode(jnp.asarray(_codes().astype(np.uint16))))
    bits = decoded.astype(np.float32).view(np.uint32)
    _assert_same_bits(bits)
    finite = np.isfinite(decoded)
    got = _torch_bits(bits)
    assert np.array_equal(got[finite], bits[finite])  # and the kernel keeps them


def test_every_tie_and_its_float32_neighbours():
    magnitudes = _finite_magnitudes().astype(np.float64)
    upper = np.append(magnitudes[1:], 2.0**32)  # the tie past the largest value overflows
    ties = ((magnitudes + upper) / 2).astype(np.float32)  # exact: 11 significant bits at most
    assert np.array_equal(ties.astype(np.float64), (magnitudes + upper) / 2)
    tie_bits = ties.view(np.uint32)
    around = np.concatenate([tie_bits - 1, tie_bits, tie_bits + 1])
    _assert_same_bits(np.concatenate([around, around | 0x80000000]))
    assert len(ties) == 2**15 - 2**9  # a tie above every finite magnitude (top exponent: inf, NaN)


def test_float32_subnormals_zeros_infs_and_nans():
    rng = np.random.default_rng(1)
    subnormals = np.concatenate([np.arange(0, 2**16), rng.integers(1, 2**23, 2**18)])
    nans = np.concatenate(
        [
            np.array([0x7F800001, 0x7FBFFFFF, 0x7FC00000, 0x7FC00001, 0x7FFFFFFF]),
            rng.integers(0x7F800001, 0x80000000, 2**16),
        ]
    )
    specials = np.concatenate([subnormals, nans, [0x7F800000]]).astype(np.uint32)
    _assert_same_bits(np.concatenate([specials, specials | 0x80000000]))


def test_the_cbfloat16_subnormal_range_and_its_edges_exhaustively():
    """Every float32 from 0 to twice the smallest cbfloat16 normal (2**-29), and every float32
    within 2**16 patterns of the overflow threshold."""
    top = np.float32(2.0**-29).view(np.uint32)
    low = np.arange(0, int(top) + 1, 64, dtype=np.uint32)  # every 64th pattern across the range
    low = np.concatenate([low, np.arange(0x30000000, 0x30900000, dtype=np.uint32)])
    threshold = np.float32(2.0**32 - 2.0**22).view(np.uint32)  # the tie that overflows
    edge = np.arange(int(threshold) - 2**16, int(threshold) + 2**16, dtype=np.uint32)
    both = np.concatenate([low, edge])
    _assert_same_bits(np.concatenate([both, both | 0x80000000]))
    around_the_smallest_normal = np.arange(0x30400000, 0x30900000, dtype=np.uint32)
    _assert_same_bits(around_the_smallest_normal)  # alone: no value far below 2**-30 with them


@pytest.mark.parametrize("seed", [0, 1])
def test_random_float32_bit_patterns(seed):
    rng = np.random.default_rng(seed)
    _assert_same_bits(rng.integers(0, 2**32, RANDOM_PATTERNS // 2, dtype=np.uint64))


def test_float_values_around_every_binade():
    """Random values in every binade float32 has (uniform bit patterns favour huge ones)."""
    rng = np.random.default_rng(2)
    exponents = np.repeat(np.arange(0, 255, dtype=np.uint32), 4096)
    mantissas = rng.integers(0, 2**23, exponents.size).astype(np.uint32)
    bits = (exponents << 23) | mantissas
    _assert_same_bits(np.concatenate([bits, bits | 0x80000000]))


@pytest.mark.parametrize(
    ("values", "integer_path"),
    [
        ([1.0, -3.5, 2.0**-30, -(2.0**31 - 2.0**7)], True),  # the range's two ends
        ([0.0, -0.0, 1.0], True),
        ([0.0, -0.0], True),
        ([0.0, 2.0**-30 - 2.0**-54], False),  # just below 2**-30, next to a zero
        ([1.0, -(2.0**-40)], False),
        ([1.0, 1e-45], False),  # a float32 subnormal
        ([1.0, 2.0**31], False),
        ([0.0, -(2.0**31)], False),  # a zero hides the top of the first read
        ([0.0, float("inf")], False),
        ([1.0, float("-inf")], False),
        ([0.0, float("nan")], False),
        ([1.0, float("nan")], False),
    ],
)
def test_which_path_a_tensor_takes(values: list[float], integer_path: bool) -> None:
    """The integer path takes a tensor exactly when every value is a zero or has a magnitude in
    ``[2**-30, 2**31)``; the others go down the carrier path. Either way the bits are right."""
    x = torch.tensor(values, dtype=torch.float32)
    assert (_round_on_integers(x) is not None) == integer_path
    bits = x.numpy().view(np.uint32)
    _assert_equal_bits(bits, _jax_bits(bits), _torch_bits(bits), "round_float32")


def test_the_integer_path_on_strided_and_empty_tensors() -> None:
    x = torch.randn(64, 48)[::2, 1::3]
    assert not x.is_contiguous()
    rounded = round_float32(x)
    bits = x.contiguous().numpy().view(np.uint32)
    _assert_equal_bits(bits, _jax_bits(bits), rounded.contiguous().numpy().view(np.uint32), "t")
    assert round_float32(torch.empty(0, 3)).shape == (0, 3)


def test_does_not_modify_its_input_and_keeps_the_shape():
    x = torch.tensor([[1 + 2**-10, -3e10], [2.0**-41, float("nan")]])
    before = x.clone()
    out = round_float32(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))
    assert out.data_ptr() != x.data_ptr()


def _jax_round_float32(x: torch.Tensor) -> torch.Tensor:
    """The rounding as the facade computed it before the kernel: ``hardware``'s JAX function."""
    return torch.from_numpy(np.asarray(FORMAT.round(jnp.asarray(x.detach().numpy()))).copy())


def test_cbfloat16_numerics_on_gpt2_is_bit_identical_to_the_jax_rounding(monkeypatch):
    """A small Hugging Face GPT-2 under ``cbfloat16_numerics`` (every parameter and module
    output cast, forward and backward): the loss and every gradient are bit-identical whether
    the casts round with the torch kernel or with ``hardware``'s JAX function."""
    transformers = pytest.importorskip("transformers")
    import torch_facade as cstorch
    from torch_facade.amp import _cbfloat16_kernel

    config = transformers.GPT2Config(
        vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        with cstorch.amp.cbfloat16_numerics(model):
            loss = model(input_ids=tokens, labels=tokens).loss * 2.0**20  # some gradients overflow
            loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    loss, grads = run()
    monkeypatch.setattr(_cbfloat16_kernel, "round_float32", _jax_round_float32)
    reference_loss, reference_grads = run()
    assert torch.equal(loss.view(torch.int32), reference_loss.view(torch.int32))
    assert len(grads) == len(reference_grads) > 0
    for ours, theirs in zip(grads, reference_grads, strict=True):
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def test_the_overflow_passes_change_no_value_below_two_to_the_31(monkeypatch):
    """The accelerators' path: the overflow and NaN passes run on every tensor (no exponent
    read). Forced on the CPU over values that the CPU's read would send past them."""
    from torch_facade.amp import _cbfloat16_kernel

    monkeypatch.setattr(_cbfloat16_kernel, "_may_overflow", lambda power_bits: True)
    rng = np.random.default_rng(3)
    below = rng.integers(0, 0x4F000000, 2**20, dtype=np.uint32)  # |x| < 2**31
    small = _finite_magnitudes()
    small_bits = small[small < 2.0**31].view(np.uint32)
    bits = np.concatenate([below, small_bits, below | 0x80000000, small_bits | 0x80000000])
    assert np.isfinite(_torch_bits(bits).view(np.float32)).all()  # nothing reaches 2**32
    _assert_same_bits(bits)


def _large_mixed_tensor() -> torch.Tensor:
    """Random float32 bit patterns (every path's values: subnormal range, overflow, inf, NaN)
    and ordinary activations, 2**17 of them (an activation's size; past the fused path's
    threshold)."""
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2**32, 2**17, dtype=np.uint32)
    x = torch.from_numpy(bits.view(np.float32).copy())
    x[: x.numel() // 2] = torch.randn(x.numel() // 2)
    return x


def _hardware_bits(x: torch.Tensor) -> np.ndarray:
    return _jax_bits(x.contiguous().numpy().view(np.uint32))


def test_large_cpu_tensors_round_in_one_fused_loop_with_the_same_bits():
    """A contiguous CPU tensor takes the compiled loop (here, where a C++ compiler is present); a
    transposed one the integer or carrier path. The bits of both are the specification's."""
    fused = _cbfloat16_kernel._fused_rounding()
    assert fused is not None, "inductor could not compile the fused rounding on this machine"
    x = _large_mixed_tensor()
    _assert_equal_bits(
        x.numpy().view(np.uint32), _hardware_bits(x), round_float32(x).numpy().view(np.uint32),
        "round_float32 (fused)",
    )  # fmt: skip
    grid = x.view(512, -1).t()  # not contiguous: not the fused loop
    assert not grid.is_contiguous()
    got = round_float32(grid).contiguous().numpy().view(np.uint32)
    _assert_equal_bits(
        grid.contiguous().numpy().view(np.uint32), _hardware_bits(grid), got, "strided"
    )


def test_the_fused_loop_gives_the_same_bits_on_several_threads():
    """The loop is split over torch's threads at each call, from PARALLEL_FROM elements; the
    suite's workers run torch on one thread, so the split is taken here: 2 and 3 threads, sizes
    that divide unevenly between them and the threshold's neighbours, every bit the
    specification's."""
    fused = _cbfloat16_kernel._fused_rounding()
    assert fused is not None, "inductor could not compile the fused rounding on this machine"
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 2**20 + 37, dtype=np.uint64).astype(np.uint32)
    expected = _jax_bits(bits)
    threads = torch.get_num_threads()
    try:
        for count in (2, 3):
            torch.set_num_threads(count)
            parallel_from = _cbfloat16_kernel.PARALLEL_FROM
            for size in (bits.size, 2**16 + 5, parallel_from, parallel_from - 1, 1001):
                x = torch.from_numpy(bits[:size].view(np.float32).copy())
                got = fused(x).numpy().view(np.uint32)
                _assert_equal_bits(bits[:size], expected[:size], got, f"fused, {count} threads")
    finally:
        torch.set_num_threads(threads)


def _forget_the_fused_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cbfloat16_kernel, "_FUSED", [])


def test_without_a_compiled_loop_the_kernel_keeps_the_integer_path(monkeypatch):
    """torch.compile failing (no C++ compiler, say), or switched off by the environment: the
    rounding is the integer and carrier paths', with the same bits."""
    x = _large_mixed_tensor()
    expected = _hardware_bits(x)

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler")

    from torch._inductor.codecache import CppPythonBindingsCodeCache

    _forget_the_fused_rounding(monkeypatch)
    monkeypatch.setattr(CppPythonBindingsCodeCache, "load_pybinding", no_compiler)
    assert _cbfloat16_kernel._fused_rounding() is None
    bits = x.numpy().view(np.uint32)
    _assert_equal_bits(bits, expected, round_float32(x).numpy().view(np.uint32), "no compiler")
    monkeypatch.undo()

    _forget_the_fused_rounding(monkeypatch)
    monkeypatch.setenv("CSTORCH_CBFLOAT16_FUSED", "0")
    assert _cbfloat16_kernel._fused_rounding() is None
    _assert_equal_bits(bits, expected, round_float32(x).numpy().view(np.uint32), "switched off")


def test_a_compiled_loop_that_rounds_wrongly_is_not_used(monkeypatch):
    """The compiled loop is checked against the carrier path on a probe before it is used: here
    a loop compiled without its rounding step (what a compiler's unsafe-math options would make
    of ``(value + carrier) - carrier``)."""
    _forget_the_fused_rounding(monkeypatch)
    rounding = "(value + carrier) - carrier;"
    assert rounding in _cbfloat16_kernel.LOOP_SOURCE
    wrong = _cbfloat16_kernel.LOOP_SOURCE.replace(rounding, "value + 0.0f * carrier;")
    monkeypatch.setattr(_cbfloat16_kernel, "LOOP_SOURCE", wrong)
    assert _cbfloat16_kernel._fused_rounding() is None
    x = _large_mixed_tensor()
    got = round_float32(x).numpy().view(np.uint32)
    _assert_equal_bits(x.numpy().view(np.uint32), _hardware_bits(x), got, "after a wrong loop")


def test_the_fused_loop_takes_every_size_and_shape_and_returns_a_tensor_of_its_own():
    """Called on data pointers, the compiled loop must handle every size (vector tails
    included), every contiguous shape, offsets into a storage and inference tensors, and return
    a new tensor that is not a view (so it may be changed in place)."""
    assert _cbfloat16_kernel.prepare_fused_rounding()
    values = _large_mixed_tensor()
    for size in [*range(1, 70), 255, 4097]:
        x = values[1 : size + 1]  # an offset into the storage
        got = round_float32(x)
        assert got.shape == x.shape and got._base is None
        _assert_equal_bits(
            x.numpy().view(np.uint32), _hardware_bits(x), got.numpy().view(np.uint32),
            f"size {size}",
        )  # fmt: skip
    block = values[: 6 * 7 * 11].view(6, 7, 11)
    got = round_float32(block)
    assert got.shape == (6, 7, 11)
    assert torch.equal(
        got.flatten().view(torch.int32), round_float32(block.flatten()).view(torch.int32)
    )
    with torch.inference_mode():
        inference = values[:1000].clone()
        got = round_float32(inference)
    expected = round_float32(values[:1000])
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    expected.mul_(2.0)  # its own storage: the input is untouched
    assert torch.equal(inference, values[:1000])


def test_a_rounding_alone_compiles_nothing(monkeypatch):
    """Until something prepares the loop (cbfloat16_numerics, on entry), a contiguous tensor
    takes the integer path: a call of round_to_cbfloat16 alone does not start a compile of
    seconds. The same bits."""
    _forget_the_fused_rounding(monkeypatch)
    x = _large_mixed_tensor()
    got = round_float32(x).numpy().view(np.uint32)
    assert _cbfloat16_kernel._FUSED == []
    _assert_equal_bits(x.numpy().view(np.uint32), _hardware_bits(x), got, "before prepare")


def test_entering_cbfloat16_numerics_compiles_the_loop_before_any_forward(monkeypatch):
    """Compiled on entry (not inside a first iteration, where dynamo may be tracing a compiled
    model that reads its parametrized weights), and only once per process."""
    import torch_facade as cstorch

    _forget_the_fused_rounding(monkeypatch)
    model = torch.nn.Linear(3, 2)
    with cstorch.amp.cbfloat16_numerics(model):
        assert len(_cbfloat16_kernel._FUSED) == 1 and _cbfloat16_kernel._FUSED[0] is not None
        fused = _cbfloat16_kernel._FUSED[0]
    with cstorch.amp.cbfloat16_numerics(model):
        assert _cbfloat16_kernel._FUSED == [fused]


def test_an_inductor_cache_folder_others_may_write_keeps_the_uncompiled_paths(
    monkeypatch, tmp_path
):
    """Inductor loads the compiled loop from its cache folder, and loading runs it: a folder
    its group or others may write (or someone else's) is not used, with a warning that names it
    and the fix, and the rounding keeps its bits on the uncompiled paths."""
    folder = tmp_path / "torchinductor_shared"
    folder.mkdir()
    folder.chmod(0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    _forget_the_fused_rounding(monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"may be written by its group or by others") as caught:
        assert not _cbfloat16_kernel.prepare_fused_rounding()
    assert str(folder) in str(caught[0].message) and "chmod -R go-w" in str(caught[0].message)
    assert not any(folder.iterdir()), "inductor wrote into the untrusted folder"
    x = _large_mixed_tensor()
    got = round_float32(x).numpy().view(np.uint32)
    _assert_equal_bits(x.numpy().view(np.uint32), _hardware_bits(x), got, "untrusted cache")
    folder.chmod(0o700)  # the user's own: trusted (the check only; no compilation here)
    assert _cbfloat16_kernel._inductor_cache_is_trusted()
