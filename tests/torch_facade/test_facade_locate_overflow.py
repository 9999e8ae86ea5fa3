"""``cstorch.amp.locate_overflow``: which module's output or input gradient overflowed.

The oracle is the model evaluated by hand, layer by layer with ``torch.nn.functional``, and its
gradients taken with ``torch.autograd.grad`` w.r.t. each layer's input: the events are the
checks whose magnitude exceeds the threshold, numbered in the order the hooks run (forward: the
order the modules return, the container last; backward: from the last layer's input back).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from facade_helpers import tiny_gpt2

import torch_facade as cstorch
from torch_facade.amp.locate_overflow import LocatedOverflow, OverflowEvent

FLOAT16_MAX = 65504.0


def planted_model(planted_weight: float, first_weight: float = 0.01) -> torch.nn.Sequential:
    """Linear, ReLU, planted Linear (every weight ``planted_weight``), ReLU, Linear."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 2),
    )
    with torch.no_grad():
        model[0].weight.fill_(first_weight)
        model[0].bias.zero_()
        model[2].weight.fill_(planted_weight)
        model[2].bias.zero_()
        model[4].weight.fill_(0.5)
    return model


def oracle(
    model: torch.nn.Sequential, x: torch.Tensor, loss_scale: float | None, threshold: float
) -> list[tuple[str, str, float, int]]:
    """The expected events, from the model evaluated by hand."""
    w0, b0 = model[0].weight, model[0].bias
    w2, b2 = model[2].weight, model[2].bias
    w4, b4 = model[4].weight, model[4].bias
    h0 = F.linear(x, w0, b0)
    h1 = torch.relu(h0)
    h2 = F.linear(h1, w2, b2)
    h3 = torch.relu(h2)
    h4 = F.linear(h3, w4, b4)
    # Forward: "0".."4" return in order, then the Sequential itself (its output is h4).
    checks = [
        (name, "forward", out) for name, out in zip("01234", (h0, h1, h2, h3, h4), strict=True)
    ]
    checks.append(("", "forward", h4))
    if loss_scale is not None:
        # Backward: the gradient w.r.t. the input of "4", "3", "2", "1" (that of "0" is x,
        # which needs no gradient).
        inputs = {"4": h3, "3": h2, "2": h1, "1": h0}
        grads = torch.autograd.grad(h4.sum() * loss_scale, list(inputs.values()))
        checks += [(name, "backward", g) for name, g in zip(inputs, grads, strict=True)]
    expected = []
    for call, (name, kind, tensor) in enumerate(checks):
        value = tensor.detach().abs().max().item()
        if math.isnan(value) or value > threshold:
            expected.append((name, kind, value, call))
    return expected


def as_tuples(found: LocatedOverflow) -> list[tuple[str, str, float, int]]:
    return [(e.name, e.kind, e.abs_max, e.call) for e in found.events]


def assert_matches(found: LocatedOverflow, expected: list[tuple[str, str, float, int]]) -> None:
    got = as_tuples(found)
    assert [(n, k, c) for n, k, _, c in got] == [(n, k, c) for n, k, _, c in expected]
    for (_, _, value, _), (_, _, want, _) in zip(got, expected, strict=True):
        assert value == pytest.approx(want, rel=1e-6) or (math.isnan(value) and math.isnan(want))


def hook_counts(model: torch.nn.Module) -> tuple[int, int]:
    pre = sum(len(m._forward_pre_hooks) for m in model.modules())
    post = sum(len(m._forward_hooks) for m in model.modules())
    return pre, post


def test_the_planted_layer_is_the_first_forward_event_in_call_order():
    model = planted_model(planted_weight=1e4, first_weight=1.0)  # "2" outputs 3.2e5
    x = torch.ones(3, 4)
    with cstorch.amp.locate_overflow(model) as found:
        model(x)
    expected = oracle(model, x, loss_scale=None, threshold=FLOAT16_MAX)
    assert [name for name, *_ in expected] == ["2", "3", "4", ""]
    assert_matches(found, expected)
    assert found.first == "2"
    assert found.calls == 6 and bool(found)
    assert found.threshold == FLOAT16_MAX and found.dtype == "float16"


def test_a_backward_only_overflow_names_the_module_whose_backward_produced_it():
    # Forward stays in range ("2" outputs 3200); its backward multiplies the gradient by 8e4.
    model = planted_model(planted_weight=1e4)
    x = torch.ones(3, 4)
    with cstorch.amp.locate_overflow(model) as found:
        (model(x).sum() * 8.0).backward()
    expected = oracle(model, x, loss_scale=8.0, threshold=FLOAT16_MAX)
    assert [(name, kind) for name, kind, *_ in expected] == [("2", "backward"), ("1", "backward")]
    assert_matches(found, expected)
    assert found.first == "2"
    assert found.calls == 10


def test_a_healthy_model_records_nothing_and_says_so():
    model = planted_model(planted_weight=0.1)
    x = torch.ones(3, 4)
    with cstorch.amp.locate_overflow(model) as found:
        model(x).sum().backward()
    assert oracle(model, x, loss_scale=1.0, threshold=FLOAT16_MAX) == []
    assert found.events == [] and found.first is None and not found
    assert found.calls == 10
    assert str(found) == (
        "no overflow: 0 of 10 module outputs and input gradients checked held inf or NaN or "
        "exceeded 65504 (the float16 maximum)"
    )


def test_the_table_lists_every_event_and_names_the_model_itself():
    model = planted_model(planted_weight=1e4, first_weight=1.0)
    with cstorch.amp.locate_overflow(model) as found:
        model(torch.ones(3, 4))
    lines = str(found).splitlines()
    assert lines[0] == "first overflow: 2 (Linear, forward)"
    assert lines[1].split() == ["call", "kind", "abs", "max", "module"]
    rows = [line.split() for line in lines[2:-1]]
    assert [(r[0], r[1], r[3]) for r in rows] == [
        ("2", "forward", "2"),
        ("3", "forward", "3"),
        ("4", "forward", "4"),
        ("5", "forward", "<model>"),
    ]
    assert float(rows[0][2]) == pytest.approx(320000.0, rel=1e-3)
    assert lines[-1].startswith("4 of 6 module outputs")


def test_no_hook_stays_after_exit_and_a_backward_after_exit_records_nothing():
    model = planted_model(planted_weight=1e4)
    before = hook_counts(model)
    x = torch.ones(3, 4)
    with cstorch.amp.locate_overflow(model) as found:
        assert hook_counts(model) == (before[0] + 6, before[1] + 6)
        loss = model(x).sum() * 8.0
    assert hook_counts(model) == before
    loss.backward()  # the tensor hooks the forward placed are gone too
    assert found.calls == 6 and found.events == []
    reference = planted_model(planted_weight=1e4)
    (reference(x).sum() * 8.0).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_hooks_are_removed_when_the_block_raises():
    model = planted_model(planted_weight=1e4, first_weight=1.0)
    before = hook_counts(model)
    with pytest.raises(RuntimeError, match="the body failed"):
        with cstorch.amp.locate_overflow(model) as found:
            model(torch.ones(3, 4))
            raise RuntimeError("the body failed")
    assert hook_counts(model) == before
    assert found.first == "2"  # what was recorded before the error is still there


def test_under_float16_autocast_the_planted_output_is_inf():
    model = planted_model(planted_weight=1e4, first_weight=1.0)
    x = torch.ones(3, 4)
    with cstorch.amp.locate_overflow(model) as found:
        with cstorch.amp.autocast(torch.float16, device_type="cpu"):
            out = model(x)
    assert out.dtype == torch.float16
    events = found.events
    assert found.first == "2"
    assert events[0].abs_max == math.inf  # 3.2e5 does not fit in float16
    with torch.autocast("cpu", dtype=torch.float16):
        planted = F.linear(
            torch.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias
        )
    assert planted.dtype == torch.float16 and torch.isinf(planted).all()


def test_a_float16_model_with_scaled_gradients():
    model = planted_model(planted_weight=1e4).half()
    x = torch.ones(3, 4, dtype=torch.float16)
    with cstorch.amp.locate_overflow(model) as found:
        (model(x).sum() * 8.0).backward()
    # float16 gradients: "2"'s backward gives 8e4, which is inf in float16, and so is the ReLU
    # gradient before it.
    assert [(e.name, e.kind, e.abs_max) for e in found.events] == [
        ("2", "backward", math.inf),
        ("1", "backward", math.inf),
    ]
    assert model[0].weight.grad is not None and torch.isinf(model[0].weight.grad).any()


def test_in_place_modules_work_and_are_attributed_to_their_own_input():
    model = planted_model(planted_weight=1e4)
    model[1] = torch.nn.ReLU(inplace=True)
    model[3] = torch.nn.ReLU(inplace=True)
    x = torch.ones(3, 4)
    with cstorch.amp.locate_overflow(model) as found:
        (model(x).sum() * 8.0).backward()
    assert_matches(found, oracle(planted_model(1e4), x, loss_scale=8.0, threshold=FLOAT16_MAX))


def test_the_threshold_follows_the_half_dtype_in_force_and_the_arguments():
    model = planted_model(planted_weight=1e4, first_weight=1.0)  # "2" outputs 3.2e5
    x = torch.ones(3, 4)
    cstorch.amp.set_half_dtype("bfloat16")
    with cstorch.amp.locate_overflow(model) as found:
        model(x)
    assert found.dtype == "bfloat16" and found.first is None
    assert found.threshold == float(torch.finfo(torch.bfloat16).max)
    with cstorch.amp.locate_overflow(model, dtype=torch.float16) as found:
        model(x)
    assert found.first == "2" and found.threshold == FLOAT16_MAX
    with cstorch.amp.locate_overflow(model, dtype="cbfloat16") as found:
        model(x)
    assert found.threshold == (2 - 2**-9) * 2**31 and found.first is None
    with cstorch.amp.locate_overflow(model, threshold=3.0) as found:
        model(x)
    assert_matches(found, oracle(model, x, loss_scale=None, threshold=3.0))  # "0" outputs 4
    assert found.first == "0" and found.dtype is None
    with cstorch.amp.locate_overflow(model, threshold=math.inf) as found:
        model(torch.full((3, 4), math.nan))
    assert [e.name for e in found.events] == ["0", "1", "2", "3", "4", ""]
    assert all(math.isnan(e.abs_max) for e in found.events)


@dataclasses.dataclass
class Pair:
    big: torch.Tensor
    small: torch.Tensor


class Containers(torch.nn.Module):
    """Returns its outputs in a tuple, a dict, a dataclass and an integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.as_tuple = torch.nn.Identity()
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        y = self.linear(x)
        return {"pair": Pair(big=y * 1e6, small=y), "indices": torch.argmax(y, dim=-1)}


class TupleOut(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.argmax(dim=-1), x * 1e6


class IntegersOnly(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 1e6).long()


def test_outputs_in_containers_are_read_and_non_float_outputs_ignored():
    model = torch.nn.ModuleDict(
        {"containers": Containers(), "tuple": TupleOut(), "ints": IntegersOnly()}
    )
    with torch.no_grad():
        model["containers"].linear.weight.fill_(1.0)
        model["containers"].linear.bias.zero_()
    x = torch.ones(1, 2)
    with cstorch.amp.locate_overflow(model) as found:
        out = model["containers"](x)
        model["tuple"](x)
        model["ints"](x)
    assert found.calls == 3  # linear, containers, tuple: the integer-only output is not a check
    assert [(e.name, e.module_type, e.call) for e in found.events] == [
        ("containers", "Containers", 1),
        ("tuple", "TupleOut", 2),
    ]
    assert found.events[0].abs_max == out["pair"].big.abs().max().item() == 2e6


def test_a_hugging_face_model_output_and_a_planted_gpt2_layer():
    transformers = pytest.importorskip("transformers")
    model = tiny_gpt2(vocab=64, positions=8)
    block = model.transformer.h[1]
    with torch.no_grad():
        block.mlp.c_fc.weight.mul_(1e6)  # the planted layer
    ids = torch.arange(8).reshape(1, 8)
    with cstorch.amp.locate_overflow(model) as found:
        output = model(ids, labels=ids)
        output.loss.backward()
    assert isinstance(output, transformers.modeling_outputs.ModelOutput)
    assert found.first == "transformer.h.1.mlp.c_fc"
    assert [(e.name, e.module_type, e.kind) for e in found.events] == [
        ("transformer.h.1.mlp.c_fc", "Conv1D", "forward"),
        ("transformer.h.1.mlp.act", "NewGELUActivation", "forward"),
    ]
    assert found.calls > 50  # every module's output, and the gradients of their inputs
    # The oracle: c_fc applied by hand to block 1's input (which block 1 does not change).
    with torch.no_grad():
        hidden = model.transformer(ids, output_hidden_states=True).hidden_states[1]
        attended = block.attn(block.ln_1(hidden))
        hidden = hidden + (attended[0] if isinstance(attended, tuple) else attended)
        fc = block.ln_2(hidden) @ block.mlp.c_fc.weight + block.mlp.c_fc.bias
    assert fc.abs().max().item() > FLOAT16_MAX
    assert found.events[0].abs_max == pytest.approx(fc.abs().max().item(), rel=1e-5)


def test_a_module_called_twice_has_an_event_per_call():
    shared = torch.nn.Linear(2, 2)
    with torch.no_grad():
        shared.weight.fill_(100.0)
        shared.bias.zero_()
    x = torch.ones(1, 2)
    with cstorch.amp.locate_overflow(shared) as found:
        shared(shared(x))  # 200, then 40000: in range
        shared(shared(shared(x)))  # the third application gives 8e6
    assert [(e.name, e.call, e.abs_max) for e in found.events] == [("", 4, 8e6)]


def test_events_are_frozen_records():
    event = OverflowEvent("fc", "Linear", "forward", math.inf, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.name = "other"  # type: ignore[misc]


def test_it_is_exported_from_cstorch_amp():
    assert "locate_overflow" in cstorch.amp.__all__
    assert cstorch.amp.locate_overflow.__module__ == "torch_facade.amp.locate_overflow"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": "float32"}, ValueError, r"dtype must be one of .*got 'float32'"),
        ({"dtype": torch.float32}, ValueError, r"dtype must be one of .*torch\.float32"),
        ({"dtype": 16}, ValueError, r"dtype must be one of .*got 16"),
        ({"threshold": -1.0}, ValueError, r"threshold must be a positive number.*got -1\.0"),
        ({"threshold": 0}, ValueError, r"threshold must be a positive number.*got 0"),
        ({"threshold": math.nan}, ValueError, r"threshold must be a positive number.*nan"),
        ({"threshold": "65504"}, TypeError, r"threshold must be a positive real.*got str"),
        ({"threshold": True}, TypeError, r"threshold must be a positive real.*got bool"),
        ({"dtype": "float16", "threshold": 1.0}, ValueError, r"dtype or threshold, not both"),
    ],
)
def test_bad_arguments_are_refused_before_any_hook(kwargs, error, match):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(error, match=match):
        cstorch.amp.locate_overflow(model, **kwargs)
    assert hook_counts(model) == (0, 0)


@pytest.mark.parametrize("model", [None, "model", torch.ones(2), [torch.nn.Linear(2, 2)]])
def test_a_non_module_model_is_a_type_error_naming_it(model):
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module.*got"):
        cstorch.amp.locate_overflow(model)
