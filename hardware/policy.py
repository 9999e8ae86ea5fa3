"""Mixed-precision policies for the JAX-native API: which dtype parameters, compute and outputs use.

A dtype in a policy is either a real JAX dtype (float32, float16, bfloat16, float64), to which
floating leaves are cast with ``astype``, or an emulated :class:`~hardware.formats.FloatFormat`
(cbfloat16, float8), for which floating leaves become float32 arrays rounded to the format's grid
with :meth:`FloatFormat.cast` (values on the way forward, gradients on the way back, as for a
real dtype). Rounding happens at every cast and nowhere else: a model that
computes in an emulated format calls ``policy.cast_to_compute`` on each result it wants on the
grid (typically every layer's output), just as the hardware rounds each operation's output.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np

from hardware.formats import FloatFormat, get_format, known_formats

PolicyDType: TypeAlias = jnp.dtype | FloatFormat
"""A dtype of a policy: a real floating JAX dtype, or an emulated format."""

_NATIVE_DTYPES: dict[str, jnp.dtype] = {
    name: jnp.dtype(name) for name in ("float32", "float16", "bfloat16", "float64")
}
_DTYPE_ALIASES: dict[str, str] = {
    "f32": "float32",
    "fp32": "float32",
    "full": "float32",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "f64": "float64",
    "fp64": "float64",
    "cb16": "cbfloat16",
    "cbf16": "cbfloat16",
}
_KEYS: dict[str, str] = {
    "params": "param_dtype",
    "param": "param_dtype",
    "p": "param_dtype",
    "compute": "compute_dtype",
    "c": "compute_dtype",
    "output": "output_dtype",
    "out": "output_dtype",
    "o": "output_dtype",
}


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for parameters, computation and outputs; frozen and hashable (a static argument).

    Each field accepts a dtype name or alias (``"float32"``/``"f32"``, ``"float16"``/``"f16"``,
    ``"bfloat16"``/``"bf16"``, ``"float64"``, ``"cbfloat16"``/``"cb16"``, a float8 format name),
    a numpy/JAX floating dtype, or a :class:`FloatFormat`; it is stored as a ``jnp.dtype`` for
    real dtypes and as a :class:`FloatFormat` for emulated ones.

    Casting a pytree touches only its floating array leaves (JAX and numpy arrays and numpy
    scalars): integer and boolean arrays, Python scalars and other leaves pass through unchanged.

    Attributes:
        param_dtype: dtype parameters are stored in.
        compute_dtype: dtype the forward and backward passes compute in.
        output_dtype: dtype of the model's outputs (e.g. the loss).

    Raises:
        ValueError: a field names no known dtype, or a dtype that is not floating.

    Example:
        >>> import jax.numpy as jnp
        >>> policy = Policy(param_dtype="float32", compute_dtype="cbfloat16",
        ...                 output_dtype="float32")
        >>> x = policy.cast_to_compute({"w": jnp.array([1.0 + 2**-12]), "step": jnp.array(3)})
        >>> x["w"].tolist(), x["step"].dtype
        ([1.0], dtype('int32'))
        >>> str(policy)
        'params=float32,compute=cbfloat16,output=float32'
    """

    param_dtype: PolicyDType | str = "float32"
    compute_dtype: PolicyDType | str = "float32"
    output_dtype: PolicyDType | str = "float32"

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, canonical_dtype(getattr(self, field), argument=field))

    def _dtype(self, field: str) -> PolicyDType:
        """A dtype field, canonical since ``__post_init__`` (a string only before it)."""
        return cast(PolicyDType, getattr(self, field))

    def cast_to_param(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``param_dtype``.

        Example:
            >>> import hardware, jax.numpy as jnp
            >>> policy = hardware.get_policy("params=float32,compute=float16,output=float32")
            >>> policy.cast_to_param({"w": jnp.ones(2, jnp.float16)})["w"].dtype
            dtype('float32')
        """
        return cast_tree(tree, self._dtype("param_dtype"))

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``compute_dtype`` (rounding if emulated).

        Example:
            >>> import hardware, jax.numpy as jnp
            >>> policy = hardware.get_policy("p=f32,c=cb16,o=f32")
            >>> x = policy.cast_to_compute(jnp.array([1.0 + 2**-10, 1.0 + 3 * 2**-10]))
            >>> x.dtype, x.tolist()  # float32 values on the cbfloat16 grid, ties to even
            (dtype('float32'), [1.0, 1.00390625])
        """
        return cast_tree(tree, self._dtype("compute_dtype"))

    def cast_to_output(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``output_dtype``.

        Example:
            >>> import hardware, jax.numpy as jnp
            >>> policy = hardware.get_policy("params=float32,compute=bfloat16,output=float32")
            >>> loss, step = policy.cast_to_output((jnp.array(0.5, jnp.bfloat16), 3))
            >>> loss.dtype, step  # a Python int passes through
            (dtype('float32'), 3)
        """
        return cast_tree(tree, self._dtype("output_dtype"))

    def __str__(self) -> str:
        return (
            f"params={dtype_name(self._dtype('param_dtype'))},"
            f"compute={dtype_name(self._dtype('compute_dtype'))},"
            f"output={dtype_name(self._dtype('output_dtype'))}"
        )


def canonical_dtype(value: Any, *, argument: str = "dtype") -> PolicyDType:
    """Returns the ``jnp.dtype`` or emulated :class:`FloatFormat` that ``value`` names.

    Args:
        value: a name or alias, a numpy/JAX dtype, or a :class:`FloatFormat`.
        argument: the argument name used in error messages.

    Returns:
        A floating ``jnp.dtype`` (float32, float16, bfloat16, float64) or a :class:`FloatFormat`.

    Raises:
        ValueError: ``value`` names no known floating dtype or format.

    Example:
        >>> canonical_dtype("bf16")
        dtype(bfloat16)
        >>> canonical_dtype("cbfloat16").name
        'cbfloat16'
    """
    if isinstance(value, FloatFormat):
        return value
    if isinstance(value, str):
        name = _DTYPE_ALIASES.get(value.strip().lower(), value.strip().lower())
    else:
        try:
            name = jnp.dtype(value).name
        except TypeError:
            name = None
    if name in _NATIVE_DTYPES:
        return _NATIVE_DTYPES[name]
    if name is not None:
        try:
            return get_format(name)
        except ValueError:
            pass
    known = ", ".join((*_NATIVE_DTYPES, *(n for n in known_formats() if n not in _NATIVE_DTYPES)))
    raise ValueError(
        f"{argument} must be a floating dtype or format: one of {known} "
        f"(aliases {', '.join(_DTYPE_ALIASES)}), a numpy/JAX floating dtype, or a FloatFormat; "
        f"got {value!r}"
    )


def dtype_name(dtype: PolicyDType) -> str:
    """The canonical name of a policy dtype (``"float32"``, ``"cbfloat16"``, ...).

    Example:
        >>> import hardware, jax.numpy as jnp
        >>> hardware.dtype_name(jnp.bfloat16), hardware.dtype_name(hardware.canonical_dtype("cb16"))
        ('bfloat16', 'cbfloat16')
    """
    return dtype.name if isinstance(dtype, FloatFormat) else jnp.dtype(dtype).name


def cast_tree(tree: Any, dtype: PolicyDType) -> Any:
    """Casts the floating array leaves of ``tree`` to ``dtype``; other leaves pass through.

    For an emulated format the leaves become float32 arrays rounded to its grid, and their
    gradients are rounded to it in the backward pass (:meth:`FloatFormat.cast`), as JAX does
    for a cast to a real dtype.

    Args:
        tree: any pytree.
        dtype: a policy dtype (anything :func:`canonical_dtype` accepts).

    Returns:
        A pytree of the same structure.

    Example:
        >>> import jax.numpy as jnp
        >>> cast_tree([jnp.ones(2), jnp.arange(2)], "bf16")[0].dtype
        dtype(bfloat16)
    """
    dtype = canonical_dtype(dtype)
    return jax.tree_util.tree_map(lambda leaf: _cast_leaf(leaf, dtype), tree)


def _cast_leaf(leaf: Any, dtype: PolicyDType) -> Any:
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return leaf
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
        return leaf
    if isinstance(dtype, FloatFormat):
        return dtype.cast(jnp.asarray(leaf))
    return jnp.asarray(leaf).astype(dtype)


def get_policy(spec: str | Policy) -> Policy:
    """Parses a policy string such as ``"params=float32,compute=cbfloat16,output=float32"``.

    Keys are ``params``/``param``/``p``, ``compute``/``c`` and ``output``/``out``/``o``; values
    are anything :func:`canonical_dtype` accepts by name (``"f32"``, ``"bf16"``, ``"cb16"``, ...).
    Keys left out default to float32. A single name without ``=`` sets all three dtypes. A
    :class:`Policy` is returned as is.

    Args:
        spec: the policy string, or a :class:`Policy`.

    Returns:
        The :class:`Policy`.

    Raises:
        ValueError: unknown key, repeated key, missing ``=``, or unknown dtype.

    Example:
        >>> get_policy("p=f32,c=cb16,o=f32").compute_dtype.name
        'cbfloat16'
        >>> str(get_policy("bfloat16"))
        'params=bfloat16,compute=bfloat16,output=bfloat16'
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"spec must be a policy string or a Policy; got {spec!r}")
    items = [item.strip() for item in spec.split(",")]
    if len(items) == 1 and "=" not in items[0]:
        dtype = canonical_dtype(items[0], argument="spec")
        return Policy(param_dtype=dtype, compute_dtype=dtype, output_dtype=dtype)
    fields: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep:
            raise ValueError(f"policy item {item!r} in {spec!r} is not of the form key=dtype")
        if key not in _KEYS:
            raise ValueError(
                f"unknown policy key {key!r} in {spec!r}; expected one of {', '.join(_KEYS)}"
            )
        field = _KEYS[key]
        if field in fields:
            raise ValueError(f"policy key for {field} given twice in {spec!r}")
        fields[field] = canonical_dtype(value, argument=f"{key} in {spec!r}")
    return Policy(**fields)
