"""The Python side of schedc's per-rank program format (no torch needed).

Reads what ``schedc compile SPEC ... --granularity stage -o DIR`` writes (``manifest.json``
and one ``rankG.json`` per global rank; the format is documented in
``backends/program/src/format.rs``) into compact op tuples, and prints them::

    python3 backends/torch/schedc_program.py DIR 0        # rank 0's streams, one op a line

:mod:`schedc_torch_runtime` executes them.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FORMAT_VERSION",
    "ProgramFormatError",
    "Program",
    "LocalStage",
    "Kernel",
    "read_program",
    "op_text",
    "buf_text",
]

#: The program format version this reader reads (``FORMAT_VERSION`` in
#: ``backends/program/src/format.rs``).
FORMAT_VERSION = 2


class ProgramFormatError(ValueError):
    """A program directory or file this runtime cannot run (the message says why)."""


# ------------------------------------------------------------------------------------------
# Programs
# ------------------------------------------------------------------------------------------

# Op codes of the parsed streams.
ALLOC, FREE, RECORD, WAIT, KERNEL, SEND, RECV, OVERLAP, COLLECTIVE, REPLICA, ALLREDUCE, OPT = range(12)
# Issue 27: the copy stream's offload and reload of a (stage, micro-batch)'s saved tensors.
OFFLOAD, RELOAD = 12, 13


def _buf(d: dict) -> tuple:
    kind = d["buf"]
    if kind == "weight_grad":
        return ("weight_grad", d["stage"], -1)
    return (kind, d["stage"], d["mb"])


def buf_text(key: tuple) -> str:
    """``act(0,3)``, ``weight_grad(2)``: the Rust format's spelling of a buffer."""
    kind, s, m = key
    return f"{kind}({s})" if m < 0 else f"{kind}({s},{m})"


@dataclass(frozen=True)
class Kernel:
    """One stage-granularity kernel: ``pass_`` (F, B, W, BW, or ``Recompute``: the forward
    run again to rebuild the stash before its backward) on (``stage``, ``mb``), the whole
    stage (``part`` None) or one MoE part (``attn``, ``dispatch``, ``mlp``, ``combine``)."""

    pass_: str
    stage: int
    mb: int
    part: str | None
    reads: tuple
    writes: tuple

    def __str__(self) -> str:
        s = f"{self.pass_}({self.stage},{self.mb})"
        return s + (f".{self.part}" if self.part else "")


def _kernel(d: dict, where: str) -> Kernel:
    if d.get("part") != "stage":
        raise ProgramFormatError(
            f"{where}: kernel `{d.get('pass')}({d.get('stage')},{d.get('mb')}).{d.get('part')}` "
            "is a piece of schedc's own model; compile with `--granularity stage` for a "
            "runtime that runs your model"
        )
    part = d.get("moe")
    return Kernel(d["pass"], d["stage"], d["mb"], None if part in (None, "whole") else part,
                  tuple(_buf(b) for b in d["reads"]), tuple(_buf(b) for b in d["writes"]))


def _parse_op(d: dict, where: str) -> tuple:
    op = d["op"]
    if op == "alloc":
        return (ALLOC, _buf(d["buf"]), d["zero"])
    if op == "free":
        return (FREE, _buf(d["buf"]))
    if op == "record":
        return (RECORD, d["event"])
    if op == "wait":
        return (WAIT, d["event"])
    if op == "kernel":
        return (KERNEL, _kernel(d, where))
    if op == "send":
        return (SEND, _buf(d["buf"]), d["peer"])
    if op == "recv":
        return (RECV, _buf(d["buf"]), d["peer"])
    if op == "overlap":
        return (OVERLAP, _kernel(d["fwd"], where), _kernel(d["bwd"], where))
    if op == "collective":
        return (COLLECTIVE, d["comm"], d["label"], tuple(d["group"]))
    if op == "replica_sum":
        return (REPLICA, d["stage"], d["model_stage"], d["peer"])
    if op == "all_reduce":
        return (ALLREDUCE, d["stage"], d["scope"], tuple(d["group"]))
    if op == "optimizer_step":
        return (OPT, d["stage"])
    if op == "offload":
        return (OFFLOAD, d["stage"], d["mb"])
    if op == "reload":
        return (RELOAD, d["stage"], d["mb"])
    raise ProgramFormatError(
        f"{where}: op `{op}` is not run by this runtime (all-to-alls belong to schedc's own "
        "model; compile with `--granularity stage`)"
    )


def op_text(op: tuple) -> str:
    """The op as the Rust format prints it (``send act(0,3) to rank 1``)."""
    c = op[0]
    if c == ALLOC:
        return f"alloc {buf_text(op[1])}" + (" (zeroed)" if op[2] else "")
    if c == FREE:
        return f"free {buf_text(op[1])}"
    if c == RECORD:
        return f"record e{op[1]}"
    if c == WAIT:
        return f"wait e{op[1]}"
    if c == KERNEL:
        return str(op[1])
    if c == SEND:
        return f"send {buf_text(op[1])} to rank {op[2]}"
    if c == RECV:
        return f"recv {buf_text(op[1])} from rank {op[2]}"
    if c == OVERLAP:
        return f"{op[1]} & {op[2]}"
    if c == COLLECTIVE:
        return f"collective {op[1]}:{op[2]} over {list(op[3])}"
    if c == REPLICA:
        return f"replica_sum weight_grad({op[1]}) (model stage {op[2]}) with rank {op[3]}"
    if c == ALLREDUCE:
        return f"all_reduce {op[2]} weight_grad({op[1]}) over {list(op[3])}"
    if c == OPT:
        return f"optimizer_step stage {op[1]}"
    if c == OFFLOAD:
        return f"offload stash({op[1]},{op[2]}) to host"
    if c == RELOAD:
        return f"reload stash({op[1]},{op[2]}) from host"
    return repr(op)


def _peer_of(op: tuple) -> int | None:
    if op[0] in (SEND, RECV):
        return op[2]
    if op[0] == REPLICA:
        return op[3]
    return None


@dataclass
class LocalStage:
    """A stage the rank holds (``stage``: the IR's id; ``model_stage``: which slice of the
    model, the same for DualPipe's two copies; ``replica_peer``: the rank with the other copy)."""

    stage: int
    model_stage: int
    direction: int
    first: bool
    last: bool
    replica_peer: int | None


@dataclass
class Program:
    """One rank's program and the manifest, as read from ``schedc compile`` output."""

    manifest: dict
    rank: int
    stages: list[LocalStage]
    streams: list[tuple[str, list[tuple]]]  # (name, ops); index 0 is compute
    events: int
    coords: dict
    data_shard: int
    path: str

    @property
    def microbatches(self) -> int:
        """Micro-batches per direction: ``--mb`` (``--mb / 2`` for DualPipe's two directions)."""
        return self.manifest["microbatches"]

    @property
    def directions(self) -> int:
        """2 for DualPipe, else 1."""
        return self.manifest["directions"]

    @property
    def total_microbatches(self) -> int:
        """Micro-batches in one step: ``schedc compile --mb``, whatever the schedule (DualPipe
        runs ``--mb / 2`` per direction: ``--mb 8`` gives 8 chunks, 4 per direction);
        ``step`` splits its batch into this many chunks."""
        return self.microbatches * self.directions

    @property
    def world(self) -> int:
        return self.manifest["world"]

    def global_mb(self, stage: int, mb: int) -> int:
        """The chunk of the step's batch that (IR stage, micro-batch) works on."""
        per = self.manifest["model_stages"]
        direction = stage // per if self.directions == 2 else 0
        return direction * self.microbatches + mb


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ProgramFormatError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ProgramFormatError(f"{path}:{e.lineno}:{e.colno}: not JSON: {e.msg}") from None


def _check_messages(rpath: str, rank: int, world: int, streams: list, held: set) -> None:
    """The peers of the messages exist, and BPipe's lent stashes pair up (issue 27): the
    owner (the rank holding the stash's stage) receives back (RETURN) only a stash it sends
    (LEND) to that rank, a holder returns only a stash it received from its owner. ``schedc
    check`` refuses such programs; this catches a program edited or built by hand before
    any rank waits for a message that never comes."""
    sent, got = set(), set()
    for name, ops in streams:
        for op in ops:
            if op[0] == SEND and op[1][0] == "stash":
                sent.add((op[1], op[2]))
            elif op[0] == RECV and op[1][0] == "stash":
                got.add((op[1], op[2]))
    for name, ops in streams:
        for i, op in enumerate(ops):
            if op[0] not in (SEND, RECV):
                continue
            where = f"{rpath}: {name} op #{i} `{op_text(op)}`"
            buf, peer = op[1], op[2]
            if not 0 <= peer < world or peer == rank:
                raise ProgramFormatError(
                    f"{where}: rank {peer} " + ("is this rank" if peer == rank else
                                                f"does not exist (the world is {world})"))
            if buf[0] != "stash":
                continue
            s, mb = buf[1], buf[2]
            if s in held and op[0] == RECV and (buf, peer) not in sent:
                raise ProgramFormatError(
                    f"{where}: RETURN({s},{mb}) without its LEND: this rank never lends the "
                    f"stash of F({s},{mb}) to rank {peer}")
            if s not in held and op[0] == SEND and (buf, peer) not in got:
                raise ProgramFormatError(
                    f"{where}: RETURN({s},{mb}) of a stash this rank never received: no "
                    f"LEND({s},{mb}) from rank {peer}")
            if s not in held and op[0] == RECV and (buf, peer) not in sent:
                raise ProgramFormatError(
                    f"{where}: this rank holds the lent stash of F({s},{mb}) and never "
                    f"returns it to rank {peer}")


def read_program(path_or_dir: str | os.PathLike, rank: int) -> Program:
    """Reads ``manifest.json`` and ``rank{rank}.json`` from a ``schedc compile`` directory (or
    the directory of the given rank file).

    Raises:
        ProgramFormatError: a missing or unreadable file, a format version other than
            :data:`FORMAT_VERSION`, programs at schedc's model granularity, a rank out of range,
            a rank file for another rank, a message to a rank that does not exist, or a lent
            stash (LEND/RETURN) that does not pair up.
    """
    path = os.fspath(path_or_dir)
    d = path if os.path.isdir(path) else os.path.dirname(path) or "."
    mpath = os.path.join(d, "manifest.json")
    m = _read_json(mpath)
    if not isinstance(m, dict) or "format_version" not in m:
        raise ProgramFormatError(f"{mpath}: not a schedc program manifest (no format_version)")
    if m["format_version"] != FORMAT_VERSION:
        raise ProgramFormatError(
            f"{mpath} has format version {m['format_version']}; this runtime reads version "
            f"{FORMAT_VERSION} (recompile with the schedc that matches it)"
        )
    if m.get("granularity") != "stage":
        raise ProgramFormatError(
            f"{mpath}: programs at `{m.get('granularity')}` granularity run schedc's own model "
            "(the CPU backend); compile with `schedc compile ... --granularity stage` for your "
            "model"
        )
    if not 0 <= rank < m["world"]:
        raise ProgramFormatError(f"{mpath}: rank {rank} is out of range; the world is {m['world']}")
    rpath = os.path.join(d, m["files"][rank])
    r = _read_json(rpath)
    if r.get("rank") != rank:
        raise ProgramFormatError(f"{rpath} holds rank {r.get('rank')}, expected {rank}")
    streams = []
    for s in r["streams"]:
        kind = s["kind"]
        name = kind if kind in ("compute", "copy") else (
            "comm" if kind["comm"]["channel"] == 0 else f"comm@{kind['comm']['channel']}")
        ops = [_parse_op(o, f"{rpath}: {name} op #{i}") for i, o in enumerate(s["ops"])]
        streams.append((name, ops))
    stages = [
        LocalStage(s["stage"], s["model_stage"], s["direction"], s["first"], s["last"],
                   s.get("replica_peer"))
        for s in r["stages"]
    ]
    _check_messages(rpath, rank, m["world"], streams, {s.stage for s in stages})
    return Program(m, rank, stages, streams, r["events"], r["coords"], r["data_shard"], d)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: schedc_program.py DIR RANK", file=sys.stderr)
        return 2
    try:
        p = read_program(argv[1], int(argv[2]))
    except (ProgramFormatError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stages = ", ".join(
        f"{s.stage} (model stage {s.model_stage}"
        + (f", direction {s.direction}, copy of rank {s.replica_peer}" if s.replica_peer is not None else "")
        + ")" for s in p.stages)
    print(f"rank {p.rank}: stages {stages}")
    for name, ops in p.streams:
        print(f"{name}:")
        for i, op in enumerate(ops):
            print(f"  {i:3} {op_text(op)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except BrokenPipeError:  # `| head`
        sys.exit(0)
