"""The process-wide mixed-precision settings, as data (SPEC section 6).

Internal: the public calls that read and change them are in :mod:`torch_facade.amp.precision`;
this module holds only the record, so that the engine (which never imports a public module)
can read what it needs of it.
"""

from __future__ import annotations

from hardware.half_dtypes import DEFAULT_HALF_DTYPE


class HalfState:
    """The settings one process trains under."""

    half_dtype: str = DEFAULT_HALF_DTYPE
    enabled: bool = False
    # How many cstorch.amp.disable_casts() contexts are open (they turn autocast() off).
    casts_disabled: int = 0
    # Whether autocast() ran with the cbfloat16 proxy since the last overflow decision or
    # set_half_dtype() (read and cleared at every decision, for the cbfloat16 notice).
    proxy_autocast_seen: bool = False


STATE = HalfState()
"""The one record of this process."""


def take_proxy_autocast_seen() -> bool:
    """Whether ``cstorch.amp.autocast`` ran with the cbfloat16 proxy since the last call (which
    clears it) or the last ``set_half_dtype``.

    Example:
        >>> from torch_facade.amp._half_state import take_proxy_autocast_seen
        >>> _ = take_proxy_autocast_seen(); take_proxy_autocast_seen()
        False
    """
    seen, STATE.proxy_autocast_seen = STATE.proxy_autocast_seen, False
    return seen
