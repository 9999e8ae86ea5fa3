"""What a user pays before training starts: the facade imports no ``torch._dynamo``.

``torch.compiler.disable`` imports ``torch._dynamo`` (1.3-1.9 s here). The facade's boundary
(:mod:`torch_facade.amp._host_side`) makes it only once user code has imported dynamo; these
tests run in fresh interpreters, where nothing else has imported it yet.
"""

from __future__ import annotations

from facade_helpers import run_python

_DYNAMO_MODULES = (
    "sorted(m for m in sys.modules if m == 'torch._dynamo' or m.startswith('torch._dynamo.'))"
)


def test_import_and_the_facades_own_calls_import_no_dynamo():
    """Importing the facade, building a scaler, scaling a loss, the half-dtype calls and the
    cbfloat16 rounding leave ``torch._dynamo`` unimported (``torch.optim``'s optimizers import
    it themselves, in their constructor: that is torch's cost, the same with torch's scaler)."""
    result = run_python(
        "import json, sys\n"
        "import torch_facade as cstorch\n"
        f"after_import = {_DYNAMO_MODULES}\n"
        "import torch\n"
        "scaler = cstorch.amp.GradScaler(loss_scale='dynamic')\n"
        "w = torch.ones(3, requires_grad=True)\n"
        "scaler.scale((w * 2).sum()).backward()\n"
        "cstorch.amp.set_half_dtype('cbfloat16')\n"
        "rounded = cstorch.amp.round_to_cbfloat16(torch.tensor([1 + 2**-10]))\n"
        "print(json.dumps({'after_import': after_import, 'after_calls': "
        f"{_DYNAMO_MODULES}, 'scale': float(scaler.get_scale()), 'grad': w.grad.tolist(), "
        "'rounded': rounded.item()}))"
    )
    assert result["after_import"] == []
    assert result["after_calls"] == []
    assert result["scale"] == 2.0**15 and result["grad"] == [2.0**16] * 3  # the calls ran
    assert result["rounded"] == 1.0  # 1 + 2**-10 is a tie below 1 + 2**-9: to even


def test_compiled_after_an_unimported_dynamo_breaks_at_the_boundary():
    """The facade imported first, dynamo later by ``torch.compile``: the host-side calls still
    end the graph with the facade's reason, run eagerly, and nothing recompiles."""
    result = run_python(
        "import json, sys\n"
        "import torch\n"
        "import torch_facade as cstorch\n"
        "from torch_facade.amp import _host_side\n"
        f"before = {_DYNAMO_MODULES}\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(4, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "scaler = cstorch.amp.GradScaler(loss_scale='dynamic', init_scale=8.0)\n"
        "def step(x, y):\n"
        "    opt.zero_grad()\n"
        "    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()\n"
        "    scaler.step(opt)\n"
        "    scaler.update()\n"
        "    return cstorch.amp.round_to_cbfloat16(x)\n"
        "import torch._dynamo\n"
        "from torch._dynamo.utils import counters\n"
        "compiled = torch.compile(step, backend='aot_eager')\n"
        "gen = torch.Generator().manual_seed(1)\n"
        "for i in range(4):\n"
        "    with torch._dynamo.config.patch(error_on_recompile=i >= 2):\n"
        "        out = compiled(torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen))\n"
        "reasons = list(counters['graph_break'])\n"
        "print(json.dumps({'before': before, 'facade': sum(_host_side.REASON in r for r in "
        "reasons), 'others': [r for r in reasons if _host_side.REASON not in r],"
        " 'skipped': scaler.get_num_skipped_steps().item(), 'scale': float(scaler.get_scale())}))"
    )
    assert result["before"] == []
    # scale, step, update and round_to_cbfloat16, each once (a break is counted per location)
    assert result["facade"] == 4
    # torch's own breaks, as in tests/torch_facade/test_compile.py: nothing else (such as a
    # trace of the facade's wrapper making its torch.compiler.disable'd function)
    assert len(result["others"]) == 2
    assert all("Tensor.backward()" in r or "Optimizer.zero_grad" in r for r in result["others"])
    assert result["skipped"] == 0 and result["scale"] == 8.0
