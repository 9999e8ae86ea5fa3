"""cbfloat16 numerics for torch models: exact rounding to the cbfloat16 grid, and a context
manager that runs a model with cbfloat16 weights and activations.

**The proxy dtype.** torch has no cbfloat16 dtype. ``cstorch.amp.set_half_dtype("cbfloat16")``
therefore returns ``torch.float16`` as a *proxy* (SPEC section 6): on Cerebras hardware the
compiler turns float16 tensors into cbfloat16, so a model written against the proxy runs there
unchanged. Off that hardware the proxy is just float16: a model cast to it computes with float16
numerics (5 exponent bits, 10 mantissa bits, overflow above 65504), **not** cbfloat16 numerics
(6 exponent bits, 9 mantissa bits, range up to about ``2**32``). ``is_cbfloat16_tensor`` only
reports that a float16 tensor stands for cbfloat16 under the current settings.

**Real cbfloat16 rounding.** Every cbfloat16 value is exactly representable in float32, so a
float32 tensor whose elements all lie on the cbfloat16 grid *is* a cbfloat16 tensor: float32 is
the exact container (float16 is not: cbfloat16 reaches ``(2 - 2**-9) * 2**31``, and 65504, the
largest float16, itself rounds to ``2**16``). This module rounds in that container:

* :func:`round_to_cbfloat16` rounds a tensor with the values of ``hardware``'s bit-exact
  rounding (``hardware.get_format("cbfloat16").round``, the specification), computed by torch
  operations on the tensor's own device (:mod:`~torch_facade.amp._cbfloat16_kernel`, held to
  the JAX rounding bit for bit by a test; its docstring says why there are two). The gradient
  is straight-through.
* :func:`cast_to_cbfloat16` is a cast in both directions: it also rounds the gradient flowing
  back through it, as autograd does for a cast to a real dtype.
* :func:`cbfloat16_numerics` runs a float32 model with every parameter seen by ``forward`` as
  cast to cbfloat16 (the float32 master weights stay untouched and receive the rounded
  gradients) and every module's floating outputs, and the model's inputs, cast; so the backward
  pass computes on the cbfloat16 grid too, and gradients overflow as they would in hardware.

The format is the project's model of cbfloat16 (SPEC section 7): 1 sign, 6 exponent, 9 mantissa
bits, bias 31, top exponent for inf/NaN, subnormals down to ``2**-39``, round-to-nearest-even,
overflow to inf.

Example:
    >>> import torch, torch_facade as cstorch
    >>> cstorch.amp.set_half_dtype("cbfloat16")  # a proxy: computing in it is float16 numerics
    torch.float16
    >>> x = torch.tensor([1 + 2**-10, 65504.0, 2.0**-39, 2.0**-40, 1e10])
    >>> cstorch.amp.round_to_cbfloat16(x).tolist() == [1.0, 2.0**16, 2.0**-39, 0.0, float("inf")]
    True
    >>> cstorch.amp.round_to_cbfloat16(x.half()).dtype  # float32 is the exact container
    torch.float32
    >>> _ = cstorch.amp.set_half_dtype("float16"); _ = cstorch.amp.enable_mixed_precision(False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch.nn.utils import parametrize

from torch_facade.amp import _cbfloat16_kernel
from torch_facade.amp._host_side import host_side

__all__ = ["cast_to_cbfloat16", "cbfloat16_numerics", "round_to_cbfloat16"]

_EXACT_DTYPES = (torch.float32, torch.float64)
"""Dtypes that hold every cbfloat16 value exactly."""


def _round_values(tensor: torch.Tensor) -> torch.Tensor:
    """The rounded values of ``tensor`` as a new float32 tensor on its device (no autograd)."""
    source = tensor.detach()
    if source.dtype != torch.float32:
        source = source.to(torch.float32)
    return _cbfloat16_kernel.round_float32(source)


def _check_floating_tensor(value: Any, argument: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor; got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(
            f"{argument} must be a floating-point tensor (float16, bfloat16, float32 or "
            f"float64); got dtype {value.dtype}"
        )
    return value


class _RoundToCbfloat16(torch.autograd.Function):
    """Rounding with a straight-through gradient (the derivative is taken to be 1)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.input_dtype = dtype = tensor.dtype
        rounded = _round_values(tensor)
        if dtype == torch.float32:  # the preview's every cast: no conversion call
            return rounded
        return rounded.to(torch.promote_types(dtype, torch.float32))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.to(ctx.input_dtype)


_CAST_OPERATOR: list[Callable[[torch.Tensor], torch.Tensor]] = []
"""``[torch.ops.cstorch.cbfloat16_cast.default]`` once :func:`_define_cast_operator` ran."""


def _define_cast_operator() -> None:
    """Defines the operator ``cstorch::cbfloat16_cast`` (``torch.library``), once per process:
    :func:`cast_to_cbfloat16` as one operator of torch's library, the form in which
    :func:`cbfloat16_numerics` puts its casts into ``torch.compile`` graphs.

    Dynamo records each cast as one call of the operator, autograd's backward as another (the
    registered backward casts the gradient with the same operator), and inductor calls the
    eager kernel for it (:func:`_round_values`: on the CPU the loop compiled once per process)
    rather than generating the rounding's code into the kernels around it. Traced as element-
    wise operations instead, every cast was eleven operations in the forward graph and as many
    in the backward one, and inductor's Python code generation of the kernels they were fused
    into made most of a compiled GPT-2's first compilation (about 3.8 times float32's).

    The result is a new float32 (float64 for a float64 input) tensor, contiguous, of the input's
    shape: the fake implementation says so for any input, and the real one copies the few
    results of the eager kernel that are laid out otherwise (strided inputs)."""
    if _CAST_OPERATOR:
        return
    name = "cstorch::cbfloat16_cast"
    try:
        operator = torch.library.custom_op(name, mutates_args=())(_cast_operator_values)
    except RuntimeError:  # defined by an earlier copy of this module (a reload): use it
        _CAST_OPERATOR.append(torch.ops.cstorch.cbfloat16_cast.default)
        return
    operator.register_fake(_cast_operator_fake)
    operator.register_autograd(_cast_operator_backward, setup_context=_cast_operator_setup)
    _CAST_OPERATOR.append(torch.ops.cstorch.cbfloat16_cast.default)


def _cast_operator_values(tensor: torch.Tensor) -> torch.Tensor:
    """The implementation of ``cstorch::cbfloat16_cast`` on every device."""
    rounded = _round_values(tensor).to(torch.promote_types(tensor.dtype, torch.float32))
    if rounded.stride() == _contiguous_strides(rounded.shape):
        return rounded
    return torch.empty(rounded.shape, dtype=rounded.dtype, device=rounded.device).copy_(rounded)


def _cast_operator_fake(tensor: torch.Tensor) -> torch.Tensor:
    """What ``cstorch::cbfloat16_cast`` returns, for tracing: its dtype, shape and layout."""
    return tensor.new_empty(tensor.shape, dtype=torch.promote_types(tensor.dtype, torch.float32))


def _cast_operator_setup(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
    ctx.input_dtype = inputs[0].dtype


def _cast_operator_backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
    """A cast's transpose is a cast: the gradient rounded, in the input's dtype."""
    return _CAST_OPERATOR[0](grad_output).to(ctx.input_dtype)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _CastToCbfloat16(_RoundToCbfloat16):
    """A cast: rounds the values, and rounds the incoming gradient in the backward pass."""

    @staticmethod
    @host_side  # torch's autograd engine calls it: behind the boundary, as the forward is
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        rounded = _round_values(grad_output)
        return rounded if ctx.input_dtype == torch.float32 else rounded.to(ctx.input_dtype)


@host_side
def cast_to_cbfloat16(tensor: torch.Tensor) -> torch.Tensor:
    """Casts a floating tensor to cbfloat16 (in float32) in both directions, like ``.to(dtype)``.

    The values are those of :func:`round_to_cbfloat16`; in the backward pass the incoming
    gradient is rounded to cbfloat16 as well, as autograd does for a cast to a real dtype, so
    the backward pass computes on the cbfloat16 grid too (gradients overflow above about
    ``2**32`` and underflow below ``2**-39``: what loss scaling is for). This is what
    :func:`cbfloat16_numerics` applies to weights and activations; it matches
    ``hardware.get_format("cbfloat16").cast`` on the JAX side.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``, or not of a floating-point dtype.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> x = torch.ones(2, requires_grad=True)
        >>> (cstorch.amp.cast_to_cbfloat16(x) * 1e10).sum().backward(); x.grad
        tensor([inf, inf])
    """
    return _CastToCbfloat16.apply(_check_floating_tensor(tensor, "tensor"))


@host_side
def round_to_cbfloat16(tensor: torch.Tensor) -> torch.Tensor:
    """Rounds a floating tensor to the nearest cbfloat16 values, bit-exactly.

    The values are those of ``hardware.get_format("cbfloat16").round`` (round-to-nearest-even,
    subnormals kept, overflow to inf, NaN stays NaN, the sign of zero kept), computed on the
    tensor's device by a few element-wise torch operations that a test holds to that JAX
    function bit for bit (no crossing into JAX); on the CPU, once :func:`cbfloat16_numerics`
    has been entered in the process, by the one loop it compiled (a call alone compiles
    nothing).

    Result dtype: ``torch.promote_types(tensor.dtype, torch.float32)``. A float32 input gives
    float32, the exact container of cbfloat16. float16 and bfloat16 inputs (for example the
    float16 proxy of ``set_half_dtype("cbfloat16")``) also give float32, because cbfloat16 values
    need not fit them (65504 rounds to ``2**16``, beyond float16). float64 inputs give float64;
    they are converted to float32 first, so they are rounded twice (as ``hardware`` does).

    Gradient: straight-through. The incoming gradient passes unchanged (cast to the input's
    dtype), also where a value overflowed to inf or underflowed to zero, as in
    quantisation-aware training.

    Args:
        tensor: a floating-point tensor of any shape, on any device torch computes on.

    Returns:
        A new tensor of ``tensor``'s shape and device whose elements lie on the cbfloat16 grid.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``, or not of a floating-point dtype.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> x = torch.tensor([1 + 2**-10, 1 + 3 * 2**-10, 2.0**-40, -0.0], requires_grad=True)
        >>> y = cstorch.amp.round_to_cbfloat16(x)
        >>> y.tolist() == [1.0, 1 + 2**-8, 0.0, -0.0]
        True
        >>> y.sum().backward(); x.grad
        tensor([1., 1., 1., 1.])
    """
    return _RoundToCbfloat16.apply(_check_floating_tensor(tensor, "tensor"))


_CAST_VERSION = "_cstorch_cbfloat16_cast_version"
"""The attribute :func:`_cast` leaves on its results: their version counter when made."""


def _cast(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`cast_to_cbfloat16` of a tensor known to be float32 or float64, for the hooks of
    :func:`cbfloat16_numerics` (about 200 casts an iteration of a small GPT-2): eagerly, the
    autograd function itself, without the argument check and the boundary's wrapper; under
    ``torch.compile``, the operator ``cstorch::cbfloat16_cast`` (:func:`_define_cast_operator`),
    one node of the graph that inductor runs as a call of the eager kernel (no graph break, no
    guard on the tensor's type).

    Eagerly, a tensor that is itself one of these casts' results, unchanged since (its version
    counter as it was), is returned as it is: a ``Dropout(p=0)`` returns its input, a container
    its last submodule's output. Its values are on the grid already, and its gradient is rounded
    by the cast that made it, once all its uses are summed."""
    if torch.compiler.is_compiling():
        return _CAST_OPERATOR[0](tensor)
    made_at = getattr(tensor, _CAST_VERSION, None)
    if made_at is not None and made_at == tensor._version:
        return tensor
    rounded = cast(torch.Tensor, _CastToCbfloat16.apply(tensor))
    if not rounded.is_inference():  # inference tensors have no version counter: cast again
        setattr(rounded, _CAST_VERSION, rounded._version)
    return rounded


_MASTER = "_cstorch_cbfloat16_master"
"""The attribute :class:`_RoundParametrization` leaves on an eager rounded parameter: the
parameter it was rounded from, and that parameter's version counter then."""


class _RoundParametrization(torch.nn.Module):
    """The parametrization :func:`cbfloat16_numerics` registers: the effective tensor is the
    rounded original. Eagerly, the result remembers its parameter (:data:`_MASTER`), so that a
    backward pass that needs it recomputes it instead of holding it (:class:`_RecomputeWeights`)."""

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        rounded = _cast(tensor)
        if torch.compiler.is_compiling():
            return rounded
        if rounded is not tensor and hasattr(rounded, _CAST_VERSION):  # not an inference tensor
            setattr(rounded, _MASTER, (tensor, tensor._version))
        return rounded


class _Recomputed:
    """What :class:`_RecomputeWeights` keeps for a saved rounded parameter (or a view of one):
    the parameter, its version, the dtype and the view's geometry."""

    __slots__ = ("dtype", "master", "offset", "size", "stride", "version")

    def __init__(self, master: torch.Tensor, version: int, saved: torch.Tensor) -> None:
        self.master = master
        self.version = version
        self.dtype = saved.dtype
        self.size = saved.size()
        self.stride = saved.stride()
        self.offset = saved.storage_offset()


def _pack(saved: torch.Tensor) -> Any:
    """A saved tensor that is a rounded parameter (or a view of one), unchanged since it was
    made: its parameter, to round again when the backward pass needs it; any other: itself."""
    base = saved._base if saved._is_view() else saved
    if base is None:
        return saved
    made = getattr(base, _MASTER, None)
    if made is None or getattr(base, _CAST_VERSION, None) != base._version:
        return saved
    master, version = made
    if master._version != version or saved.dtype != base.dtype:
        return saved
    return _Recomputed(master, version, saved)


def _unpack(packed: Any) -> torch.Tensor:
    if not isinstance(packed, _Recomputed):
        return cast(torch.Tensor, packed)
    master = packed.master
    if master._version != packed.version:
        raise RuntimeError(
            "cbfloat16_numerics: a parameter of shape "
            f"{tuple(master.shape)} was modified in place (an optimizer step?) between the "
            "forward pass and the backward pass that needs its rounded value; run backward() "
            "before changing the parameters"
        )
    rounded = _round_values(master).to(packed.dtype)
    return rounded.as_strided(packed.size, packed.stride, packed.offset)


class _RecomputeWeights:
    """Saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) around each eager,
    grad-recording forward pass of the model under :func:`cbfloat16_numerics`: a rounded
    weight that an operation saves for its backward (a linear layer saves its weight) is kept
    as its parameter and rounded again in the backward pass, instead of being held from the
    forward pass to the backward pass beside its float32 parameter (4 bytes per parameter, a
    second copy of the model). The backward pass computes with the same bits, and pays one
    more rounding of each weight."""

    def __init__(self) -> None:
        self._entered: list[Any] = []

    def enter(self, module: torch.nn.Module, args: Any) -> None:
        """The model's forward pre-hook (nothing under ``torch.compile``, whose graphs round
        inside their own kernels)."""
        if torch.compiler.is_compiling():
            return
        hooks = None
        if torch.is_grad_enabled():
            hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
            hooks.__enter__()
        self._entered.append(hooks)

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The model's forward hook (called also when the forward pass raised)."""
        if torch.compiler.is_compiling() or not self._entered:
            return
        hooks = self._entered.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)


def _round_tree(value: Any) -> Any:
    """Rounds every float32/float64 tensor in nested tuples, lists and dicts; keeps the rest."""
    if isinstance(value, torch.Tensor):
        return _cast(value) if value.dtype in _EXACT_DTYPES else value
    # Lists, not generator expressions: dynamo traces a list comprehension inside the compiled
    # frame, and gives up on a generator (a hook frame it skips, with a note in its counters).
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*[_round_tree(v) for v in value])
    if isinstance(value, (tuple, list)):
        return type(value)([_round_tree(v) for v in value])
    if isinstance(value, dict):
        return type(value)([(k, _round_tree(v)) for k, v in value.items()])
    return value


def _round_inputs_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict) -> Any:
    return _round_tree(args), _round_tree(kwargs)


def _round_outputs_hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
    return _round_tree(output)


def _model_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and its submodules, without the internals of existing parametrizations (the
    ``parametrizations`` containers and what they hold)."""
    internal: set[int] = set()
    for owner in module.modules():
        if parametrize.is_parametrized(owner):
            internal.update(id(m) for m in _parametrizations(owner).modules())
    return [m for m in module.modules() if id(m) not in internal]


def _parametrized_tensors(modules: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, str]]:
    """``(owner, name)`` of every parameter of ``modules`` (an existing parametrization counts
    as its owner's), each owner once per name: a parameter shared by two modules is
    parametrized in both."""
    found: list[tuple[torch.nn.Module, str]] = []
    for owner in modules:
        names = [name for name, p in owner._parameters.items() if p is not None]
        if parametrize.is_parametrized(owner):
            names += [n for n in _parametrizations(owner) if n not in names]
        found.extend((owner, name) for name in names)
    return found


def _parametrizations(owner: torch.nn.Module) -> torch.nn.ModuleDict:
    """``owner.parametrizations`` (torch registers it as a ``ModuleDict``)."""
    return cast(torch.nn.ModuleDict, owner.parametrizations)


def _check_dtypes(targets: list[tuple[torch.nn.Module, str]]) -> None:
    for owner, name in targets:
        dtype = getattr(owner, name).dtype
        if dtype not in _EXACT_DTYPES:
            raise ValueError(
                f"cbfloat16_numerics needs float32 (or float64) parameters, the containers "
                f"that hold cbfloat16 exactly; {type(owner).__name__}.{name} is {dtype}. Keep "
                f"the model in float32 (not in the float16 proxy of set_half_dtype"
                f"('cbfloat16'), which computes with float16 numerics)"
            )


def _remove_rounding(owner: torch.nn.Module, name: str, rounding: torch.nn.Module) -> None:
    """Removes ``rounding`` from ``owner``'s parametrizations of ``name``, keeping any other."""
    chain = cast(torch.nn.ModuleList, _parametrizations(owner)[name])
    if len(chain) == 1:
        parametrize.remove_parametrizations(owner, name, leave_parametrized=False)
        return
    index = next(i for i, p in enumerate(chain) if p is rounding)
    del chain[index]


def _restore_order(owner: torch.nn.Module, names: list[str]) -> None:
    """Puts ``owner``'s parameters back in the order ``names`` (state-dict keys included)."""
    for name in names:
        if name in owner._parameters:
            owner._parameters[name] = owner._parameters.pop(name)


@contextlib.contextmanager
def cbfloat16_numerics(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Runs ``module`` with cbfloat16 weights and activations while the context is active.

    On entry:

    * every parameter of ``module`` and of its submodules gets a parametrization
      (``torch.nn.utils.parametrize``) that rounds it to cbfloat16 with
      :func:`cast_to_cbfloat16`: ``forward`` sees the rounded weights, the float32 master
      weights stay as they are and get gradients rounded to cbfloat16, so an optimizer built
      before the context keeps stepping the same ``Parameter`` objects;
    * every module (containers and leaves) gets a forward hook that rounds its float32/float64
      outputs (in nested tuples, lists and dicts too), and ``module`` a pre-hook that rounds the
      float32/float64 tensors among its inputs.

    So every weight and every activation passed between modules is a cbfloat16 value held in
    float32, while each operation computes in float32 (as a matmul accumulating in float32 and
    storing cbfloat16). Results of functional calls inside a ``forward`` (``torch.tanh(x)``, a
    residual addition) are rounded when the module that made them returns. In the backward
    pass, the gradient reaching each of these casts is rounded too (a cast's transpose is a
    cast), so overflows of the backward pass show, as with a real half dtype. An output that
    is already such a cast's result, unchanged (a ``Dropout(p=0)`` returns its input, a
    ``Sequential`` its last module's output), is not cast again: the values are on the grid,
    and its gradient is rounded where it was cast, after all its uses are summed. Buffers
    (e.g. BatchNorm statistics) are not rounded. While active, ``module.state_dict()`` has
    parametrization keys (``...parametrizations.weight.original``) and ``module.modules()``
    lists the parametrization modules too.

    Memory: in the model's forward pass (eagerly, with grad recording on), a rounded weight
    that an operation saves for its backward pass (a linear layer saves its weight) is kept as
    its float32 parameter and rounded again when the backward pass needs it, so the preview
    does not hold a second copy of the weights between the two passes; the backward pass
    computes with the same bits. As for any saved weight, changing a parameter in place
    between the forward pass and that backward pass (an optimizer step) is a
    ``RuntimeError`` at the backward pass.

    On the CPU the first entry in a process also compiles the rounding loop (seconds: on a
    2-core AMD EPYC about 8 s with an empty inductor cache, 2.7 s with a warm one, most of it
    importing inductor;
    ``CSTORCH_CBFLOAT16_FUSED=0`` keeps the uncompiled rounding, with the same bits).

    On exit (also on an exception) every parametrization and hook added is removed: the
    modules have their original classes, parameters and state-dict keys again, and the
    parameters are bit-identical to before unless an optimizer stepped them. Parametrizations
    that were there before are kept (the rounding was appended to them and is removed alone).

    This does not depend on the half dtype setting; it is how to see cbfloat16 numerics after
    ``set_half_dtype("cbfloat16")``, whose ``torch.float16`` proxy computes in float16.

    Args:
        module: the model, with float32 (or float64) parameters.

    Yields:
        ``module`` itself.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``.
        ValueError: a parameter is not float32 or float64 (e.g. a model cast to the float16
            proxy): those dtypes cannot hold cbfloat16 exactly.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.tensor([[1 + 2**-12, 3.0]]))
        >>> with cstorch.amp.cbfloat16_numerics(model):
        ...     print(model.weight.tolist(), model(torch.ones(1, 2)).item())
        [[1.0, 3.0]] 4.0
        >>> print(model.weight.tolist(), model(torch.ones(1, 2)).item())  # master weight kept
        [[1.000244140625, 3.0]] 4.000244140625
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    hooked = _model_modules(module)
    targets = _parametrized_tensors(hooked)
    _check_dtypes(targets)
    _define_cast_operator()
    if any(getattr(owner, name).device.type == "cpu" for owner, name in targets):
        # The fused CPU rounding is compiled here, once per process, not inside a first
        # iteration: dynamo reads parametrized weights eagerly while it traces a compiled model.
        _cbfloat16_kernel.prepare_fused_rounding()
    with contextlib.ExitStack() as undo:
        handle = module.register_forward_pre_hook(_round_inputs_hook, with_kwargs=True)
        undo.callback(handle.remove)
        recompute = _RecomputeWeights()
        handle = module.register_forward_pre_hook(recompute.enter)
        undo.callback(handle.remove)
        for submodule in hooked:
            handle = submodule.register_forward_hook(_round_outputs_hook)
            undo.callback(handle.remove)
        handle = module.register_forward_hook(recompute.exit, always_call=True)
        undo.callback(handle.remove)
        for owner in {id(owner): owner for owner, _ in targets}.values():
            # Runs last: removing a parametrization re-registers the parameter at the end.
            undo.callback(_restore_order, owner, list(owner._parameters))
        for owner, name in targets:
            rounding = _RoundParametrization()
            parametrize.register_parametrization(owner, name, rounding)
            undo.callback(_remove_rounding, owner, name, rounding)
        yield module
