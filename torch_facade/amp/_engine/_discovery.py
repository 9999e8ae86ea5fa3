"""The parameters a loss reaches: the leaves of its autograd graph.

Used once, in a scaler's first iteration, so that an optimizer the scaler meets only after the
overflow decision (torch's documented multi-optimizer loop: ``unscale_(opt0)``, ``step(opt0)``,
``step(opt1)``) still had its gradients checked.
"""

from __future__ import annotations

import torch


def reached_parameters(loss: torch.Tensor) -> list[torch.Tensor]:
    """The parameters (``torch.nn.Parameter`` leaves) ``loss.backward()`` accumulates into.

    Other leaves that require grad (an input for a gradient penalty) are no optimizer's.
    """
    found: list[torch.Tensor] = []
    seen: set[object] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, torch.nn.Parameter):
            found.append(variable)
        stack.extend(child for child, _ in node.next_functions)
    return found
