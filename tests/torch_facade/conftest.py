"""Every torch facade test starts and ends with the default half dtype state (SPEC section 6).

``set_half_dtype`` changes process-wide state that ``GradScaler`` reads at construction, so a
test that changes it must not leak it into the next one.
"""

import pytest

import torch_facade as cstorch


@pytest.fixture(autouse=True)
def restore_half_dtype_state():
    """Restores the half dtype and the mixed-precision switch after each test."""
    half_dtype = cstorch.amp.get_half_dtype_str()
    enabled = cstorch.amp.mixed_precision()
    yield
    cstorch.amp.set_half_dtype(half_dtype)
    cstorch.amp.enable_mixed_precision(enabled)
