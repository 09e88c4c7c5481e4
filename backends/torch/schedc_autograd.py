"""Input gradients and weight gradients of a stage from separate autograd calls.

A zero-bubble schedule runs a stage's backward in two ops: ``B`` (the gradient of the stage's
input, which the previous stage waits for) and, later, ``W`` (the gradient of its weights,
which nobody waits for). :func:`input_backward` runs the first and returns a :class:`WeightPlan`
that :func:`weight_backward` runs later, without redoing the input gradient's work.

How (the approach of ``torch.distributed.pipelining``'s ``stage_backward_input`` /
``stage_backward_weight``, written here from its description):

* ``I``, the *input path*: the autograd nodes from which an input leaf is reachable. ``B``
  runs exactly these (``torch.autograd.grad(roots, inputs, retain_graph=True)``); a node on
  the input path that also feeds a weight (a ``Linear``'s ``AddmmBackward``, a norm's
  backward) computes only its input-side outputs then.
* A *start* of a parameter: a node of ``I`` with an edge into the part of the graph that
  leads to the parameter without touching ``I`` (or a root that is not on ``I`` at all, such as
  the output of a first stage, whose input needs no gradient). During ``B`` a pre-hook on every
  start records the gradient arriving at it: its full gradient, since the engine runs a node
  once all its inputs have arrived.
* ``W`` restarts the engine from the starts with the recorded gradients
  (``torch.autograd.grad([GradientEdge(start, k), ...], params, recorded)``), one call per
  group of parameters that share starts. When a group has several starts and one lies below
  another on the input path, the engine would carry the upper one's gradient down to the
  lower one and count it twice: a pre-hook on every start of such a group replaces whatever
  arrives with the recorded gradient.

The result equals one fused backward up to floating-point summation order (tested against
``torch.autograd.grad`` in ``test_runtime.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["WeightPlan", "input_backward", "weight_backward", "full_backward"]


@dataclass
class _Group:
    """Parameters (indices into the stage's parameter list) and where ``W`` restarts."""

    params: list[int]
    edges: list[GradientEdge]
    grads: list[torch.Tensor]
    clamp: dict = field(default_factory=dict)  # node -> recorded grad_outputs


@dataclass
class WeightPlan:
    """What :func:`weight_backward` needs: per group of parameters, the start edges and the
    gradients :func:`input_backward` recorded there. Holds the autograd graph alive."""

    groups: list[_Group]

    def empty(self) -> bool:
        return not any(g.edges for g in self.groups)


def _node(t: torch.Tensor):
    return get_gradient_edge(t).node


def input_backward(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightPlan]:
    """The gradients of ``inputs`` (``None`` where unused) and the plan for the weights.

    Args:
        roots: tensors to differentiate (the stage's outputs, or its loss), each requiring grad.
        grads: their gradients (``None`` for a scalar root: 1).
        inputs: leaf tensors requiring grad whose gradients are wanted (may be empty).
        params: the stage's parameters that require grad.
    """
    grads = [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads)]
    root_edges = [get_gradient_edge(r) for r in roots]
    root_nodes = list(dict.fromkeys(e.node for e in root_edges))
    in_nodes = {_node(x) for x in inputs}
    p_nodes = {_node(p): i for i, p in enumerate(params)}

    # The graph reachable from the roots, with its reverse edges.
    parents: dict = defaultdict(list)
    seen = set(root_nodes)
    stack = list(root_nodes)
    while stack:
        n = stack.pop()
        for c, _ in n.next_functions:
            if c is None:
                continue
            parents[c].append(n)
            if c not in seen:
                seen.add(c)
                stack.append(c)
    # The input path.
    on_input = {n for n in in_nodes if n in seen}
    stack = list(on_input)
    while stack:
        n = stack.pop()
        for p in parents[n]:
            if p not in on_input:
                on_input.add(p)
                stack.append(p)
    # Starts of every parameter: walk up from it until the input path (or a root).
    rootset = set(root_nodes)
    starts_of: dict[int, set] = {}
    uf: dict = {}

    def find(x):
        while uf[x] is not x:
            uf[x] = uf[uf[x]]
            x = uf[x]
        return x

    for pn, i in p_nodes.items():
        if pn not in seen:
            continue
        starts: set = set()
        closure = {pn}
        stack = [pn]
        while stack:
            n = stack.pop()
            if n in rootset:
                starts.add(n)
            for p in parents[n]:
                if p in on_input:
                    starts.add(p)
                elif p not in closure:
                    closure.add(p)
                    stack.append(p)
        if starts:
            starts_of[i] = starts
            for s in starts:
                uf.setdefault(s, s)
    for starts in starts_of.values():
        first, *rest = starts
        for s in rest:
            a, b = find(first), find(s)
            if a is not b:
                uf[a] = b
    members: dict = defaultdict(lambda: (set(), []))
    for i, starts in starts_of.items():
        g = members[find(next(iter(starts)))]
        g[0].update(starts)
        g[1].append(i)

    recorded: dict = {}
    handles = [
        n.register_prehook(lambda go, n=n: recorded.__setitem__(n, go))
        for n in uf
        if n in on_input
    ]
    try:
        if inputs:
            got = torch.autograd.grad(
                list(roots), list(inputs), grads, retain_graph=True, allow_unused=True
            )
        else:
            got = ()
    finally:
        for h in handles:
            h.remove()

    root_grads: dict = defaultdict(list)
    for e, g in zip(root_edges, grads):
        root_grads[e.node].append((e.output_nr, g))
    groups = []
    for starts, pis in members.values():
        grp = _Group(params=sorted(pis), edges=[], grads=[])
        for n in starts:
            if n in on_input:
                go = recorded.get(n)
                if go is None:
                    continue  # not reached by the gradient: contributes nothing
                if len(starts) > 1:
                    grp.clamp[n] = go
                for k, g in enumerate(go):
                    if g is not None:
                        grp.edges.append(GradientEdge(n, k))
                        grp.grads.append(g)
            else:
                for k, g in root_grads.get(n, ()):
                    grp.edges.append(GradientEdge(n, k))
                    grp.grads.append(g)
        groups.append(grp)
    return tuple(got), WeightPlan(groups)


def weight_backward(plan: WeightPlan, params: Sequence[torch.Tensor]) -> None:
    """Runs the weight half planned by :func:`input_backward`, adding into ``p.grad``."""
    for grp in plan.groups:
        if not grp.edges:
            continue
        handles = [n.register_prehook(lambda go, saved=saved: saved) for n, saved in grp.clamp.items()]
        try:
            res = torch.autograd.grad(
                grp.edges, [params[i] for i in grp.params], grp.grads, allow_unused=True
            )
        finally:
            for h in handles:
                h.remove()
        for i, g in zip(grp.params, res):
            accumulate(params[i], g)
    plan.groups = []


def full_backward(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, ...]:
    """One fused backward: returns the gradients of ``inputs``, adds into ``p.grad``."""
    grads = [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads)]
    res = torch.autograd.grad(
        list(roots), [*inputs, *params], grads, allow_unused=True
    )
    for p, g in zip(params, res[len(inputs):]):
        accumulate(p, g)
    return tuple(res[: len(inputs)])


def accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """``p.grad += g`` (a copy the first time: ``g`` may alias a tensor still in use)."""
    if g is None:
        return
    if p.grad is None:
        p.grad = g.detach().clone()
    else:
        p.grad.add_(g)
