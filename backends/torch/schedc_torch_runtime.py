"""Run schedc's per-rank programs on torch.distributed with the user's own model.

``schedc compile SPEC --pp P --mb M --granularity stage -o DIR`` writes one verified stream
program per global rank (``DIR/rankG.json``) and a manifest. This module executes them::

    import torch.distributed as dist
    from schedc_torch_runtime import load_program

    dist.init_process_group("gloo")                 # or "nccl"; one process per global rank
    rt = load_program("DIR", make_stage=make_stage, loss_fn=loss_fn,
                      optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    for x, y in batches:
        losses = rt.step(x, y)                      # the micro-batch losses this rank computed

Whatever the schedule: GPipe, 1F1B, interleaved, zero bubble, ZB-V, DualPipeV, DualPipe (each
rank holds two copies of two stages; their gradients are summed with the mirror rank), channels
(each its own communicator and thread), the schedule's collectives and MoE parts (the user's
``attn`` / ``dispatch`` / ``mlp`` / ``combine`` pieces of a stage).

How a rank runs its program (the format is documented in ``backends/program/src/format.rs``):

* the **compute stream** runs in the calling thread: F, B, W, BW kernels on the user's stage
  modules (B and W from separate autograd calls, :mod:`schedc_autograd`), overlapped pairs
  (the user's ``overlapped_forward_backward``, else F then B), buffer allocation and release,
  the optimizer;
* each **comm stream** (one per channel of the schedule) runs in a thread of its own:
  ``isend``/``irecv`` in the program's verified order on the channel's own process group,
  then (channel 0) DualPipe's replica sums and the data-parallel all-reduces;
* streams meet only at the program's events (``threading.Event``), as CUDA streams do.

Faults: a wait that does not complete within ``timeout`` seconds, or a peer whose connection
closes, ends the step with :class:`SchedcRuntimeError` naming the rank, the step, the stream,
the op (``recv act(1,3) from rank 2``) and the peer; the rank then aborts its process groups,
so that every rank waiting on it fails the same way instead of hanging.

Calibration: ``profile=True`` times every kernel and message; :meth:`ProgramRuntime.write_profile`
writes a cost model in schedc's TOML that ``schedc sim --cost FILE`` reads.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import math
import os
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import schedc_autograd as _ag
from schedc_program import (  # noqa: F401 - re-exported
    ALLOC, ALLREDUCE, COLLECTIVE, FORMAT_VERSION, FREE, KERNEL, OFFLOAD, OPT, OVERLAP, RECORD,
    RECV, RELOAD, REPLICA, SEND, WAIT, Kernel, LocalStage, Program, ProgramFormatError, _peer_of, buf_text,
    op_text, read_program,
)

__all__ = [
    "FORMAT_VERSION",
    "SchedcRuntimeError",
    "ProgramFormatError",
    "Program",
    "read_program",
    "load_program",
    "ProgramRuntime",
    "MoEParts",
    "MeshGroups",
    "MESH_DIMS",
    "A2A_MODES",
    "FChunk",
    "BChunk",
    "clip_grad_norm_",
]

#: Each runtime of a process gets the next number (the same on every rank: construction is
#: collective); it names the runtime's keys in the default group's store.
_RUNTIMES = itertools.count()


class SchedcRuntimeError(RuntimeError):
    """A step that failed: where (rank, step, stream, op), with whom (``peer``), and why."""

    def __init__(self, message: str, *, rank: int, step: int, stream: str = "",
                 index: int = -1, op: str = "", peer: int | None = None, origin: bool = True):
        super().__init__(message)
        self.rank, self.step, self.stream, self.index = rank, step, stream, index
        # origin: False when this rank failed because a peer did (its connection closed, or
        # it never answered); the message then ends with the first failing rank's error.
        self.op, self.peer, self.origin = op, peer, origin


# ------------------------------------------------------------------------------------------
# What the user supplies
# ------------------------------------------------------------------------------------------


@dataclass
class MoEParts:
    """The four pieces of an MoE stage, each ``fn(module, *tensors) -> tensor | tuple``:
    ``attn`` gets the stage's input, each next piece the previous one's outputs, and
    ``combine`` returns the stage's output. ``dispatch`` and ``combine`` are the all-to-alls
    of the expert-parallel group (a local permutation with one expert-parallel rank).
    Tensors between pieces are cut from the autograd graph, so each piece's backward (and its
    weight gradient) runs as the schedule orders it."""

    attn: Callable
    dispatch: Callable
    mlp: Callable
    combine: Callable

    @classmethod
    def methods(cls) -> "MoEParts":
        """Pieces that call the stage module's own methods ``attn``, ``dispatch``, ``mlp``
        and ``combine``."""
        return cls(
            lambda m, *a: m.attn(*a),
            lambda m, *a: m.dispatch(*a),
            lambda m, *a: m.mlp(*a),
            lambda m, *a: m.combine(*a),
        )

    def get(self, part: str) -> Callable:
        return getattr(self, part)


@dataclass
class FChunk:
    """The forward half of an overlapped pair, for ``overlapped_forward_backward(f, b)``.

    ``inputs``: the stage's input leaves; ``loss_fn``/``target``: set when the stage is a last
    stage. The callback runs the forward (call :meth:`forward`, or interleave the module's
    pieces itself and set ``outputs`` and, on a last stage, optionally ``loss``)."""

    module: torch.nn.Module
    stage: int
    mb: int
    inputs: tuple
    loss_fn: Callable | None = None
    target: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None
    autocast: Any = None  # the runtime's ``torch.autocast`` context factory (``autocast_dtype``)

    def forward(self):
        """The plain forward (and the loss on a last stage), under the runtime's autocast
        when it has one; returns the outputs."""
        with self.autocast() if self.autocast is not None else contextlib.nullcontext():
            self.outputs = self.module(*self.inputs)
            if self.loss_fn is not None:
                self.loss = self.loss_fn(self.outputs, self.target)
        return self.outputs


@dataclass
class BChunk:
    """The backward half of an overlapped pair (always a fused ``BW``).

    ``outputs`` and ``output_grads``: the stage's outputs and their gradients (``loss``, scaled
    as the step's mean requires, instead on a last stage); ``inputs``: its input leaves. The
    callback must backpropagate so that every input leaf's ``.grad`` and the parameters'
    ``.grad`` are filled (call :meth:`backward`, or ``torch.autograd.backward`` over
    interleaved pieces)."""

    module: torch.nn.Module
    stage: int
    mb: int
    inputs: tuple
    outputs: tuple
    output_grads: tuple
    loss: torch.Tensor | None = None
    params: list = field(default_factory=list)

    def backward(self) -> None:
        """The plain fused backward."""
        if self.loss is not None:
            roots, grads = [self.loss], [None]
        else:
            roots, grads = list(self.outputs), list(self.output_grads)
        torch.autograd.backward(roots, grads, inputs=[*[x for x in self.inputs if x.requires_grad], *self.params])


# ------------------------------------------------------------------------------------------
# Messages
# ------------------------------------------------------------------------------------------

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_HEADER = 64  # int64 words: [count, (dtype, ndim, dims...)...]


def _header(tensors: Sequence[torch.Tensor], device) -> torch.Tensor:
    words = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype}")
        words += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(words) > _HEADER:
        raise ValueError(f"a message of {len(tensors)} tensors is too large a header ({len(words)} > {_HEADER} words)")
    return torch.tensor(words + [0] * (_HEADER - len(words)), dtype=torch.int64, device=device)


def _parse_header(h: torch.Tensor) -> list[tuple[torch.dtype, tuple]]:
    w = h.tolist()
    out, i = [], 1
    for _ in range(w[0]):
        dt, nd = _DTYPES[w[i]], w[i + 1]
        out.append((dt, tuple(w[i + 2: i + 2 + nd])))
        i += 2 + nd
    return out


def _tuple(x) -> tuple:
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)):
        return tuple(x)
    raise TypeError(f"a stage must return a tensor or a tuple of tensors, not {type(x).__name__}")


def _leaves(ts: Sequence[torch.Tensor], grad: bool) -> tuple:
    return tuple(t.detach().requires_grad_(grad and t.is_floating_point()) for t in ts)


class _Abort(Exception):
    """Another stream of this rank failed."""


class _PeerFailed(Exception):
    """Another rank published its failure in the store (its text)."""


@dataclass
class _Seg:
    """One autograd segment of a (stage, micro-batch): the whole stage or one MoE part."""

    part: str | None
    inputs: tuple
    outputs: tuple
    plan: Any = None


class _Stash:
    """Everything a (stage, micro-batch)'s backward needs from its forward."""

    __slots__ = ("segs", "loss", "pending", "saved", "__weakref__")

    def __init__(self):
        self.segs: list[_Seg] = []
        self.loss = None
        self.pending = None  # gradients for the last segment's outputs (between parts)
        self.saved = None  # _Saved: the autograd-saved tensors of a forward that is offloaded


class _Saved:
    """Issue 27: the tensors autograd saved for the backward of a forward that the program
    offloads (caught by ``torch.autograd.graph.saved_tensors_hooks``; the stage's parameters
    are left where they are). ``where`` is ``device`` or ``host``: an OFFLOAD copies the
    tensors to host memory (pinned, on the copy stream, with CUDA) and drops the device
    copies; a RELOAD brings them back; a backward that unpacks them while they are on the
    host fails, naming the forward.

    BPipe's lent stashes use the same object: ``where`` is ``lent`` on the owner from its
    LEND's send to its RETURN's receive (``items`` are ``None`` then, ``shapes`` the
    ``(dtype, shape)`` of what was sent, ``peer`` the holder); on the holder ``items`` are
    the received tensors until it returns them."""

    __slots__ = ("key", "items", "where", "shapes", "peer", "index")

    def __init__(self, key: tuple):
        self.key = key
        self.items: list = []
        self.where = "device"
        self.shapes: list = []
        self.peer = None
        self.index: dict = {}  # id(tensor) -> its index in items: a tensor saved twice moves once


@dataclass
class _Stage:
    info: LocalStage
    module: torch.nn.Module
    params: list  # the parameters that require grad, in named_parameters() order
    names: list
    expert: list  # per parameter: reduced over the expert data-parallel group
    optimizer: Any = None


# ------------------------------------------------------------------------------------------
# The runtime
# ------------------------------------------------------------------------------------------


def _stage_maker(make_stage: Callable, n_model_stages: int, rank: int,
                 groups: "MeshGroups") -> Callable[[int], torch.nn.Module]:
    """``make_stage`` as a function of the model stage, by its signature:
    ``make_stage(s, n, groups)`` when it takes three positional arguments,
    ``make_stage(s, n, groups=groups)`` when it has a parameter named ``groups`` after the
    first two, ``make_stage(s, n)`` when it takes two (or ``*args``), ``make_stage(s)`` when
    it takes one."""
    try:
        params = list(inspect.signature(make_stage).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the documented form
        return lambda s: make_stage(s, n_model_stages)
    pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind in (
        p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if len(required) > 3:
        raise SchedcRuntimeError(
            f"make_stage has {len(required)} required parameters "
            f"({', '.join(p.name for p in required)}); the accepted signatures are "
            "make_stage(model_stage, n_model_stages, groups), "
            "make_stage(model_stage, n_model_stages) and make_stage(model_stage)",
            rank=rank, step=-1)
    if len(pos) >= 3:
        return lambda s: make_stage(s, n_model_stages, groups)
    if any(p.name == "groups" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        return lambda s: make_stage(s, n_model_stages, groups=groups)
    if any(p.kind == p.VAR_POSITIONAL for p in params) or len(pos) >= 2:
        return lambda s: make_stage(s, n_model_stages)
    if len(pos) == 1:
        return make_stage
    raise SchedcRuntimeError(
        "make_stage must take the model stage and the number of model stages: "
        "make_stage(model_stage, n_model_stages[, groups]) -> nn.Module", rank=rank, step=-1)


#: The mesh dimensions whose process groups :class:`MeshGroups` holds.
MESH_DIMS = ("tp", "sp", "ep", "dp")

#: The all-to-all modes of :meth:`MeshGroups.all_to_all` (``run --a2a`` of the CPU backend).
A2A_MODES = ("flat", "hierarchical")


def _new_traffic() -> dict:
    return {"intra_bytes": 0, "inter_bytes": 0, "intra_messages": 0, "inter_messages": 0,
            "dispatch_inter_bytes": 0}


@dataclass
class MeshGroups:
    """The process groups of a rank's mesh dimensions, for the user's stage modules (handed
    to ``make_stage(stage, n, groups)`` and kept as :attr:`ProgramRuntime.groups`).

    ``tp``, ``sp``, ``ep``, ``dp``: the ``torch.distributed`` process group of the ranks that
    differ from this one only in that coordinate (a group of this rank alone when the
    dimension has size 1, so that collectives on it are no-ops rather than world-wide);
    ``ranks[dim]``: their global ranks in coordinate order; ``coords``: this rank's
    coordinates (``pp``, ``tp``, ``dp``, ``ep``, ``sp``). A Megatron-style column/row parallel
    layer all-reduces over ``groups.tp`` and takes its slice with ``groups.rank("tp")`` of
    ``groups.size("tp")``; a DTensor module builds its device mesh from ``groups.ranks``.

    The nodes of the mesh (``--mesh ...,node=K``: every ``K`` consecutive global ranks share
    a node; ``node_size`` is ``K``, or the world when the mesh does not say): ``ep_node``, the
    members of this rank's EP group on its own node (``ranks["ep_node"]``), and ``ep_cross``,
    the members of its EP group on every node that have the same index among their node's
    members as this rank (``ranks["ep_cross"]``, one per node). :meth:`all_to_all` runs the
    EP all-to-all flat or, DeepSeek-V3's way, over these two; ``a2a`` is its default mode
    (the runtime's ``a2a=`` argument) and ``a2a_traffic`` what this rank's all-to-alls sent."""

    coords: dict
    ranks: dict
    tp: Any = None
    sp: Any = None
    ep: Any = None
    dp: Any = None
    ep_node: Any = None
    ep_cross: Any = None
    node_size: int = 0
    a2a: str = "flat"
    a2a_traffic: dict = field(default_factory=_new_traffic)

    def size(self, dim: str) -> int:
        """How many ranks the dimension ``dim`` has (1 for a dimension the mesh lacks)."""
        return len(self.ranks.get(dim, [0]))

    def rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim`` (0 .. size - 1)."""
        return int(self.coords.get(dim, 0))

    def group(self, dim: str):
        """The process group of ``dim`` (``"tp"``, ``"sp"``, ``"ep"``, ``"dp"``, ``"ep_node"``
        or ``"ep_cross"``)."""
        return getattr(self, dim)

    def node_of(self, global_rank: int) -> int:
        """The node of a global rank (``global_rank // node_size``; 0 without nodes)."""
        return global_rank // self.node_size if self.node_size > 0 else 0

    def ep_spans_nodes(self) -> bool:
        """Whether this rank's EP group has members on more than one node (only then does a
        hierarchical all-to-all differ from a flat one)."""
        return len({self.node_of(r) for r in self.ranks.get("ep", [])}) > 1

    def reset_traffic(self) -> dict:
        """Returns :attr:`a2a_traffic` and starts counting from zero."""
        out, self.a2a_traffic = self.a2a_traffic, _new_traffic()
        return out

    def all_to_all(self, x: torch.Tensor, splits: Sequence[int] | torch.Tensor, *,
                   token: torch.Tensor | None = None, phase: str = "dispatch",
                   mode: str | None = None) -> tuple[torch.Tensor, list[int]]:
        """The expert-parallel all-to-all, for the user's ``dispatch`` and ``combine`` pieces:
        differentiable (its backward is the reverse all-to-all), collective over the EP group
        (every member calls it, in the same order).

        Args:
            x: the rows to send, ``(n, ...)``, grouped by destination: the first ``splits[0]``
                rows go to EP member 0 (``ranks["ep"][0]``), the next ``splits[1]`` to member
                1, and so on (a member may be this rank). Any dtype; integer rows (expert ids)
                carry no gradient.
            splits: rows per EP member (``size("ep")`` non-negative integers summing to ``n``).
            token: optional ``(n,)`` integers: rows with the same ``token`` are copies of one
                token (equal values, e.g. ``h[token]`` for a token's top-k experts). The
                hierarchical dispatch sends such rows across nodes once per destination node.
            phase: ``"dispatch"`` (token rows to their experts: across nodes first, then
                scattered inside the destination node) or ``"combine"`` (expert outputs back:
                gathered inside the source node first, then across nodes). The backward of
                each takes the other's path.
            mode: ``"flat"`` (one ``all_to_all_single`` over ``ep``) or ``"hierarchical"``
                (DeepSeek-V3's two levels over ``ep_node`` and ``ep_cross``: a row crosses the
                network only between members with the same index in their nodes, and every
                member sends one message per other node); default :attr:`a2a`. Hierarchical
                on an EP group inside one node is the flat all-to-all.

        Returns:
            ``(y, recv_splits)``: the rows this rank receives, grouped by source member in EP
            order (``recv_splits[j]`` rows from member ``j``, in the order member ``j`` sent
            them). Both modes return the same tensor bit for bit, and their gradients are
            equal bit for bit too: rows are only copied, never summed.

        Raises:
            ValueError: a bad mode, phase, ``splits`` or ``token``.

        Traffic: every call adds what this rank sent to :attr:`a2a_traffic` (``intra_bytes``
        / ``inter_bytes``: rows, and the hierarchical dispatch's int32 row indices, to ranks
        of its own / other nodes; ``*_messages``: sends of a non-empty payload to another
        rank; ``dispatch_inter_bytes``: the forward dispatches' share). The row counts the
        members exchange ahead of the rows (int64, one per peer and level) are not counted."""
        mode = self.a2a if mode is None else mode
        if mode not in A2A_MODES:
            raise ValueError(f"all_to_all mode must be one of {A2A_MODES}, not {mode!r}")
        if phase not in ("dispatch", "combine"):
            raise ValueError(f"all_to_all phase must be 'dispatch' or 'combine', not {phase!r}")
        members = self.ranks.get("ep", [])
        if self.ep is None or not members:
            raise ValueError("all_to_all needs the runtime's EP group (MeshGroups from the runtime)")
        splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(splits) != len(members) or any(s < 0 for s in splits) or sum(splits) != x.shape[0]:
            raise ValueError(
                f"all_to_all splits {splits} must be {len(members)} non-negative row counts (one per "
                f"EP member) summing to the {x.shape[0]} rows of x")
        if token is not None and (token.dim() != 1 or token.shape[0] != x.shape[0]
                                  or token.is_floating_point()):
            raise ValueError(f"all_to_all token must be (n,) integers for the {x.shape[0]} rows, "
                             f"got {tuple(token.shape)} {token.dtype}")
        if mode == "hierarchical" and not self.ep_spans_nodes():
            mode = "flat"
        fwd = "flat" if mode == "flat" else ("inter" if phase == "dispatch" else "intra")
        bwd = "flat" if mode == "flat" else ("intra" if phase == "dispatch" else "inter")
        box: list = []
        y = _AllToAll.apply(x, self, splits, token, fwd, bwd, phase, box)
        return y, box[0]

    # -- the routes ------------------------------------------------------------------------

    def _count(self, to: int, nbytes: int, phase: str) -> None:
        me = self.ranks["ep"][self.rank("ep")]
        if to == me or nbytes == 0:
            return
        t = self.a2a_traffic
        if self.node_of(to) == self.node_of(me):
            t["intra_bytes"] += nbytes
            t["intra_messages"] += 1
        else:
            t["inter_bytes"] += nbytes
            t["inter_messages"] += 1
            if phase == "dispatch":
                t["dispatch_inter_bytes"] += nbytes

    @staticmethod
    def _exchange(counts: list[list[int]], group) -> list[list[int]]:
        """Each peer ``j`` of ``group`` gets ``counts[j]`` (equal lengths); returns what each
        peer sent this rank."""
        n, w = len(counts), len(counts[0]) if counts else 0
        send = torch.tensor([c for row in counts for c in row], dtype=torch.int64)
        recv = torch.empty(n * w, dtype=torch.int64)
        if w:
            dist.all_to_all_single(recv, send, group=group)
        r = recv.tolist()
        return [r[j * w:(j + 1) * w] for j in range(n)]

    @staticmethod
    def _a2a(rows: list[torch.Tensor], recv_rows: list[int], like: torch.Tensor, group) -> list[torch.Tensor]:
        """``all_to_all_single`` of row blocks: ``rows[j]`` to peer ``j``; returns the blocks
        received (``recv_rows[j]`` rows from peer ``j``)."""
        tail = tuple(like.shape[1:])
        send = torch.cat(rows) if rows else like.new_empty((0, *tail))
        recv = like.new_empty((sum(recv_rows), *tail))
        # Every member calls it, with or without rows: a collective.
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=recv_rows,
                               input_split_sizes=[r.shape[0] for r in rows], group=group)
        return list(recv.split(recv_rows))

    def _route(self, x: torch.Tensor, splits: list[int], token, how: str, phase: str):
        members = self.ranks["ep"]
        blocks = list(x.split(splits))
        row_bytes = x.element_size() * math.prod(x.shape[1:])
        if how == "flat":
            got = self._exchange([[s] for s in splits], self.ep)
            recv_splits = [g[0] for g in got]
            for to, s in zip(members, splits):
                self._count(to, s * row_bytes, phase)
            out = self._a2a(blocks, recv_splits, x, self.ep)
            return torch.cat(out) if out else x[:0], recv_splits
        local, cross = self.ranks["ep_node"], self.ranks["ep_cross"]
        nodes = [self.node_of(c) for c in cross]  # node order = position in ep_cross
        me = members[self.rank("ep")]
        li = local.index(me)
        node_members = {n: [m for m in members if self.node_of(m) == n] for n in nodes}
        pos = {m: i for i, m in enumerate(members)}
        if how == "inter":
            # 1. Across nodes, to the peer with my index there: the rows for that node's
            # members, each distinct token once, and per member its rows' indices.
            tok = token if token is not None else torch.arange(x.shape[0])
            bundles, idx_lists, heads = [], [], []
            for n, peer in zip(nodes, cross):
                if peer == me:
                    bundles.append(x[:0]), idx_lists.append(torch.zeros(0, dtype=torch.int32))
                    heads.append([0] * (1 + len(local)))
                    continue
                dests = [pos[m] for m in node_members[n]]
                rows_of = [torch.arange(sum(splits[:d]), sum(splits[:d + 1])) for d in dests]
                allrows = torch.cat(rows_of)
                uniq, inv = torch.unique(tok[allrows], return_inverse=True)
                first = torch.full((uniq.shape[0],), allrows.shape[0], dtype=torch.int64)
                first.scatter_reduce_(0, inv, torch.arange(allrows.shape[0]), reduce="amin")
                bundles.append(x[allrows[first]])
                idx_lists.append(inv.to(torch.int32))
                heads.append([int(uniq.shape[0])] + [r.shape[0] for r in rows_of])
                self._count(peer, int(uniq.shape[0]) * row_bytes + 4 * int(inv.shape[0]), phase)
            got = self._exchange(heads, self.ep_cross)
            idx_in = self._a2a([i.unsqueeze(1) for i in idx_lists], [sum(g[1:]) for g in got],
                               torch.zeros((0, 1), dtype=torch.int32), self.ep_cross)
            rows_in = self._a2a(bundles, [g[0] for g in got], x, self.ep_cross)
            # 2. Inside the node: to each member, per source relayed here (one per node, in
            # node order; this rank's own rows for its node), that source's rows for it.
            per_member: list[list[torch.Tensor]] = [[] for _ in local]
            for k, (n, src) in enumerate(zip(nodes, cross)):
                if src == me:
                    for j, m in enumerate(local):
                        per_member[j].append(blocks[pos[m]])
                    continue
                idx, at = idx_in[k].squeeze(1).to(torch.int64), 0
                for j, c in enumerate(got[k][1:]):
                    per_member[j].append(rows_in[k][idx[at:at + c]])
                    at += c
            heads2 = [[b.shape[0] for b in pm] for pm in per_member]
            for m, pm in zip(local, per_member):
                self._count(m, sum(b.shape[0] for b in pm) * row_bytes, phase)
            got2 = self._exchange(heads2, self.ep_node)
            data = self._a2a([torch.cat(pm) for pm in per_member], [sum(g) for g in got2], x, self.ep_node)
            # From relay j (index j in my node): the sources of index j, one per node.
            by_src = {}
            for j, relay in enumerate(local):
                parts = data[j].split(got2[j])
                for k, n in enumerate(nodes):
                    by_src[node_members[n][j]] = parts[k]
        else:  # "intra": inside the source's node first, then across nodes
            # 1. To the member of my node with index j: my rows for the members of index j on
            # every node (in node order).
            per_member = [[blocks[pos[node_members[n][j]]] for n in nodes] for j in range(len(local))]
            heads = [[b.shape[0] for b in pm] for pm in per_member]
            for m, pm in zip(local, per_member):
                self._count(m, sum(b.shape[0] for b in pm) * row_bytes, phase)
            got = self._exchange(heads, self.ep_node)
            data = self._a2a([torch.cat(pm) for pm in per_member], [sum(g) for g in got], x, self.ep_node)
            # 2. Across nodes, to my peer there (index li): what my node's members sent for it.
            gathered = [data[j].split(got[j]) for j in range(len(local))]  # [source j][node k]
            out_rows, heads2 = [], []
            for k, (n, peer) in enumerate(zip(nodes, cross)):
                if peer == me:
                    out_rows.append(x[:0]), heads2.append([0] * len(local))
                    continue
                blk = [gathered[j][k] for j in range(len(local))]
                out_rows.append(torch.cat(blk))
                heads2.append([b.shape[0] for b in blk])
                self._count(peer, out_rows[-1].shape[0] * row_bytes, phase)
            got2 = self._exchange(heads2, self.ep_cross)
            inc = self._a2a(out_rows, [sum(g) for g in got2], x, self.ep_cross)
            by_src = {}
            mynode = nodes[cross.index(me)]
            for k, (n, peer) in enumerate(zip(nodes, cross)):
                if peer == me:
                    for j, m in enumerate(local):
                        by_src[m] = gathered[j][k]
                else:
                    for j, part in enumerate(inc[k].split(got2[k])):
                        by_src[node_members[n][j]] = part
            assert mynode == self.node_of(me)
        out = [by_src[m] for m in members]
        return torch.cat(out), [b.shape[0] for b in out]


class _AllToAll(torch.autograd.Function):
    """:meth:`MeshGroups.all_to_all`: forward by one route, backward the reverse all-to-all
    by the other."""

    @staticmethod
    def forward(ctx, x, groups, splits, token, fwd, bwd, phase, box):
        y, recv = groups._route(x, splits, token, fwd, phase)
        box.append(recv)
        ctx.groups, ctx.recv, ctx.bwd, ctx.phase = groups, recv, bwd, phase
        if not x.is_floating_point():
            ctx.mark_non_differentiable(y)
        return y

    @staticmethod
    def backward(ctx, gy):
        gx, _ = ctx.groups._route(gy.contiguous(), ctx.recv, None, ctx.bwd,
                                  "backward")
        return gx, None, None, None, None, None, None, None


def _mesh_groups(program: Program, timeout: timedelta) -> MeshGroups:
    """Every rank's coordinates (gathered: collective over the default group), then one
    process group per line of each dimension of :data:`MESH_DIMS`, created by every rank in
    the same order (``new_group`` is collective over the world)."""
    world = program.world
    coords: list = [None] * world
    dist.all_gather_object(coords, dict(program.coords))
    dims = [d for d, _ in program.manifest["mesh"]["dims"]]
    out = MeshGroups(coords=dict(program.coords), ranks={},
                     node_size=int(program.manifest["mesh"].get("node") or world))
    for dim in MESH_DIMS:
        lines: dict = {}
        for g in range(world):
            key = tuple(coords[g].get(d, 0) for d in dims if d != dim)
            lines.setdefault(key, []).append(g)
        for key in sorted(lines):
            members = sorted(lines[key], key=lambda g: coords[g].get(dim, 0))
            pg = dist.new_group(members, timeout=timeout)
            if program.rank in members:
                setattr(out, dim, pg)
                out.ranks[dim] = members
            if dim == "ep":
                _node_groups(out, program, members, timeout)
    return out


def _node_groups(out: MeshGroups, program: Program, members: list, timeout: timedelta) -> None:
    """The EP line ``members``' groups by node (every rank runs this for every line, in the
    same order): one per node, then one per index in a node (the members with that index on
    every node). A line inside one node creates none: its ``ep_node`` is the EP group."""
    mine = program.rank in members
    nodes: dict = {}
    for m in members:
        nodes.setdefault(out.node_of(m), []).append(m)
    if len(nodes) == 1:
        if mine:
            out.ep_node, out.ranks["ep_node"] = out.ep, list(members)
            out.ep_cross, out.ranks["ep_cross"] = None, [program.rank]
        return
    sizes = {len(v) for v in nodes.values()}
    if len(sizes) != 1:
        raise SchedcRuntimeError(
            f"the EP group {members} has {sorted(len(v) for v in nodes.values())} members on its "
            f"nodes (node={out.node_size}); the hierarchical all-to-all needs as many on each",
            rank=program.rank, step=-1)
    for n in sorted(nodes):
        pg = dist.new_group(nodes[n], timeout=timeout)
        if program.rank in nodes[n]:
            out.ep_node, out.ranks["ep_node"] = pg, list(nodes[n])
    for j in range(sizes.pop()):
        cross = [nodes[n][j] for n in sorted(nodes)]
        pg = dist.new_group(cross, timeout=timeout)
        if program.rank in cross:
            out.ep_cross, out.ranks["ep_cross"] = pg, cross


def load_program(path_or_dir: str | os.PathLike, rank: int | None = None, **kwargs) -> "ProgramRuntime":
    """Reads rank ``rank``'s program (default: this process's rank in the default process
    group) and builds its runtime; ``kwargs`` go to :class:`ProgramRuntime`.

    Collective over the default process group (it creates the programs' process groups):
    every rank calls it. Raises :class:`ProgramFormatError` for programs it cannot run (see
    :func:`read_program`) and :class:`SchedcRuntimeError` for a process group or stages that
    do not fit them."""
    if rank is None:
        if not dist.is_initialized():
            raise SchedcRuntimeError(
                "torch.distributed is not initialized: call dist.init_process_group first",
                rank=-1, step=-1)
        rank = dist.get_rank()
    return ProgramRuntime(read_program(path_or_dir, rank), **kwargs)


class ProgramRuntime:
    """Runs one rank's stage-granularity program, one training step per :meth:`step`.

    Args:
        program: from :func:`read_program`.
        stages: the rank's stage modules by IR stage id (``program.stages``), or
        make_stage: ``make_stage(model_stage, n_model_stages) -> nn.Module`` (or, a callable
            of one positional parameter, ``make_stage(model_stage)``; of three,
            ``make_stage(model_stage, n_model_stages, groups)``, as with a keyword parameter
            ``groups``: the rank's :class:`MeshGroups`, the TP, SP, EP and DP process groups
            for the user's tensor-parallel or sequence-parallel layers), called once per local
            stage; ``n_model_stages`` is the number of model stages the program cuts the model
            into (``program.manifest["model_stages"]``: P, P*V or 2P for a V, by schedule). For
            DualPipe it is called twice per model stage over the mirror pair, once on each of
            the two ranks; the runtime copies the direction-0 copy's parameters into the other.
        loss_fn: ``loss_fn(output, target) -> loss``, on last stages: a 0-dimensional tensor
            (a per-token or per-sample loss, or a tuple, ends the step with an error saying so).
        optimizer: a factory ``optimizer(params) -> torch.optim.Optimizer`` (not an optimizer
            instance): one optimizer per local stage (:attr:`optimizers`), stepped where the
            program has ``optimizer_step``. Without it the gradients stay in ``.grad`` for the
            caller (each step starts from zero gradients: the program's ``alloc weight_grad
            (zeroed)``, unless the previous step was ``step(..., accumulate=True)``).
        moe_parts: :class:`MoEParts`, required when the program splits stages into MoE parts.
        overlapped_forward_backward: ``fn(f: FChunk, b: BChunk)`` for an overlapped pair whose
            backward is fused; without it the pair runs F then B.
        collective: ``fn(comm, label, process_group)`` for the schedule's own collectives
            (default: an all-reduce of one number over the group, which keeps their order).
        is_expert: ``fn(name, param) -> bool``: expert parameters (reduced over the expert
            data-parallel group); default none.
        timeout: seconds any wait may take before the step fails (default 60), from the second
            step on. A peer that dies or fails is noticed at once (its connections close), so
            the timeout only bounds a peer that is stuck.
        first_step_timeout: the same for the first step (default 300: lazy initialisation,
            ``torch.compile`` and cuDNN autotuning happen there). The process groups are
            created with the larger of the two.
        autocast_dtype: run every forward (and the loss) under ``torch.autocast(device type,
            dtype)``, e.g. ``torch.bfloat16``; backward passes run outside it, as torch
            recommends.
        grad_scaler: a ``torch.amp.GradScaler`` (fp16): the losses are seeded with its scale;
            after the reductions the runtime unscales the gradients (before
            ``before_optimizer``), agrees over every rank whether any is infinite or NaN
            (then every rank skips the step) and updates the scale.
        profile: time every kernel and message (see :meth:`write_profile`).
        scale_grads: seed each micro-batch's loss with ``1 / (micro-batches x data shards x
            sp)`` so that gradients are those of the mean loss over the global batch (torch's
            ``scale_grads``; under the mesh's ``sp`` each rank's loss is that of its sequence
            shard, and their mean the sequence's); otherwise of the sum.
        static_shapes: message shapes and dtypes are exchanged in the first step only (False:
            every step, for inputs whose shapes vary).
        device: where received tensors go (default: CUDA's current device under NCCL, else CPU).
        a2a: ``"flat"`` or ``"hierarchical"``: the default mode of the user's expert-parallel
            all-to-alls through :meth:`MeshGroups.all_to_all` (``self.groups.a2a``), as
            ``schedc run --a2a``; hierarchical runs in two levels where the EP group spans
            several nodes of the program's mesh (``--mesh ...,node=K``), and is flat elsewhere.
    """

    def __init__(
        self,
        program: Program,
        *,
        stages: Mapping[int, torch.nn.Module] | torch.nn.Module | None = None,
        make_stage: Callable[..., torch.nn.Module] | None = None,
        loss_fn: Callable | None = None,
        optimizer: Callable | None = None,
        moe_parts: MoEParts | None = None,
        overlapped_forward_backward: Callable | None = None,
        collective: Callable | None = None,
        is_expert: Callable | None = None,
        timeout: float = 60.0,
        first_step_timeout: float = 300.0,
        autocast_dtype: torch.dtype | None = None,
        grad_scaler: Any = None,
        profile: bool = False,
        scale_grads: bool = True,
        static_shapes: bool = True,
        sync_replicas: bool = True,
        device: torch.device | str | None = None,
        a2a: str = "flat",
        _faults: dict | None = None,
    ):
        if not dist.is_initialized():
            raise SchedcRuntimeError("torch.distributed is not initialized", rank=program.rank, step=-1)
        self.program = program
        self.rank = program.rank
        if dist.get_world_size() != program.world:
            raise SchedcRuntimeError(
                f"the programs are for {program.world} ranks but the process group has "
                f"{dist.get_world_size()}", rank=self.rank, step=-1)
        if dist.get_rank() != self.rank:
            raise SchedcRuntimeError(
                f"this process is rank {dist.get_rank()} but loaded rank {self.rank}'s program",
                rank=self.rank, step=-1)
        self.loss_fn = loss_fn
        self.moe_parts = moe_parts
        self.overlap_fn = overlapped_forward_backward
        self.collective_fn = collective
        self.timeout = float(timeout)
        self.first_step_timeout = float(first_step_timeout)
        self._t = self.first_step_timeout  # the current step's timeout
        if autocast_dtype is not None and not isinstance(autocast_dtype, torch.dtype):
            raise SchedcRuntimeError(
                f"autocast_dtype must be a torch.dtype (e.g. torch.bfloat16), not the "
                f"{type(autocast_dtype).__name__} {autocast_dtype!r}: pass torch.{autocast_dtype}"
                if isinstance(autocast_dtype, str) else
                f"autocast_dtype must be a torch.dtype (e.g. torch.bfloat16), not a "
                f"{type(autocast_dtype).__name__}", rank=self.rank, step=-1)
        if grad_scaler is not None and not all(
                callable(getattr(grad_scaler, m, None))
                for m in ("scale", "get_scale", "is_enabled", "state_dict", "load_state_dict")):
            raise SchedcRuntimeError(
                f"grad_scaler must be a torch.amp.GradScaler (or None), not a "
                f"{type(grad_scaler).__name__}", rank=self.rank, step=-1)
        self.autocast_dtype = autocast_dtype
        self.grad_scaler = grad_scaler
        self.profile = profile
        self.static_shapes = static_shapes
        self._faults = dict(_faults or {})
        backend = dist.get_backend()
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if backend == "nccl" else torch.device("cpu"))
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        m = program.manifest
        shards = 1
        for dim, n in m["mesh"]["dims"]:
            if dim in ("dp", "ep"):
                shards *= n
        self._data_shards = shards
        # The mesh's sp ranks take the same batch, each computing the loss of its sequence
        # shard, and the program sums the gradients over them (with dp): the mean over sp is
        # the sequence's loss.
        sp = dict(m["mesh"]["dims"]).get("sp", 1)
        self.scale = 1.0 / (program.total_microbatches * shards * sp) if scale_grads else 1.0
        self.n_model_stages: int = m["model_stages"]
        if optimizer is not None and (isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer)):
            raise SchedcRuntimeError(
                f"optimizer= takes a factory that builds one optimizer per local stage, e.g. "
                f"optimizer=lambda params: torch.optim.SGD(params, lr=0.1); got "
                f"{'an optimizer instance' if isinstance(optimizer, torch.optim.Optimizer) else 'a'} "
                f"`{type(optimizer).__name__}`", rank=self.rank, step=-1)
        if a2a not in A2A_MODES:
            raise SchedcRuntimeError(f"a2a must be one of {', '.join(A2A_MODES)}, not {a2a!r}",
                                     rank=self.rank, step=-1)
        td = timedelta(seconds=max(self.timeout, self.first_step_timeout))
        # The mesh's TP, SP, EP and DP groups, for the user's stages (before make_stage).
        self.groups: MeshGroups = _mesh_groups(program, td)
        self.groups.a2a = a2a
        make = (_stage_maker(make_stage, self.n_model_stages, self.rank, self.groups)
                if make_stage is not None else None)

        # Stage modules.
        self.stages: dict[int, _Stage] = {}
        for info in program.stages:
            if isinstance(stages, Mapping):
                if info.stage not in stages:
                    raise SchedcRuntimeError(
                        f"rank {self.rank} holds stages {[s.stage for s in program.stages]} "
                        f"but `stages` has {sorted(stages)}", rank=self.rank, step=-1)
                mod = stages[info.stage]
            elif isinstance(stages, torch.nn.Module) and len(program.stages) == 1:
                mod = stages
            elif make is not None:
                mod = make(info.model_stage)
                if not isinstance(mod, torch.nn.Module):
                    raise SchedcRuntimeError(
                        f"rank {self.rank}: make_stage({info.model_stage}, {self.n_model_stages}) "
                        f"returned {'None' if mod is None else 'a ' + type(mod).__name__}; return an "
                        "nn.Module", rank=self.rank, step=-1)
            else:
                raise SchedcRuntimeError(
                    f"rank {self.rank} holds stages {[s.stage for s in program.stages]}: pass "
                    "`stages={stage: module}` or `make_stage`", rank=self.rank, step=-1)
            named = [(n, p) for n, p in mod.named_parameters() if p.requires_grad]
            st = _Stage(info, mod, [p for _, p in named], [n for n, _ in named],
                        [bool(is_expert and is_expert(n, p)) for n, p in named])
            if optimizer is not None and st.params:
                st.optimizer = optimizer(st.params)
                if not isinstance(st.optimizer, torch.optim.Optimizer):
                    raise SchedcRuntimeError(
                        f"optimizer(params) returned a `{type(st.optimizer).__name__}`, not a "
                        "torch.optim.Optimizer", rank=self.rank, step=-1)
            self.stages[info.stage] = st
        self._check_program()
        # Split backward (B then W, retain_graph=True) cannot run a graph that
        # torch.compile's AOTAutograd compiled with donated buffers (it refuses:
        # "compiled with non-empty donated buffers ... retain_graph=False"). The flag is
        # read when a compiled stage's backward is compiled (its first call), after this.
        if any(k.pass_ in ("B", "W") for _, ops in program.streams for op in ops
               if op[0] in (KERNEL, OVERLAP) for k in op[1:3] if isinstance(k, Kernel)):
            try:
                import torch._functorch.config as _fconfig
                _fconfig.donated_buffer = False
            except (ImportError, AttributeError):  # an older torch without the flag
                pass

        # Process groups: one per channel, one per collective group; every rank creates all
        # of them in the manifest's order (new_group is collective over the world).
        world = list(range(program.world))
        self._chan_pg = {c: dist.new_group(world, timeout=td) for c in m["channels"]}
        self._pgs = {tuple(g): dist.new_group(list(g), timeout=td) for g in m["groups"]}
        # Every rank: clip_grad_norm_ and the GradScaler's agreement.
        self._world_pg = dist.new_group(world, timeout=td)
        self._uid = next(_RUNTIMES)
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - only the errors' cross-rank detail is lost
            self._store = None
        self._stream_pg = []
        for name, _ in program.streams:
            ch = 0 if name in ("compute", "comm", "copy") else int(name.split("@")[1])
            self._stream_pg.append(self._chan_pg[ch])
        if sync_replicas:
            self._sync_replicas()

        # CUDA: each comm stream of the program is a CUDA stream of its own; the compute
        # stream is the caller's current stream at each step.
        self._cuda_streams = ([None] + [torch.cuda.Stream(self.device) for _ in program.streams[1:]]
                              if self._cuda else [])
        # event -> (stream, index of its record, the op before the record)
        self._recorder = {}
        for name, ops in program.streams:
            for i, op in enumerate(ops):
                if op[0] == RECORD:
                    self._recorder[op[1]] = (name, i, ops[i - 1] if i > 0 else op)
        self._step = 0
        self._broken: SchedcRuntimeError | None = None
        self._shapes: dict = {}  # buffer key -> [(dtype, shape)] from the first step
        self._sent_shapes: dict = {}  # the same, of the messages this rank sends
        self._keep_grads = False  # the previous step accumulated: do not zero the gradients
        self.peak_stash = 0
        self.leaked_stashes = 0
        # Issue 27: the forwards whose saved tensors the copy stream moves, the ones that are
        # recomputed (their RNG state is kept, as torch.utils.checkpoint does), the host pool.
        self._offloaded = {(op[1], op[2]) for _, ops in program.streams for op in ops
                           if op[0] == OFFLOAD}
        # BPipe: the forwards whose saved tensors this rank lends to another rank (LEND's send
        # of a stash of a stage it holds); they are caught as an offloaded forward's are.
        self._lent = {(op[1][1], op[1][2]) for _, ops in program.streams for op in ops
                      if op[0] == SEND and op[1][0] == "stash" and op[1][1] in self.stages}
        self._count_lock = threading.Lock()
        # The event each send of a lent stash waits for (recorded by the compute stream: after
        # the forward for a LEND, where the program returns it for a RETURN): once recorded,
        # the send is issued, and the compute stream's next stash allocation waits until the
        # comm stream has posted it (the owner) or posted it and freed the stash (the holder).
        # The copy stream's releases of offloaded stashes count the same way (the verifier
        # counts them where the compute stream issues them): a bounded queue, so that a
        # copy stream lagging behind the compute does not raise the peak.
        self._lend_event: dict = {}
        for name, ops in program.streams:
            cur = None
            for j, op in enumerate(ops):
                if op[0] == WAIT:
                    cur = op[1]
                if cur is None:
                    continue
                if (op[0] == SEND and op[1][0] == "stash" and ops[j - 1][0] == WAIT) or (
                        name == "copy" and op[0] == FREE and op[1][0] == "stash"):
                    self._lend_event.setdefault(cur, []).append(op[1])
        self._recomputed = {(op[1].stage, op[1].mb) for _, ops in program.streams for op in ops
                            if op[0] == KERNEL and op[1].pass_ == "Recompute"}
        self._host: dict = {}
        self._rng: dict = {}
        self._param_ptrs = None
        self.times: dict[tuple, list] = {}  # profile: (pass, stage, part) -> [(step, seconds)]
        self.msg_times: list[tuple] = []  # profile: (step, seconds, bytes) per receive
        self.step_times: list[float] = []

    # -- setup ------------------------------------------------------------------------------

    def _check_program(self) -> None:
        held = set(self.stages)
        for name, ops in self.program.streams:
            for i, op in enumerate(ops):
                ks = [op[1]] if op[0] == KERNEL else [op[1], op[2]] if op[0] == OVERLAP else []
                for k in ks:
                    if k.stage not in held:
                        raise ProgramFormatError(
                            f"{self.program.path}: rank {self.rank} {name} op #{i} `{k}` runs "
                            f"stage {k.stage}, which the rank does not hold")
                    if k.part and self.moe_parts is None:
                        raise SchedcRuntimeError(
                            f"rank {self.rank}'s program splits stage {k.stage} into MoE parts "
                            f"({name} op #{i} `{k}`): pass moe_parts=MoEParts(...)",
                            rank=self.rank, step=-1)
        if self.loss_fn is None and any(s.last for s in self.program.stages):
            raise SchedcRuntimeError(
                f"rank {self.rank} holds a last stage: pass loss_fn", rank=self.rank, step=-1)

    def _sync_replicas(self) -> None:
        """DualPipe: both copies of a model stage start from the direction-0 copy."""
        for st in sorted(self.stages.values(), key=lambda s: (s.info.model_stage, s.info.direction)):
            peer = st.info.replica_peer
            if peer is None:
                continue
            pg = self._pgs[tuple(sorted((self.rank, peer)))]
            src = self.rank if st.info.direction == 0 else peer
            with torch.no_grad():
                for p in st.params:
                    dist.broadcast(p.data, src=src, group=pg)

    def parameters(self) -> list:
        """Every parameter of the rank's stages (both copies for DualPipe: to count each
        parameter once, use :func:`clip_grad_norm_` or :meth:`counted_parameters`)."""
        return [p for st in self.stages.values() for p in st.params]

    def counted_parameters(self) -> list:
        """The parameters whose gradients this rank counts in a global sum over every rank
        (as :func:`clip_grad_norm_` does): after the step's reductions every copy of a
        parameter holds the same gradient, so only one copy counts. DualPipe's direction-1
        copy is left out, and data-parallel replicas other than the first (dense parameters:
        ``dp`` and ``ep`` coordinates 0; expert parameters, which differ along ``ep``: ``dp``
        coordinate 0)."""
        dp0 = self.program.coords.get("dp", 0) == 0
        ep0 = self.program.coords.get("ep", 0) == 0
        out = []
        for st in self.stages.values():
            if st.info.replica_peer is not None and st.info.direction != 0:
                continue
            for p, e in zip(st.params, st.expert):
                if dp0 and (e or ep0):
                    out.append(p)
        return out

    @property
    def local_stages(self) -> list[LocalStage]:
        return list(self.program.stages)

    @property
    def data_shards(self) -> int:
        """How many data-parallel shards the global batch has (the product of the mesh's
        ``dp`` and ``ep`` sizes): each passes its own batch to :meth:`step`."""
        return self._data_shards

    @property
    def data_shard(self) -> int:
        """This rank's data shard, ``0 .. data_shards - 1``: which shard of the global batch
        its :meth:`step` takes (the same on every rank of one pipeline)."""
        return self.program.data_shard

    @property
    def optimizers(self) -> dict[int, torch.optim.Optimizer]:
        """The rank's optimizers by IR stage id (those ``optimizer=`` built; a stage without
        trainable parameters has none): for LR schedulers, e.g.
        ``[StepLR(o, 10) for o in rt.optimizers.values()]``, stepped after each :meth:`step`."""
        return {s: st.optimizer for s, st in self.stages.items() if st.optimizer is not None}

    @property
    def broken(self) -> SchedcRuntimeError | None:
        """The error of the step that failed, after which this runtime refuses to step (its
        process groups are aborted); None while it is usable."""
        return self._broken

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's state: every local stage's module and optimizer state dict by IR stage
        id (both DualPipe copies), and the GradScaler's. Save one per rank (e.g.
        ``torch.save(rt.state_dict(), f"ckpt/rank{rank}.pt")``); LR schedulers have their
        own ``state_dict``. The tensors are the live ones: save or copy them before the next
        step. Gradients being accumulated (``accumulate=True``) are not part of it."""
        return {
            "rank": self.rank,
            "stages": {s: st.module.state_dict() for s, st in self.stages.items()},
            "optimizers": {s: st.optimizer.state_dict() for s, st in self.stages.items()
                           if st.optimizer is not None},
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restores what :meth:`state_dict` returned on the same rank of the same programs
        (module parameters and buffers, optimizer state such as momentum and step counts, the
        GradScaler's scale): the next step is the one the saved run would have taken. Gradients
        pending from ``accumulate=True`` steps are dropped.

        Raises:
            SchedcRuntimeError: a state of other stages (another rank's, or other programs')."""
        got = sorted(state.get("stages", {}))
        if got != sorted(self.stages):
            raise SchedcRuntimeError(
                f"rank {self.rank} holds stages {sorted(self.stages)} but the state has "
                f"{got} (saved on rank {state.get('rank')}; load each rank's own file)",
                rank=self.rank, step=self._step)
        opts = state.get("optimizers", {})
        for s, st in self.stages.items():
            st.module.load_state_dict(state["stages"][s])
            if st.optimizer is not None:
                if s not in opts:
                    raise SchedcRuntimeError(
                        f"rank {self.rank}: the state has no optimizer for stage {s}",
                        rank=self.rank, step=self._step)
                # A copy: torch's load keeps the given tensors (momentum buffers), which the
                # next steps would update in place, changing the caller's state.
                st.optimizer.load_state_dict(copy.deepcopy(opts[s]))
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        # Gradients pending from ``accumulate=True`` steps belong to the state being replaced:
        # the next step starts from zero, as on a fresh runtime loaded with this state.
        self._keep_grads = False

    # -- the step ---------------------------------------------------------------------------

    def step(self, inputs: Any = None, targets: Any = None, *, accumulate: bool = False,
             before_optimizer: Callable | None = None) -> list[torch.Tensor]:
        """One training step on this data shard's batch, split along dimension 0 into
        ``program.total_microbatches`` chunks (the compile's ``--mb``; DualPipe's direction 0
        takes the first half).

        ``inputs`` (a tensor or a tuple of tensors) is needed on ranks holding a first stage,
        ``targets`` on ranks holding a last stage. Returns the losses (detached, unscaled) of
        the micro-batches whose loss this rank computed, in chunk order; :attr:`loss_chunks`
        says which chunks they are.

        Args:
            accumulate: keep this step's gradients for the next step instead of reducing them
                and stepping the optimizers (every rank must pass the same value). After k
                steps with ``accumulate=True`` and one without, the gradients that are reduced,
                passed to ``before_optimizer`` and stepped are the sum of the k + 1 steps'
                gradients (as k + 1 calls of ``loss.backward()`` in plain torch; each step's is
                that of its mean loss with ``scale_grads``); DualPipe's replica sums and the
                data-parallel all-reduces run once, in the last step.
            before_optimizer: ``fn(runtime)``, called on every rank once the step's gradients
                are reduced (DualPipe's copies summed, data-parallel replicas all-reduced,
                GradScaler-unscaled) and before any optimizer step: the place for
                :func:`clip_grad_norm_`. Not called with ``accumulate=True``. The ranks then
                agree (an all-gather over the world group) before any optimizer steps: if the
                hook raised on any rank, no rank steps and the step fails on every rank; ranks
                that passed different ``accumulate`` values fail the same way.

        Raises:
            SchedcRuntimeError: a kernel raised, a loss is not a scalar, a message's shape
                changed under ``static_shapes=True``, a message never came or a peer vanished
                (within the timeout), or a previous step failed (:attr:`broken`). A failed step
                leaves the runtime unusable on every rank (its process groups are aborted so
                that no rank hangs): every later ``step`` raises, naming the first error;
                build a new one with :func:`load_program` (and :meth:`load_state_dict` from a
                checkpoint) to go on.
        """
        if self._broken is not None:
            raise SchedcRuntimeError(
                f"rank {self.rank}: this runtime is unusable since step {self._broken.step} "
                f"failed ({self._broken}); its process groups are aborted: build a new runtime "
                "with load_program (and load_state_dict from a checkpoint) on every rank",
                rank=self.rank, step=self._step)
        self._accumulate = bool(accumulate)
        self._deferred: list[int] | None = (
            [] if (before_optimizer is not None or self._scaling()) else None)
        self._t = self.first_step_timeout if self._step == 0 else self.timeout
        seed = self.scale
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            # scale() creates the scaler's scale tensor on its first call.
            seed = self.scale * float(self.grad_scaler.scale(torch.ones((), device=self.device)))
        self._seed = seed
        n = self.program.total_microbatches
        self._in = self._split(inputs, n, "inputs") if any(s.info.first for s in self.stages.values()) else None
        self._tg = self._split(targets, n, "targets") if any(s.info.last for s in self.stages.values()) else None
        self._bufs: dict = {}
        self._events = [threading.Event() for _ in range(self.program.events)]
        self._losses: dict[int, torch.Tensor] = {}
        self._failure: SchedcRuntimeError | None = None
        self._abort = False
        self._live_stash = 0
        self._headers = (self._step == 0) or not self.static_shapes
        self._leak_refs: list = []
        self._cuda_timings: list = []
        self._cuda_events: list = [None] * self.program.events
        if self._cuda:
            self._cuda_streams[0] = torch.cuda.current_stream(self.device)
        self._pending_sends = {si: [] for si in range(len(self.program.streams))}
        self._lending: set = set()  # lends issued by the compute stream, not posted yet
        self._lend_cv = threading.Condition()
        self._posted = {si: {} for si in range(len(self.program.streams))}
        t0 = time.perf_counter()
        self._mark, self._carry, self._samples_step = t0, 0.0, []
        threads = [
            threading.Thread(target=self._thread_main, args=(si,), daemon=True,
                             name=f"schedc-rank{self.rank}-{self.program.streams[si][0]}")
            for si in range(1, len(self.program.streams))
        ]
        for t in threads:
            t.start()
        self._thread_main(0)
        if self.profile and not self._cuda and self._samples_step:
            # What the compute stream did after its last kernel (the optimizer, releases)
            # is shared by the step's kernels.
            tail = (time.perf_counter() - self._mark + self._carry) / len(self._samples_step)
            for key, t in self._samples_step:
                self.times.setdefault(key, []).append((self._step, t + tail))
        self._join(threads)
        if self._failure is None:
            try:
                self._finish_optimizer(before_optimizer if self._deferred is not None and not self._accumulate else None)
            except BaseException as e:  # noqa: BLE001
                err = e if isinstance(e, SchedcRuntimeError) else SchedcRuntimeError(
                    f"rank {self.rank}, step {self._step}, before the optimizer: "
                    f"{type(e).__name__}: {str(e).strip()}", rank=self.rank, step=self._step)
                err.__cause__ = e
                self._fail(err)
        if self._failure is not None:
            self._broken = self._failure
            self._abort_groups()
            raise self._failure
        self._keep_grads = self._accumulate
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self.step_times.append(time.perf_counter() - t0)
        for key, ev0, ev1 in self._cuda_timings:
            self.times.setdefault(key, []).append((self._step, ev0.elapsed_time(ev1) / 1e3))
        left = [buf_text(k) for k in self._bufs if k[0] != "weight_grad"]
        if left:
            raise SchedcRuntimeError(
                f"rank {self.rank}, step {self._step}: buffers still allocated after the step: "
                f"{', '.join(sorted(left)[:8])}", rank=self.rank, step=self._step)
        self._step += 1
        self.loss_chunks = sorted(self._losses)
        return [self._losses[g] for g in self.loss_chunks]

    def _join(self, threads: list) -> None:
        """Waits for the comm threads. A gloo wait cannot be interrupted (aborting a process
        group closes no connection), so after a failure, this rank's or a peer's (published
        in the store), a thread still blocked in one is left behind: a daemon that ends at
        the process group's timeout; the runtime is unusable by then."""
        deadline = time.monotonic() + self._t + 5.0
        grace = None
        polls = 0
        while any(t.is_alive() for t in threads):
            alive = [t for t in threads if t.is_alive()]
            alive[0].join(0.05)
            now = time.monotonic()
            if self._failure is not None:
                grace = grace or now + 1.0
                if now > grace:
                    return
                continue
            polls += 1
            if polls % 4 == 0:
                first = self._origin_text()
                if first:
                    self._fail(self._peer_failed(first, None))
                    continue
            if now > deadline:
                self._fail(SchedcRuntimeError(
                    f"rank {self.rank}, step {self._step}: the {alive[0].name} thread did not "
                    f"finish within {self._t:.1f} s after the compute stream", rank=self.rank,
                    step=self._step, origin=False))
                return

    def _peer_failed(self, first: str, e: int | None) -> SchedcRuntimeError:
        """This rank's error when another rank's step failed first (``e``: the event the
        compute stream was waiting for)."""
        what = ""
        if e is not None:
            name, i, op = self._recorder[e]
            what = f" while waiting for {name} op #{i - 1} `{op_text(op)}`"
        return SchedcRuntimeError(
            f"rank {self.rank}, step {self._step}: stopped{what}: the step failed first on "
            f"another rank: {first}", rank=self.rank, step=self._step, origin=False)

    def _finish_optimizer(self, hook: Callable | None) -> None:
        """After the streams, when the optimizer steps were deferred (a ``before_optimizer``
        hook or a GradScaler): unscale, the hook, the optimizer steps in program order."""
        deferred = self._deferred is not None and not self._accumulate
        scaler = self.grad_scaler if self._scaling() and deferred else None
        opts = ([self.stages[s].optimizer for s in self._deferred if self.stages[s].optimizer is not None]
                if deferred else [])
        skip = False
        if scaler is not None:
            inv = 1.0 / float(scaler.get_scale())
            bad = torch.zeros(1, dtype=torch.float32, device=self.device)  # NCCL: on the device
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(inv)
                    bad = torch.maximum(bad, (~torch.isfinite(p.grad)).any().float().reshape(1))
            # Every rank skips, or none does: the replicas must stay equal.
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self._world_pg)
            skip = bool(bad.item() > 0)
        hook_err = None
        if hook is not None and not skip:
            try:
                hook(self)
            except BaseException as e:  # noqa: BLE001 - reported after the agreement
                hook_err = SchedcRuntimeError(
                    f"rank {self.rank}, step {self._step}, before the optimizer: "
                    f"{type(e).__name__}: {str(e).strip()}", rank=self.rank, step=self._step)
                hook_err.__cause__ = e
                self._fail(hook_err)  # published before the agreement: the peers name it
        # The commit is collective: every rank learns whether every hook succeeded and that
        # every rank passed the same ``accumulate`` before any optimizer steps.
        self._agree(hook_err is not None)
        if hook_err is not None:
            raise hook_err
        if not skip:
            for o in opts:
                o.step()
        if scaler is not None:
            _scaler_update(scaler, skip)

    def _agree(self, failed: bool) -> None:
        """Gathers every rank's (failed, accumulate) over the world group, within the step's
        timeout. Raises a SchedcRuntimeError on every rank when a rank's hook failed or the
        ranks passed different ``accumulate`` values."""
        mine = torch.tensor([float(failed), float(self._accumulate)], dtype=torch.float32, device=self.device)
        got = [torch.zeros_like(mine) for _ in range(self.program.world)]
        work = dist.all_gather(got, mine, group=self._world_pg, async_op=True)
        deadline = time.monotonic() + self._t
        while not work.is_completed():
            first = "" if failed else self._origin_text()
            if first:
                raise self._peer_failed(first, None)
            if time.monotonic() > deadline:
                raise SchedcRuntimeError(
                    f"rank {self.rank}, step {self._step}: the ranks did not agree on the end of "
                    f"the step within {self._t:.1f} s (a rank skipped a step?)", rank=self.rank,
                    step=self._step, origin=False)
            time.sleep(1e-3)
        work.wait()
        flags = [(bool(g[0].item()), bool(g[1].item())) for g in got]
        if failed:
            return  # this rank raises its own error
        bad = [r for r, (f, _) in enumerate(flags) if f]
        if bad:
            first = self._origin_text() or f"rank {bad[0]} failed before the optimizer"
            raise SchedcRuntimeError(
                f"rank {self.rank}, step {self._step}: no optimizer stepped: the step failed on "
                f"rank(s) {bad} before the optimizer: {first}", rank=self.rank, step=self._step,
                origin=False)
        accs = [a for _, a in flags]
        if len(set(accs)) > 1:
            raise SchedcRuntimeError(
                f"rank {self.rank}, step {self._step}: the ranks passed different accumulate "
                f"values to step(): {', '.join(f'rank {r}: accumulate={a}' for r, a in enumerate(accs))}; "
                "every rank must pass the same", rank=self.rank, step=self._step, origin=False)

    def _scaling(self) -> bool:
        return self.grad_scaler is not None and self.grad_scaler.is_enabled()

    def _split(self, x, n: int, what: str) -> list[tuple]:
        if x is None:
            raise SchedcRuntimeError(
                f"rank {self.rank} holds a {'first' if what == 'inputs' else 'last'} stage: "
                f"step() needs {what}", rank=self.rank, step=self._step)
        if isinstance(x, torch.Tensor):
            ts = (x,)
        elif isinstance(x, tuple) and all(isinstance(t, torch.Tensor) for t in x):
            ts = x
        else:
            got = type(x).__name__ if not isinstance(x, tuple) else \
                "a tuple holding " + ", ".join(sorted({type(t).__name__ for t in x if not isinstance(t, torch.Tensor)}))
            raise SchedcRuntimeError(
                f"rank {self.rank}: step() {what} must be tensors (or tuples of tensors); got "
                f"{got} (convert with torch.as_tensor)", rank=self.rank, step=self._step)
        for t in ts:
            if t.shape[0] < n:
                raise SchedcRuntimeError(
                    f"{what} has {t.shape[0]} rows along dimension 0, fewer than the "
                    f"{n} micro-batches of a step", rank=self.rank, step=self._step)
        chunks = [torch.tensor_split(t, n) for t in ts]
        return [tuple(c[i] for c in chunks) for i in range(n)]

    # -- streams ----------------------------------------------------------------------------

    def _fail(self, err: SchedcRuntimeError) -> None:
        if self._failure is None:
            self._failure = err
            # Tell the peers why (before the groups are aborted, which is how they learn that
            # this rank failed): their errors name this one.
            if self._store is not None and err.origin:
                try:
                    self._store.set(f"schedc/{self._uid}/origin", str(err))
                except Exception:  # noqa: BLE001 - the peers then say less
                    pass
        self._abort = True

    def _origin_text(self) -> str:
        """The first failing rank's error, when a rank published it."""
        if self._store is None:
            return ""
        key = f"schedc/{self._uid}/origin"
        try:
            if self._store.check([key]):
                return self._store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001
            pass
        return ""

    def _abort_groups(self) -> None:
        mesh = [self.groups.group(d) for d in MESH_DIMS]
        for pg in [*self._chan_pg.values(), *self._pgs.values(), self._world_pg, *mesh]:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - best effort: the error is already reported
                pass

    def _thread_main(self, si: int) -> None:
        if self._cuda and si > 0:
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(self._cuda_streams[si]):
                self._run_stream(si)
        else:
            self._run_stream(si)

    def _run_stream(self, si: int) -> None:
        name, ops = self.program.streams[si]
        i = -1
        try:
            for i, op in enumerate(ops):
                if self._abort:
                    raise _Abort
                self._fault_hook(si, i)
                self._exec(si, i, op)
            for op, i2, work, *_ in self._pending_sends[si]:
                i = i2
                self._wait_work(work, si, i2, op)
            self._pending_sends[si] = []
        except _Abort:
            pass
        except _PeerFailed as e:
            self._fail(self._peer_failed(str(e), ops[i][1] if 0 <= i < len(ops) and ops[i][0] == WAIT else None))
        except BaseException as e:  # noqa: BLE001 - every failure becomes the step's error
            op = ops[i] if 0 <= i < len(ops) else None
            self._fail(self._error(e, si, i, op))
            # Unblock this rank's other streams (and, through closed connections, the peers
            # waiting on this rank).
            self._abort_groups()

    def _error(self, e: BaseException, si: int, i: int, op) -> SchedcRuntimeError:
        if isinstance(e, SchedcRuntimeError):
            return e
        name = self.program.streams[si][0]
        text = op_text(op) if op is not None else "?"
        peer = _peer_of(op) if op is not None else None
        msg = str(e).strip()
        low = msg.lower()
        comm = op is not None and op[0] in (SEND, RECV, COLLECTIVE, REPLICA, ALLREDUCE)
        origin = False
        if isinstance(e, TimeoutError) and op is not None and op[0] == WAIT:
            why = msg
        elif comm and ("timed out" in low or "timeout" in low):
            why = (f"no message from rank {peer} within {self._t:.1f} s (the peer is stuck, "
                   "or never sent it)") if peer is not None and op[0] == RECV else (
                   f"not completed within {self._t:.1f} s" + (f" by rank {peer}" if peer is not None else ""))
        elif comm and any(w in low for w in ("closed", "reset", "broken pipe", "connection", "abort")):
            why = (f"rank {peer}'s connection closed (its process died or stopped after an error)"
                   if peer is not None else "a peer's connection closed (its process died or stopped)")
        else:
            why = f"{type(e).__name__}: {msg.splitlines()[0] if msg else ''}"
            origin = True
        if not origin:
            first = self._origin_text()
            if first:
                why += f"; the step failed first on another rank: {first}"
        where = f"rank {self.rank}, step {self._step}, {name} stream op #{i} `{text}`"
        err = SchedcRuntimeError(f"{where}: {why}", rank=self.rank, step=self._step,
                                 stream=name, index=i, op=text, peer=peer, origin=origin)
        err.__cause__ = e
        return err

    def _fault_hook(self, si: int, i: int) -> None:
        f = self._faults
        if f.get("kill") == (self._step, si, i):
            os.kill(os.getpid(), 9)

    def _wait_event(self, e: int) -> None:
        ev = self._events[e]
        # The op that records the event has its own timeout (a receive's names its peer);
        # this one is a backstop, a little later.
        deadline = time.monotonic() + self._t + 5.0
        polls = 0
        while not ev.wait(0.05):
            if self._abort:
                raise _Abort
            polls += 1
            if polls % 4 == 0:  # waiting for 0.2 s: has another rank failed?
                first = self._origin_text()
                if first:
                    raise _PeerFailed(first)
            if time.monotonic() > deadline:
                name, i, op = self._recorder[e]
                raise TimeoutError(
                    f"waited {self._t + 5.0:.1f} s for e{e}, recorded after {name} op "
                    f"#{i - 1} `{op_text(op)}`, which did not complete")

    def _wait_work(self, work, si: int, i: int, op) -> None:
        if self._cuda:
            deadline = time.monotonic() + self._t
            sleep = 1e-5
            while not work.is_completed():
                if self._abort:
                    raise _Abort
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out after {self._t:.1f} s")
                time.sleep(sleep)
                sleep = min(sleep * 2, 1e-3)
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=self._t))

    def _exec(self, si: int, i: int, op: tuple) -> None:
        c = op[0]
        if c == KERNEL:
            self._timed_kernel(op[1])
        elif c == WAIT:
            if si == 0 and self.profile:
                t = time.perf_counter()
                self._carry += t - self._mark
                self._wait_event(op[1])
                self._mark = time.perf_counter()
            else:
                self._wait_event(op[1])
            if self._cuda:
                torch.cuda.current_stream().wait_event(self._cuda_events[op[1]])
        elif c == RECORD:
            lend = self._lend_event.get(op[1])
            if lend is not None:
                with self._lend_cv:
                    self._lending.update(lend)
            if self._cuda:
                ev = torch.cuda.Event()
                ev.record()
                self._cuda_events[op[1]] = ev
            self._events[op[1]].set()
        elif c == ALLOC:
            if si == 0 and op[1][0] == "stash" and self._lending:
                self._wait_lends(op)
            self._alloc(op[1], op[2])
        elif c == FREE:
            self._free(op[1])
        elif c == SEND:
            self._send(si, i, op)
        elif c == RECV:
            self._recv(si, i)
        elif c == OVERLAP:
            self._overlap(op[1], op[2])
        elif c == REPLICA:
            if self._faults.get("skip_replica_sum") or self._accumulate:
                return  # accumulating: the last step of the accumulation sums
            self._reduce(self.stages[op[1]], (self.rank, op[3]), "all", si, i, op)
        elif c == ALLREDUCE:
            if self._accumulate:
                return
            self._reduce(self.stages[op[1]], op[3], op[2], si, i, op)
        elif c == COLLECTIVE:
            self._collective(op, si, i)
        elif c == OFFLOAD:
            self._offload(si, op[1], op[2])
        elif c == RELOAD:
            self._reload(si, op[1], op[2])
        elif c == OPT:
            st = self.stages[op[1]]
            if self._accumulate:
                return
            if self._deferred is not None:
                self._deferred.append(op[1])  # after the streams: see _finish_optimizer
            elif st.optimizer is not None:
                st.optimizer.step()

    # -- buffers ----------------------------------------------------------------------------

    def _alloc(self, key: tuple, zero: bool) -> None:
        kind = key[0]
        if kind == "weight_grad":
            if not self._keep_grads:  # else: accumulating over steps
                for p in self.stages[key[1]].params:
                    p.grad = None
            self._bufs[key] = True
        elif kind == "stash":
            self._bufs[key] = _Stash()
            self._count_stash(1)
        # act / grad: written by the kernel or the receive that produces them.

    def _wait_lends(self, op) -> None:
        """Before the compute stream allocates a stash: the lends it has issued are posted by
        their comm stream, the returns it has issued posted and freed, the offloads it has
        issued run and their stashes released on the copy stream, so that no rank holds
        more than the schedule's stashes while another stream lags (issue 27)."""
        deadline = time.monotonic() + self._t
        with self._lend_cv:
            while self._lending:
                if self._abort:
                    raise _Abort
                if time.monotonic() > deadline:
                    left = ", ".join(
                        f"{'OFFLOAD' if k[1:] in self._offloaded else 'LEND' if k[1] in self.stages else 'RETURN'}"
                        f"({k[1]},{k[2]})" for k in sorted(self._lending))
                    raise TimeoutError(
                        f"waited {self._t:.1f} s for {left} to be sent before allocating "
                        f"{buf_text(op[1])}")
                self._lend_cv.wait(0.05)

    def _count_stash(self, d: int) -> None:
        """One stash more (``d`` = 1) or less (-1) on this device: the streams' threads count
        together (an allocation, a release, a lend leaving, a return arriving)."""
        with self._count_lock:
            self._live_stash += d
            self.peak_stash = max(self.peak_stash, self._live_stash)

    def _free(self, key: tuple) -> None:
        v = self._bufs.pop(key, None)
        if key[0] == "stash":
            self._count_stash(-1)
            if key in self._lending:  # a holder's RETURN sent, or an offload, and its copy gone
                with self._lend_cv:
                    self._lending.discard(key)
                    self._lend_cv.notify_all()
            if v is not None and self._faults.get("keep_stashes"):  # negative control
                self._faults.setdefault("kept", []).append(v.segs[-1].outputs if v.segs else ())
            if v is not None and self._faults.get("check_leaks"):
                outs = [o for seg in v.segs for o in seg.outputs if isinstance(o, torch.Tensor)]
                refs = [weakref.ref(o) for o in outs]
                del v, outs
                if any(r() is not None for r in refs):
                    self.leaked_stashes += 1

    # -- memory ops (issue 27) ---------------------------------------------------------------

    def _offload(self, si: int, s: int, m: int) -> None:
        """OFFLOAD(s,m) on the copy stream: the stash goes to the host pool (the program then
        releases its device buffer), its saved tensors copied to (pinned) host memory."""
        stash: _Stash = self._bufs[("stash", s, m)]
        self._bufs[("stash", s, m)] = None
        sv = stash.saved
        if sv is not None:
            if self._cuda:
                cs = torch.cuda.current_stream()
                moved = []
                for t in sv.items:
                    h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                    h.copy_(t, non_blocking=True)
                    t.record_stream(cs)  # the device block outlives the copy
                    moved.append(h)
                sv.items = moved
            sv.where = "host"
        self._host[(s, m)] = stash

    def _reload(self, si: int, s: int, m: int) -> None:
        """RELOAD(s,m) on the copy stream: the stash comes back from the host pool; the
        compute stream waits for the event recorded after this before the backward."""
        stash = self._host.pop((s, m), None)
        if stash is None:
            raise RuntimeError(f"RELOAD({s},{m}): nothing of F({s},{m}) is on the host")
        sv = stash.saved
        if sv is not None:
            if self._cuda:
                back = []
                for h in sv.items:
                    t = h.to(self.device, non_blocking=True)
                    t.record_stream(self._cuda_streams[0])
                    back.append(t)
                sv.items = back
            sv.where = "device"
        self._bufs[("stash", s, m)] = stash

    def _is_param(self, t: torch.Tensor) -> bool:
        if self._param_ptrs is None:
            self._param_ptrs = {p.untyped_storage().data_ptr()
                                for st in self.stages.values() for p in st.params}
        try:
            return t.untyped_storage().data_ptr() in self._param_ptrs
        except (RuntimeError, NotImplementedError):
            return False

    def _saving(self, stash: _Stash, key: tuple):
        """The forward of an offloaded (stage, micro-batch): its saved tensors go into
        ``stash.saved``, where the copy stream can move them."""
        if key not in self._offloaded and key not in self._lent:
            return contextlib.nullcontext()
        sv = stash.saved = stash.saved or _Saved(key)

        def pack(t):
            if self._is_param(t):
                return ("param", t)
            j = sv.index.get(id(t))
            if j is None or sv.items[j] is not t:
                j = sv.index[id(t)] = len(sv.items)
                sv.items.append(t)
            return ("saved", sv, j)

        def unpack(h):
            if h[0] == "param":
                return h[1]
            if h[1].where != "device":
                s, m = h[1].key
                if h[1].where == "lent":
                    raise RuntimeError(
                        f"the saved tensors of F({s},{m}) are lent to rank {h[1].peer}: its "
                        f"backward runs before their RETURN({s},{m}) has arrived")
                raise RuntimeError(
                    f"the saved tensors of F({s},{m}) are on the host: the program offloaded "
                    f"them and its backward runs without RELOAD({s},{m})")
            return h[1].items[h[2]]

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _recompute(self, st: _Stage, k: Kernel, stash: _Stash) -> None:
        """RECOMPUTE(s,m): the stage's forward again from its kept input, with the RNG state
        of the first run, rebuilding the autograd graph the backward needs; the loss of a last
        stage is recomputed for the backward's root but not reported again."""
        x = self._stage_input(st, k.mb)
        state = self._rng.pop((k.stage, k.mb), None)
        devs = [self.device] if self._cuda else []
        with torch.random.fork_rng(devices=devs, enabled=state is not None):
            if state is not None:
                torch.set_rng_state(state[0])
                if self._cuda and state[1] is not None:
                    torch.cuda.set_rng_state(state[1], self.device)
            with self._autocast(), self._saving(stash, (k.stage, k.mb)):
                out = st.module(*x)
        stash.segs.append(_Seg(None, x, _tuple(out)))
        if st.info.last:
            with self._autocast():
                stash.loss = self.loss_fn(out, self._target(st, k.mb))
            _check_loss(stash.loss)

    # -- kernels ----------------------------------------------------------------------------

    def _timed_kernel(self, k: Kernel) -> None:
        if not self.profile:
            self._kernel(k)
            return
        key = (k.pass_, k.stage, k.part)
        if self._cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            self._kernel(k)
            e1.record()
            self._cuda_timings.append((key, e0, e1))
        else:
            self._kernel(k)
            self._attribute(key)

    def _attribute(self, key: tuple) -> None:
        """CPU profile: the compute stream's time since its last op or wait ends with this op
        (so the runtime's own bookkeeping between kernels is counted; waiting is not)."""
        now = time.perf_counter()
        self._samples_step.append((key, now - self._mark + self._carry))
        self._mark, self._carry = now, 0.0

    def _stage_input(self, st: _Stage, mb: int) -> tuple:
        if st.info.first:
            g = self.program.global_mb(st.info.stage, mb)
            x = self._in[g]
            return _leaves(x, False)
        prev = ("act", st.info.stage - 1, mb)
        return _leaves(self._bufs[prev], True)

    def _target(self, st: _Stage, mb: int):
        t = self._tg[self.program.global_mb(st.info.stage, mb)]
        return t[0] if len(t) == 1 else t

    def _finish_forward(self, st: _Stage, k: Kernel, stash: _Stash, out) -> None:
        """After the forward's last piece: the loss (last stage) or the output activation."""
        if st.info.last:
            with self._autocast():
                loss = self.loss_fn(out, self._target(st, k.mb))
            _check_loss(loss)
            stash.loss = loss
            self._losses[self.program.global_mb(st.info.stage, k.mb)] = loss.detach()
        key = ("act", k.stage, k.mb)
        if key in k.writes:
            self._bufs[key] = tuple(o.detach() for o in stash.segs[-1].outputs)

    def _kernel(self, k: Kernel) -> None:
        st = self.stages[k.stage]
        skey = ("stash", k.stage, k.mb)
        stash: _Stash = self._bufs[skey]
        p = k.pass_
        if p == "F":
            if k.part in (None, "attn"):
                x = self._stage_input(st, k.mb)
            else:
                x = _leaves(stash.segs[-1].outputs, True)
            fn = st.module if k.part is None else (lambda *a: self.moe_parts.get(k.part)(st.module, *a))
            if (k.stage, k.mb) in self._recomputed:
                self._rng[(k.stage, k.mb)] = (
                    torch.get_rng_state(),
                    torch.cuda.get_rng_state(self.device) if self._cuda else None)
            with self._autocast(), self._saving(stash, (k.stage, k.mb)):
                out = fn(*x)
            stash.segs.append(_Seg(k.part, x, _tuple(out)))
            if k.part in (None, "combine"):
                self._finish_forward(st, k, stash, out)
        elif p in ("B", "BW"):
            self._backward(st, k, stash, fused=(p == "BW"))
        elif p == "Recompute":
            self._recompute(st, k, stash)
        elif p == "W":
            # Whole, or split by `--moe=STAGES:list` into ``mlp`` (the weights behind the MLP
            # piece's input backward) then ``attn`` (every weight gradient still owed).
            for seg in stash.segs:
                if seg.plan is not None and (k.part in (None, "attn") or seg.part == k.part):
                    _ag.weight_backward(seg.plan, st.params)
                    seg.plan = None
        else:
            raise ValueError(f"unknown pass {p}")

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _seg_for(self, stash: _Stash, part: str | None) -> _Seg:
        for seg in stash.segs:
            if seg.part == part:
                return seg
        raise KeyError(f"no forward segment {part or 'whole'}")

    def _roots(self, st: _Stage, k: Kernel, stash: _Stash, seg: _Seg):
        """The tensors to differentiate for this backward piece, and their gradients."""
        first_piece = k.part in (None, "combine")
        if first_piece and st.info.last:
            return [stash.loss], [torch.full_like(stash.loss, self._seed)]
        if first_piece:
            got = self._bufs[("grad", k.stage + 1, k.mb)]
            it = iter(got)
            grads = [next(it) if o.is_floating_point() else None for o in seg.outputs]
        else:
            grads = list(stash.pending)
        roots, gs = [], []
        for o, g in zip(seg.outputs, grads):
            if g is not None and o.requires_grad:
                roots.append(o)
                gs.append(g)
        return roots, gs

    def _backward(self, st: _Stage, k: Kernel, stash: _Stash, fused: bool) -> None:
        seg = self._seg_for(stash, k.part)
        roots, grads = self._roots(st, k, stash, seg)
        want = [x for x in seg.inputs if x.requires_grad]
        if not roots:
            got = [None] * len(want)
        elif fused:
            got = _ag.full_backward(roots, grads, want, st.params)
        else:
            got, seg.plan = _ag.input_backward(roots, grads, want, st.params)
        it = iter(got)
        per_input = [next(it) if x.requires_grad else None for x in seg.inputs]
        self._emit_input_grads(st, k, stash, seg, per_input)

    def _emit_input_grads(self, st, k, stash, seg, per_input) -> None:
        last_piece = k.part in (None, "attn")
        if last_piece:
            key = ("grad", k.stage, k.mb)
            if key in k.writes:
                self._bufs[key] = tuple(
                    g if g is not None else torch.zeros_like(x)
                    for x, g in zip(seg.inputs, per_input) if x.is_floating_point())
        else:
            stash.pending = per_input

    def _overlap(self, kf: Kernel, kb: Kernel) -> None:
        """An overlapped pair: the user's callback when the backward is fused, else F, B."""
        if self.overlap_fn is None or kb.pass_ != "BW" or kf.part or kb.part:
            self._timed_kernel(kf)
            self._timed_kernel(kb)
            return
        sf, sb = self.stages[kf.stage], self.stages[kb.stage]
        stf: _Stash = self._bufs[("stash", kf.stage, kf.mb)]
        stb: _Stash = self._bufs[("stash", kb.stage, kb.mb)]
        x = self._stage_input(sf, kf.mb)
        f = FChunk(sf.module, kf.stage, kf.mb, x,
                   autocast=self._autocast if self.autocast_dtype is not None else None)
        if sf.info.last:
            f.loss_fn, f.target = self.loss_fn, self._target(sf, kf.mb)
        seg = self._seg_for(stb, None)
        roots, grads = self._roots(sb, kb, stb, seg)
        b = BChunk(sb.module, kb.stage, kb.mb, seg.inputs, tuple(roots), tuple(grads), params=sb.params)
        if sb.info.last:
            b.loss = stb.loss * self._seed
            b.outputs, b.output_grads = (), ()
        for xx in seg.inputs:
            xx.grad = None
        if self.profile and self._cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            self.overlap_fn(f, b)
            e1.record()
            self._cuda_timings.append((("FB", kb.stage, None), e0, e1))
        else:
            self.overlap_fn(f, b)
        if f.outputs is None:
            raise ValueError("overlapped_forward_backward did not set the forward's outputs "
                             "(call f.forward() or set f.outputs)")
        stf.segs.append(_Seg(None, x, _tuple(f.outputs)))
        if sf.info.last:
            if f.loss is None:
                with self._autocast():
                    f.loss = self.loss_fn(f.outputs, f.target)
            _check_loss(f.loss)
            stf.loss = f.loss
            self._losses[self.program.global_mb(sf.info.stage, kf.mb)] = f.loss.detach()
        key = ("act", kf.stage, kf.mb)
        if key in kf.writes:
            self._bufs[key] = tuple(o.detach() for o in stf.segs[-1].outputs)
        per_input = [xx.grad if xx.requires_grad else None for xx in seg.inputs]
        self._emit_input_grads(sb, kb, stb, seg, per_input)
        if self.profile and not self._cuda:
            self._attribute(("FB", kb.stage, None))

    # -- messages ---------------------------------------------------------------------------

    def _send(self, si: int, i: int, op: tuple) -> None:
        key, peer = op[1], op[2]
        if self._faults.get("drop") == (self._step, key):
            return
        if key[0] == "stash":
            self._send_stash(si, i, op)
            return
        tensors = [t.contiguous() for t in self._bufs[key]]
        pg = self._stream_pg[si]
        if self.static_shapes:
            shapes = [(t.dtype, tuple(t.shape)) for t in tensors]
            if self._headers:
                self._sent_shapes[key] = shapes
            elif self._sent_shapes.get(key) != shapes:
                def txt(sh):
                    return ", ".join(f"{tuple(d)} {str(dt).replace('torch.', '')}" for dt, d in sh or [])
                raise ValueError(
                    f"the shape of {buf_text(key)} changed since the first step: [{txt(shapes)}] "
                    f"instead of [{txt(self._sent_shapes.get(key))}]; with static_shapes=True "
                    "(the default) shapes travel in the first step only: pass "
                    "static_shapes=False to load_program when the inputs' shapes vary between "
                    "steps (a short last batch, padding to the longest sequence)")
        if self._headers:
            h = _header(tensors, self.device)
            self._pending_sends[si].append((op, i, dist.isend(h, peer, group=pg)))
        for t in tensors:
            self._pending_sends[si].append((op, i, dist.isend(t, peer, group=pg)))
        # Retire completed sends (their tensors go with them).
        pend = self._pending_sends[si]
        while pend and pend[0][2].is_completed():
            pend.pop(0)

    def _recv(self, si: int, i: int) -> None:
        """Posts this receive and every receive right after it in the stream (a group is
        posted at once), then waits for this one."""
        posted = self._posted[si]
        ops = self.program.streams[si][1]
        if ops[i][1][0] == "stash":
            self._recv_stash(si, i)
            return
        if i not in posted:
            run = []
            j = i
            # With headers (the first step), one at a time: a second header posted before
            # the first message's data would take that data (messages match in order). A
            # lent stash (its own header, every step) ends the run.
            while j < len(ops) and ops[j][0] in (RECV, ALLOC, RECORD) and (not run or not self._headers):
                if ops[j][0] == RECV and ops[j][1][0] == "stash":
                    break
                if ops[j][0] == RECV:
                    run.append(j)
                j += 1
            pg = self._stream_pg[si]
            for j in run:
                key, peer = ops[j][1], ops[j][2]
                entry = {"t0": time.perf_counter(), "peer": peer, "key": key}
                if self._headers:
                    entry["header"] = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
                    entry["hwork"] = dist.irecv(entry["header"], peer, group=pg)
                else:
                    entry["bufs"], entry["works"] = self._post_data(key, peer, pg)
                posted[j] = entry
        entry = posted.pop(i)
        op = ops[i]
        if "hwork" in entry:
            self._wait_work(entry["hwork"], si, i, op)
            self._shapes[entry["key"]] = _parse_header(entry["header"])
            entry["bufs"], entry["works"] = self._post_data(entry["key"], entry["peer"], self._stream_pg[si])
        for w in entry["works"]:
            self._wait_work(w, si, i, op)
        if self.profile:
            nbytes = sum(b.numel() * b.element_size() for b in entry["bufs"])
            self.msg_times.append((self._step, time.perf_counter() - entry["t0"], nbytes))
        if self._cuda:
            for b in entry["bufs"]:
                b.record_stream(self._cuda_streams[0])  # used on the compute stream
        self._bufs[entry["key"]] = tuple(entry["bufs"])

    # -- lent stashes (BPipe, issue 27) ------------------------------------------------------

    def _send_stash(self, si: int, i: int, op: tuple) -> None:
        """LEND's send on the owner, RETURN's on the holder: the saved tensors of F(s,m).
        A LEND carries a header first (an int64 word count, then per tensor its dtype, rank
        and dimensions, as the activations' headers), every step, since the holder has
        nothing to derive them from; a RETURN carries the tensors only, the owner knowing
        what it lent. The sender drops its references as the sends are posted (the pending
        sends keep the tensors until they complete)."""
        key, peer = op[1], op[2]
        s, m = key[1], key[2]
        stash = self._bufs.get(key)
        sv = stash.saved if isinstance(stash, _Stash) else None
        owner = s in self.stages
        what = f"LEND({s},{m}) to rank {peer}" if owner else f"RETURN({s},{m}) to rank {peer}"
        if sv is None or sv.where != "device":
            why = ("its forward has not run" if sv is None else
                   f"they are {'lent to rank ' + str(sv.peer) if sv.where == 'lent' else 'on the host'}")
            raise RuntimeError(f"{what}: this rank has no saved tensors of F({s},{m}) ({why})")
        pg = self._stream_pg[si]
        tensors = [t.contiguous() for t in sv.items]
        if owner:
            words = [len(tensors)]
            for t in tensors:
                if t.dtype not in _DTYPES:
                    raise TypeError(f"{what}: cannot send a saved tensor of dtype {t.dtype}")
                words += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
            h = torch.tensor(words, dtype=torch.int64, device=self.device)
            n = torch.tensor([len(words)], dtype=torch.int64, device=self.device)
            for t in (n, h):
                self._pending_sends[si].append((op, i, dist.isend(t, peer, group=pg), t))
            sv.shapes = [(t.dtype, tuple(t.shape)) for t in tensors]
        for t in tensors:
            self._pending_sends[si].append((op, i, dist.isend(t, peer, group=pg), t))
        sv.items = [None] * len(tensors) if owner else []
        sv.index = {}
        if owner:
            sv.where, sv.peer = "lent", peer
            self._count_stash(-1)  # the owner's device no longer holds it
            with self._lend_cv:
                self._lending.discard(key)
                self._lend_cv.notify_all()
        pend = self._pending_sends[si]
        while pend and pend[0][2].is_completed():
            pend.pop(0)

    def _recv_stash(self, si: int, i: int) -> None:
        """LEND's receive on the holder (header, then the tensors), RETURN's on the owner
        (the tensors, in the shapes it lent); the compute stream's backward waits for the
        event recorded after it."""
        op = self.program.streams[si][1][i]
        key, peer = op[1], op[2]
        s, m = key[1], key[2]
        pg = self._stream_pg[si]

        def get(t):
            self._wait_work(dist.irecv(t, peer, group=pg), si, i, op)
            return t

        t0 = time.perf_counter()
        if s in self.stages:  # the owner: RETURN
            stash = self._bufs.get(key)
            sv = stash.saved if isinstance(stash, _Stash) else None
            if sv is None or sv.where != "lent" or sv.peer != peer:
                raise RuntimeError(
                    f"RETURN({s},{m}) from rank {peer} without its LEND: this rank has not lent "
                    f"the stash of F({s},{m}) to rank {peer}")
            bufs = [torch.empty(shape, dtype=dt, device=self.device) for dt, shape in sv.shapes]
        else:  # the holder: LEND
            n = get(torch.empty(1, dtype=torch.int64, device=self.device))
            w = get(torch.empty(int(n.item()), dtype=torch.int64, device=self.device)).tolist()
            shapes, j = [], 1
            for _ in range(w[0]):
                nd = w[j + 1]
                shapes.append((_DTYPES[w[j]], tuple(w[j + 2: j + 2 + nd])))
                j += 2 + nd
            stash = self._bufs.get(key)
            if not isinstance(stash, _Stash):
                stash = self._bufs[key] = _Stash()
                self._count_stash(1)
            sv = stash.saved = _Saved(key)
            sv.peer = peer
            bufs = [torch.empty(shape, dtype=dt, device=self.device) for dt, shape in shapes]
        for b in bufs:
            get(b)
        if s in self.stages and self._faults.get("double_returns"):  # negative control
            for b in bufs:
                if b.is_floating_point():
                    b.mul_(2)
        if self._cuda:
            for b in bufs:
                b.record_stream(self._cuda_streams[0])
        if self.profile:
            self.msg_times.append((self._step, time.perf_counter() - t0,
                                   sum(b.numel() * b.element_size() for b in bufs)))
        sv.items = bufs
        sv.where = "device"
        if s in self.stages:
            self._count_stash(1)  # back on the owner's device

    def _post_data(self, key, peer, pg):
        shapes = self._shapes.get(key)
        if shapes is None:
            raise RuntimeError(f"no shape known for {buf_text(key)} (static_shapes needs the first step to carry headers)")
        bufs = [torch.empty(shape, dtype=dt, device=self.device) for dt, shape in shapes]
        return bufs, [dist.irecv(b, peer, group=pg) for b in bufs]

    # -- collectives ------------------------------------------------------------------------

    def _reduce(self, st: _Stage, group, scope: str, si: int, i: int, op) -> None:
        """Sums the stage's gradients over ``group`` (DualPipe's pair, or a data-parallel
        group): ``scope`` all, dense (not expert) or expert parameters."""
        pg = self._pgs[tuple(sorted(group))]
        sel = [p for p, e in zip(st.params, st.expert)
               if scope == "all" or (scope == "expert") == e]
        if not sel:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in sel]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=pg, async_op=True)
        self._wait_work(work, si, i, op)
        off = 0
        for p, g in zip(sel, grads):
            n = g.numel()
            p.grad = flat[off: off + n].view_as(g).clone()
            if self._cuda:
                p.grad.record_stream(self._cuda_streams[0])  # the optimizer runs there
            off += n

    def _collective(self, op, si: int, i: int) -> None:
        pg = self._pgs[tuple(sorted(op[3]))]
        if self.collective_fn is not None:
            self.collective_fn(op[1], op[2], pg)
            return
        work = dist.all_reduce(torch.zeros(1, device=self.device), group=pg, async_op=True)
        self._wait_work(work, si, i, op)

    # -- calibration ------------------------------------------------------------------------

    def write_profile(self, path: str | os.PathLike, *, skip_steps: int = 1) -> str | None:
        """Gathers every rank's timings (collective: call on every rank) and writes, on rank 0,
        a cost model in schedc's TOML (``compiler/src/sim/cost.rs``): ``[compute]`` means and
        ``[compute.stage.N]`` per IR stage (F, B, W, BW, FB), ``[p2p]`` (the time of one
        message of the measured size as ``latency``), ``[moe]`` (dispatch and combine, run on
        the compute stream here: ``overlap = false``). MoE ``attn`` and ``mlp`` pieces add up
        into their op (schedc charges each half of it). Returns the TOML on rank 0, else None.

        The first ``skip_steps`` steps' samples are dropped (warm-up, shape exchange)."""
        mine = self._samples(skip_steps)
        allp: list = [None] * dist.get_world_size()
        dist.all_gather_object(allp, mine)
        if dist.get_rank() != 0:
            return None
        text = profile_toml(allp, self.program.manifest)
        with open(path, "w") as f:
            f.write(text)
        return text

    def _samples(self, skip: int) -> dict:
        comp: dict = {}
        for (pass_, stage, part), ts in self.times.items():
            kept = [t for step, t in ts if step >= skip] or [t for _, t in ts]
            comp.setdefault(str(stage), {})[pass_ if part is None else f"{pass_}.{part}"] = kept
        msgs = [(t, b) for step, t, b in self.msg_times if step >= skip] or [
            (t, b) for _, t, b in self.msg_times]
        return {"compute": comp, "messages": msgs, "steps": self.step_times[skip:] or self.step_times}


def _check_loss(loss) -> None:
    """A loss must be one number: a per-token or per-sample loss would be seeded element by
    element, its gradient the sum's (torch's runtime refuses it too)."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"loss_fn returned a {type(loss).__name__}, not a tensor: return the scalar loss "
            "alone (for a loss that also returns extras: loss_fn=lambda out, y: f(out, y)[0])")
    if loss.dim() != 0:
        raise ValueError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}: the loss must be a "
            "0-dimensional scalar (reduce it, e.g. with .mean(), or reduction='mean'); the "
            "runtime does not sum it for you")


def _scaler_update(scaler, found_inf: bool) -> None:
    """``scaler.update()`` with the verdict every rank agreed on (the runtime unscaled the
    gradients itself, so the scaler has no per-optimizer record): torch's own update rule
    (back off on an infinite gradient, grow after ``growth_interval`` clean steps)."""
    scale, tracker = scaler._check_scale_growth_tracker("update")
    torch._amp_update_scale_(scale, tracker, torch.full((1,), float(found_inf), device=scale.device),
                             scaler.get_growth_factor(), scaler.get_backoff_factor(),
                             scaler.get_growth_interval())


def clip_grad_norm_(rt: "ProgramRuntime", max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole pipelined model: the norm of every
    parameter's gradient, each parameter counted once across pipeline ranks, DualPipe's two
    copies and data-parallel replicas (:meth:`ProgramRuntime.counted_parameters`); then every
    local gradient (both copies) is multiplied by ``min(1, max_norm / (norm + 1e-6))``.

    Collective over every rank of the programs (an all-reduce over the world group): call it
    on every rank, where the gradients are reduced, i.e. in
    ``step(..., before_optimizer=lambda rt: clip_grad_norm_(rt, 1.0))``; called on some ranks
    only, it raises on those after ``rt.timeout`` seconds (that step then fails on every rank).
    Returns the total norm (float64, on every rank).

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is NaN or infinite.
        SchedcRuntimeError: not every rank called it within ``rt.timeout`` seconds."""
    norm_type = float(norm_type)
    grads = [p.grad for p in rt.counted_parameters() if p.grad is not None]
    if math.isinf(norm_type):
        local = torch.stack([g.detach().abs().max().double() for g in grads]).max() if grads else torch.zeros((), dtype=torch.float64)
        op = dist.ReduceOp.MAX
    else:
        local = (torch.stack([g.detach().double().abs().pow(norm_type).sum() for g in grads]).sum()
                 if grads else torch.zeros((), dtype=torch.float64))
        op = dist.ReduceOp.SUM
    buf = local.reshape(1).to(rt.device)
    work = dist.all_reduce(buf, op=op, group=rt._world_pg, async_op=True)
    deadline = time.monotonic() + rt.timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise SchedcRuntimeError(
                f"rank {rt.rank}, step {rt._step}: clip_grad_norm_ is collective: not every rank "
                f"called it within {rt.timeout:.1f} s (the runtime's timeout); call it on every "
                "rank, e.g. in before_optimizer", rank=rt.rank, step=rt._step)
        time.sleep(1e-3)
    work.wait()
    total = buf[0] if math.isinf(norm_type) else buf[0].pow(1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total.item()}")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in rt.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def profile_toml(ranks: Sequence[dict], manifest: dict) -> str:
    """The cost model TOML of gathered samples (see :meth:`ProgramRuntime.write_profile`)."""
    stages: dict[int, dict[str, float]] = {}
    dispatch, combine, fb = [], [], []
    for r in ranks:
        for s, ops in r["compute"].items():
            d = stages.setdefault(int(s), {})
            agg: dict[str, float] = {}
            for name, ts in ops.items():
                if not ts:
                    continue
                if "." in name:
                    pass_, part = name.split(".")
                    if part == "dispatch":
                        dispatch.extend(ts)
                        continue
                    if part == "combine":
                        combine.extend(ts)
                        continue
                    # attn + mlp make the op: each occurrence is one piece of one op.
                    agg[pass_] = agg.get(pass_, 0.0) + _mean(ts)
                else:
                    agg[name] = agg.get(name, 0.0) + _mean(ts)
            d.update(agg)
            if "FB" in d:
                fb.append(d["FB"])
    msgs = [t for r in ranks for t, _ in r["messages"]]
    sizes = [b for r in ranks for _, b in r["messages"]]
    steps = [t for r in ranks for t in r["steps"]]
    lines = [
        "# Cost profile measured by schedc_torch_runtime (ProgramRuntime.write_profile):",
        f"# {manifest['pp']} pipeline ranks, {manifest['stages']} stages, "
        f"{manifest['microbatches']} micro-batches per direction; seconds.",
        f"# Measured step time (median over ranks and steps): {statistics.median(steps) if steps else 0.0:.6f} s",
        "[compute]",
        "measured = true  # times of this program's own stages: schedc sim charges them as they are",
    ]
    for k in ("F", "B", "W", "BW"):
        vals = [d[k] for d in stages.values() if k in d]
        if vals:
            lines.append(f"{k} = {_mean(vals):.9f}")
    for s in sorted(stages):
        d = stages[s]
        lines.append(f"[compute.stage.{s}]")
        for k in ("F", "B", "W", "BW", "FB"):
            if k in d:
                lines.append(f"{k} = {d[k]:.9f}")
    lat = sorted(msgs)[len(msgs) // 5] if msgs else 0.0
    lines += [
        "[p2p]",
        "# The time of one message of the measured size, as latency (the lowest fifth of the",
        "# receives: those whose sender was already done, so the time is the transfer's).",
        f"latency = {lat:.9f}",
        "bandwidth = 0.0",
        f"bytes = {_mean(sizes):.1f}",
    ]
    if dispatch or combine:
        lines += [
            "[moe]",
            f"dispatch = {_mean(dispatch):.9f}",
            f"combine = {_mean(combine):.9f}",
            "overlap = false",
        ]
    return "\n".join(lines) + "\n"
