"""``cstorch.amp.with_master_weights``: float32 master copies for a model held in float16 or bfloat16.

A model loaded in half precision (``from_pretrained(torch_dtype=torch.float16)``, ``.half()``)
has half-precision parameters, and an optimizer over them steps in that dtype: an update
smaller than half a unit in the last place of a parameter rounds away (at 1.0, float16's unit is
2**-10 and bfloat16's 2**-7, so an AdamW step of ``lr=1e-4`` changes nothing), and torch's
scaler refuses the gradients ("Attempting to unscale FP16 gradients"). apex's O2 mode kept
float32 master copies; :func:`with_master_weights` does the same for any ``torch.optim``
optimizer:

* the optimizer given is re-pointed at float32 copies of its half parameters (float32 and
  float64 parameters it steps as they are) and becomes the *inner* optimizer;
* the returned :class:`MasterWeightsOptimizer` holds the half parameters (what the model, the
  scaler and ``clip_grad_norm_(model.parameters())`` see), and its ``step()`` copies their
  gradients into float32, lets the inner optimizer step the masters, and writes the masters,
  rounded to nearest, back into the half parameters.

With a :class:`~torch_facade.amp.GradScaler` the overflow decision reads the half gradients
(where an overflow happens) and, as torch's protocol for optimizers that unscale themselves
(``_step_supports_amp_scaling``) has it, hands ``step()`` the scale and the overflow flag: the
gradients are unscaled after the copy, in float32, and a skipped step changes neither masters,
half parameters nor the inner optimizer's state. After ``grad_scaler.unscale_(optimizer)`` (for
clipping, and in ``optimizer_step``) the scaler has unscaled the half gradients in their own
dtype already, and ``step()`` copies them as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from torch_facade.amp._engine import engine_of

__all__ = ["MasterWeightsOptimizer", "with_master_weights"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_MASTER = "master_param"
_STATE_KEYS = frozenset({"state", "param_groups", "master_params"})


def _describe_dtypes(params: Iterable[torch.Tensor]) -> str:
    return ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in params})) or "none"


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer; got "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        )
    if isinstance(optimizer, MasterWeightsOptimizer):
        raise ValueError(
            "optimizer steps float32 master weights already (a MasterWeightsOptimizer); pass "
            "it as it is"
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(p.dtype in _HALF_DTYPES for p in params):
        raise ValueError(
            "optimizer holds no float16 or bfloat16 parameter (its parameters are "
            f"{_describe_dtypes(params)}): with_master_weights keeps float32 copies of "
            "half-precision parameters; step this optimizer as it is"
        )
    stepped = sum(1 for entry in optimizer.state.values() if entry)
    if stepped:
        raise ValueError(
            f"optimizer has state for {stepped} parameter(s) already (it has stepped): its "
            "state follows the half parameters, not float32 copies. Wrap a new optimizer "
            "before its first step; to resume a run, wrap it and load the wrapper's "
            "state_dict()"
        )
    if engine_of(optimizer) is not None:
        raise ValueError(
            "optimizer is known to a GradScaler already, which would go on reading the "
            "parameters it no longer holds. Wrap it before passing it to the scaler (or to "
            "optimizer_step), and pass the returned optimizer from then on"
        )


def with_master_weights(optimizer: torch.optim.Optimizer) -> MasterWeightsOptimizer:
    """Returns the optimizer to use instead of ``optimizer``: it steps float32 master weights.

    ``optimizer`` (any ``torch.optim.Optimizer`` over a model whose parameters are float16 or
    bfloat16, not stepped yet) is re-pointed at float32 copies of its half parameters; the
    returned optimizer holds the half parameters and, at each ``step()``, copies their gradients
    into float32 (unscaling them there when a scaler hands it the scale), steps the copies with
    ``optimizer``'s own update, and writes them back rounded to the half dtype. Pass the
    returned optimizer everywhere from then on: ``GradScaler.step``, ``optimizer_step``, LR
    schedulers, trainers, checkpoints (its ``state_dict()`` holds the masters). Memory: 4 bytes
    per half parameter for the master, plus the inner optimizer's state in float32 instead of
    the half dtype, plus float32 gradient copies during ``step()``.

    Args:
        optimizer: the optimizer over the half-precision parameters, before its first step.

    Returns:
        A :class:`MasterWeightsOptimizer` wrapping ``optimizer``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: it holds no float16 or bfloat16 parameter, has state (it has stepped), is
            wrapped already, or is known to a ``GradScaler`` already.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> model = torch.nn.Linear(4, 1).half()
        >>> optimizer = cstorch.amp.with_master_weights(torch.optim.AdamW(model.parameters(), lr=1e-4))
        >>> grad_scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
        >>> for _ in range(3):
        ...     loss = model(torch.ones(2, 4, dtype=torch.float16)).float().square().mean()
        ...     cstorch.amp.optimizer_step(loss, optimizer, grad_scaler)
        >>> optimizer.master_params()[0].dtype, model.weight.dtype
        (torch.float32, torch.float16)
        >>> bool((optimizer.master_params()[0] != model.weight.float()).any())  # updates kept
        True
    """
    _check_optimizer(optimizer)
    return MasterWeightsOptimizer(optimizer)


class MasterWeightsOptimizer(torch.optim.Optimizer):
    """An optimizer over half-precision parameters that steps float32 master copies of them.

    Made by :func:`with_master_weights`; see there. ``param_groups`` hold the half parameters
    (with the inner optimizer's hyper-parameters: schedulers set them here, and ``step()`` hands
    them on); ``state[p]["master_param"]`` is the tensor the inner optimizer steps for ``p`` (its
    float32 copy, or ``p`` itself for a parameter that is not float16 or bfloat16);
    :attr:`optimizer` is the inner optimizer.

    ``step()``, in order::

        copy each half gradient into its master's float32 .grad
        if a scaler handed a scale: divide the float32 gradients by it
        if a scaler handed an overflow flag: skip (change nothing) where it is set
        inner.step()                      # on the masters
        half.copy_(master)                # round to nearest, for each master that had a gradient

    An inner optimizer that unscales and skips in its own kernel (``fused=True`` Adam, AdamW,
    SGD, once it has state) is handed the scale and the flag instead, with no host read;
    otherwise the flag is read on the host (as the scaler does for non-fused optimizers).
    The master gradients exist only during ``step()``.

    Load model weights before wrapping (the masters are copied then), or restore them with
    :meth:`load_state_dict`, which writes the masters' rounded values into the model too.

    Args:
        optimizer: the inner optimizer (checked by :func:`with_master_weights`).

    Example:
        >>> import torch, torch_facade as cstorch
        >>> weight = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        >>> optimizer = cstorch.amp.with_master_weights(torch.optim.SGD([weight], lr=1e-3))
        >>> weight.grad = torch.ones(3, dtype=torch.bfloat16)
        >>> optimizer.step()
        >>> weight.tolist(), optimizer.master_params()[0].tolist()[0]  # 0.999 is not bfloat16
        ([1.0, 1.0, 1.0], 0.9990000128746033)
    """

    _step_supports_amp_scaling = True  # step() reads grad_scale and found_inf (see above)
    _steps_float32_masters = True  # GradScaler: no advice to wrap it (it is wrapped)

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._inner: torch.optim.Optimizer | None = None  # add_param_group: not yet
        groups = [dict(group) for group in optimizer.param_groups]
        super().__init__(groups, optimizer.defaults)
        for own, inner_group in zip(self.param_groups, optimizer.param_groups, strict=True):
            inner_group["params"] = [self._make_master(p) for p in own["params"]]
        self._inner = optimizer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer, over the masters (step this wrapper, not it)."""
        assert self._inner is not None
        return self._inner

    def _make_master(self, param: torch.Tensor) -> torch.Tensor:
        if param.dtype in _HALF_DTYPES:
            master = param.detach().to(torch.float32, copy=True)
            master.requires_grad_(param.requires_grad)
        else:
            master = param
        self.state[param] = {_MASTER: master}
        return master

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, master) for every parameter, in param-group order."""
        return [(p, self.state[p][_MASTER]) for group in self.param_groups for p in group["params"]]

    def master_params(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer steps, in param-group order (float32 copies of the
        half parameters; the other parameters themselves).

        Example:
            >>> import torch, torch_facade as cstorch
            >>> params = [torch.zeros(2, dtype=torch.float16, requires_grad=True),
            ...           torch.zeros(1, requires_grad=True)]
            >>> optimizer = cstorch.amp.with_master_weights(torch.optim.SGD(params, lr=0.1))
            >>> [m.dtype for m in optimizer.master_params()], optimizer.master_params()[1] is params[1]
            ([torch.float32, torch.float32], True)
        """
        return [master for _, master in self._pairs()]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group of parameters (half ones get masters), here and to the inner optimizer.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> first = torch.zeros(2, dtype=torch.float16, requires_grad=True)
            >>> optimizer = cstorch.amp.with_master_weights(torch.optim.SGD([first], lr=0.1))
            >>> optimizer.add_param_group({"params": [torch.ones(3, dtype=torch.float16)], "lr": 0.5})
            >>> optimizer.optimizer.param_groups[1]["lr"], optimizer.master_params()[1].dtype
            (0.5, torch.float32)
        """
        super().add_param_group(param_group)
        inner = self._inner
        if inner is None:  # building: __init__ makes the masters of the first groups
            return
        own = self.param_groups[-1]
        inner_group = {k: v for k, v in own.items() if k != "params"}
        inner_group["params"] = [self._make_master(p) for p in own["params"]]
        try:
            inner.add_param_group(inner_group)
        except Exception:
            self.param_groups.pop()
            for p in own["params"]:
                self.state.pop(p, None)
            raise

    def _hand_on_hyperparameters(self) -> None:
        """Copies every group's entries but ``params`` (set by schedulers here) to the inner
        groups (the same objects: a tensor ``lr`` stays one tensor)."""
        for own, inner_group in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            for key, value in own.items():
                if key != "params":
                    inner_group[key] = value

    def _take_back_hyperparameters(self) -> None:
        for own, inner_group in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            for key, value in inner_group.items():
                if key != "params":
                    own[key] = value

    def _inner_skips_itself(self, masters: list[torch.Tensor]) -> bool:
        """Whether the inner optimizer can be handed the scale and the flag: a fused kernel
        that unscales and skips, with state for every master it steps (a skipped first step
        would create state)."""
        inner = self.optimizer
        if not getattr(inner, "_step_supports_amp_scaling", False):
            return False
        if hasattr(inner, "grad_scale") or hasattr(inner, "found_inf"):
            return False
        with_state = {id(p) for p, entry in inner.state.items() if entry}
        return all(id(m) in with_state for m in masters)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Steps the masters with the inner optimizer and rounds them into the half parameters.

        A ``GradScaler`` may set ``grad_scale`` (what the gradients are divided by, in
        float32) and ``found_inf`` (nonzero: skip, changing nothing) for the call. ``closure``
        is called first (with gradients enabled), as by any optimizer.

        Returns:
            What ``closure`` returned, or ``None``.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> weight = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
            >>> optimizer = cstorch.amp.with_master_weights(torch.optim.SGD([weight], lr=0.5))
            >>> weight.grad = torch.ones(2, dtype=torch.float16)
            >>> optimizer.step()
            >>> weight
            Parameter containing:
            tensor([0.5000, 0.5000], dtype=torch.float16, requires_grad=True)
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)
        with torch.no_grad():
            self._step(grad_scale, found_inf)
        return loss

    def _step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        stepped = [(p, m) for p, m in self._pairs() if p.grad is not None]
        masters = [m for _, m in stepped]
        in_kernel = found_inf is not None and self._inner_skips_itself(masters)
        if found_inf is not None and not in_kernel and bool(found_inf):  # a host read
            return
        copies = [(p, m) for p, m in stepped if m is not p]
        for param, master in copies:
            master.grad = param.grad.to(torch.float32)  # type: ignore[union-attr]
        inner = self.optimizer
        self._hand_on_hyperparameters()
        try:
            if in_kernel:
                inner.grad_scale = grad_scale  # type: ignore[attr-defined]
                inner.found_inf = found_inf  # type: ignore[attr-defined]
                try:
                    inner.step()
                finally:
                    del inner.grad_scale  # type: ignore[attr-defined]
                    del inner.found_inf  # type: ignore[attr-defined]
            else:
                if grad_scale is not None and masters:
                    grads = [m.grad for m in masters]
                    torch._foreach_div_(grads, grad_scale)  # type: ignore[arg-type]
                inner.step()
            for param, master in copies:
                param.copy_(master)  # rounds to nearest; unchanged where the kernel skipped
        finally:
            for _, master in copies:
                master.grad = None
        self._take_back_hyperparameters()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's ``state_dict()`` plus ``"master_params"``: index -> master.

        Indices count parameters in param-group order, as torch's do; only half parameters
        have an entry. Like torch's, it holds references to the live tensors (copy it, or save
        it, before stepping on). A plain optimizer loads it too (torch ignores the extra key
        and casts the state to its parameters' dtype).

        Example:
            >>> import torch, torch_facade as cstorch
            >>> params = [torch.ones(2, dtype=torch.float16, requires_grad=True)]
            >>> optimizer = cstorch.amp.with_master_weights(torch.optim.SGD(params, lr=0.1))
            >>> sorted(optimizer.state_dict()), optimizer.state_dict()["master_params"][0].dtype
            (['master_params', 'param_groups', 'state'], torch.float32)
        """
        self._hand_on_hyperparameters()
        inner = self.optimizer.state_dict()
        masters = {i: m for i, (p, m) in enumerate(self._pairs()) if m is not p}
        return {
            "state": inner["state"],
            "param_groups": inner["param_groups"],
            "master_params": masters,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a :meth:`state_dict`: the inner optimizer's state, and the masters bit for bit,
        whose rounded values it also writes into the half parameters.

        A plain optimizer's ``state_dict()`` (no ``"master_params"``) loads too: its state is
        cast to float32 and the masters keep their values (the half parameters').

        Raises:
            TypeError: ``state_dict`` is not a mapping, or a master is not a tensor.
            ValueError: an unknown or missing key, or masters that do not match the half
                parameters (which ones, their count, shape or dtype); nothing is changed.

        Example:
            >>> import copy, torch, torch_facade as cstorch
            >>> weight = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
            >>> optimizer = cstorch.amp.with_master_weights(torch.optim.SGD([weight], lr=1e-4))
            >>> weight.grad = torch.ones(2, dtype=torch.float16)
            >>> optimizer.step()
            >>> saved = copy.deepcopy(optimizer.state_dict())
            >>> fresh = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
            >>> resumed = cstorch.amp.with_master_weights(torch.optim.SGD([fresh], lr=1e-4))
            >>> resumed.load_state_dict(saved)
            >>> torch.equal(resumed.master_params()[0], optimizer.master_params()[0])
            True
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping; got {type(state_dict).__name__}")
        unknown = set(state_dict) - _STATE_KEYS
        missing = {"state", "param_groups"} - set(state_dict)
        if unknown or missing:
            raise ValueError(
                "state_dict must hold 'state', 'param_groups' and (from a "
                f"MasterWeightsOptimizer) 'master_params'; got unknown keys {sorted(unknown)} "
                f"and missing keys {sorted(missing)}"
            )
        pairs = self._pairs()
        saved = state_dict.get("master_params")
        if saved is not None:
            self._check_masters(saved, pairs)
        self.optimizer.load_state_dict(
            {"state": state_dict["state"], "param_groups": state_dict["param_groups"]}
        )
        with torch.no_grad():
            for index, master_value in (saved or {}).items():
                param, master = pairs[index]
                master.copy_(master_value)
                param.copy_(master)
        self._take_back_hyperparameters()

    @staticmethod
    def _check_masters(saved: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not isinstance(saved, Mapping):
            raise TypeError(
                f"state_dict['master_params'] must be a mapping; got {type(saved).__name__}"
            )
        expected = {i for i, (p, m) in enumerate(pairs) if m is not p}
        if set(saved) != expected:
            raise ValueError(
                "state_dict['master_params'] must have an entry for each half parameter, by "
                f"index: expected {sorted(expected)}, got {sorted(saved)}"
            )
        for index, value in saved.items():
            master = pairs[index][1]
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"state_dict['master_params'][{index}] must be a tensor; got "
                    f"{type(value).__name__}"
                )
            if value.shape != master.shape or value.dtype != master.dtype:
                raise ValueError(
                    f"state_dict['master_params'][{index}] must be a {master.dtype} tensor of "
                    f"shape {tuple(master.shape)}; got {value.dtype} of shape {tuple(value.shape)}"
                )
