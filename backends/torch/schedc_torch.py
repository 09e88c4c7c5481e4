"""Run schedc schedules on PyTorch's pipelining runtime.

``schedc convert SPEC --to torch-csv --torch-format compute-comms`` writes a schedule that
``schedc check`` verified as a torch schedule CSV. :func:`load_schedule` turns that file into
a ready-to-step ``torch.distributed.pipelining`` schedule for the stages of one rank::

    from schedc_torch import load_schedule, stages_of_rank

    local = stages_of_rank("1f1b.comms.csv", rank)          # which stages to build here
    stages = [PipelineStage(make_stage(s), s, num_stages, device) for s in local]
    schedule = load_schedule("1f1b.comms.csv", stages, n_microbatches=8, loss_fn=loss_fn)
    schedule.step(inputs, target=targets, losses=losses)

Written against torch 2.15 (``_PipelineScheduleRuntime`` and its ``_load_csv``, private APIs
that torch may rename). See README.md in this directory for the whole example.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "SchedcTorchError",
    "read_schedule",
    "detect_format",
    "microbatches_of",
    "stage_to_rank",
    "stages_of_rank",
    "load_schedule",
    "activation_peaks",
]

FORMATS = ("compute_comms", "compute_only")

# Torch's action syntax: <stage><TYPE>[<micro-batch>], or (<action>;<action>)OVERLAP_F_B.
_ACTION = re.compile(
    r"(\d+)(WAIT_REDUCE_GRAD|WAIT_SEND_F|WAIT_SEND_B|REDUCE_GRAD|UNSHARD|RESHARD|"
    r"SEND_F|RECV_F|SEND_B|RECV_B|F|I|B|W)(\d*)"
)
_COMPUTE = {"F", "I", "B", "W"}


class SchedcTorchError(ValueError):
    """A schedule CSV that cannot run with the given stages (the message says why)."""


def _cell_actions(cell: str, where: str) -> list[tuple[int, str, int | None]]:
    """The simple actions of one cell as (stage, type, micro-batch); [] for an empty cell."""
    cell = cell.strip()
    if not cell:
        return []
    if cell.startswith("("):
        inner, close, suffix = cell[1:].partition(")")
        if not close or suffix != "OVERLAP_F_B":
            raise SchedcTorchError(
                f"{where}: `{cell}` is not an action; a compound is "
                "`(<forward>;<backward>)OVERLAP_F_B`"
            )
        out = []
        for piece in inner.split(";"):
            out.extend(_cell_actions(piece, where))
        return out
    m = _ACTION.fullmatch(cell)
    if m is None:
        raise SchedcTorchError(
            f"{where}: `{cell}` is not an action such as `3F12` (stage, type, micro-batch)"
        )
    mb = int(m.group(3)) if m.group(3) else None
    return [(int(m.group(1)), m.group(2), mb)]


def read_schedule(csv_path: str | os.PathLike) -> list[list[str]]:
    """The rows of a torch schedule CSV (row ``r`` is pipeline rank ``r``), cells as text.

    Raises :class:`SchedcTorchError` if the file has no rows or a cell is not an action.
    """
    with open(csv_path, newline="") as f:
        rows = [row for row in csv.reader(f)]
    if not rows:
        raise SchedcTorchError(f"{csv_path}: no rows; expected one row of actions per rank")
    for r, row in enumerate(rows):
        for i, cell in enumerate(row):
            _cell_actions(cell, f"{csv_path}: rank {r}, cell {i + 1}")
    return rows


def detect_format(csv_path: str | os.PathLike) -> str:
    """Which of torch's forms the CSV is in: ``"compute_comms"`` if any cell holds a
    communication or bookkeeping action (``SEND_*``, ``RECV_*``, ``WAIT_*``, ``REDUCE_GRAD``,
    ``UNSHARD``, ``RESHARD``), else ``"compute_only"`` (what ``schedc convert --to
    torch-csv`` writes by default).
    """
    rows = read_schedule(csv_path)
    for r, row in enumerate(rows):
        for i, cell in enumerate(row):
            for _, ty, _ in _cell_actions(cell, f"{csv_path}: rank {r}, cell {i + 1}"):
                if ty not in _COMPUTE:
                    return "compute_comms"
    return "compute_only"


def microbatches_of(csv_path: str | os.PathLike) -> int:
    """M, the number of micro-batches the CSV runs: its largest micro-batch id plus one.

    Raises :class:`SchedcTorchError` if no action names a micro-batch, or if a stage's
    forwards do not cover micro-batches 0..M-1 (the CSV was cut or edited).
    """
    rows = read_schedule(csv_path)
    forwards: dict[int, set[int]] = {}
    top = -1
    for r, row in enumerate(rows):
        for i, cell in enumerate(row):
            for stage, ty, mb in _cell_actions(cell, f"{csv_path}: rank {r}, cell {i + 1}"):
                if mb is None or ty not in _COMPUTE:
                    continue
                top = max(top, mb)
                if ty == "F":
                    forwards.setdefault(stage, set()).add(mb)
    if top < 0:
        raise SchedcTorchError(f"{csv_path}: no compute action names a micro-batch")
    m = top + 1
    for stage, mbs in sorted(forwards.items()):
        if len(mbs) != m:
            missing = min(set(range(m)) - mbs)
            raise SchedcTorchError(
                f"{csv_path}: stage {stage} has no forward of micro-batch {missing}, but the "
                f"CSV runs micro-batches 0..{m - 1}"
            )
    return m


def stage_to_rank(csv_path: str | os.PathLike) -> list[int]:
    """The rank of each stage (index = stage id), as the CSV places them.

    A stage is held by the row its compute actions are on. Raises
    :class:`SchedcTorchError` if a stage is on two rows or a stage id below the largest never
    appears.
    """
    rows = read_schedule(csv_path)
    where: dict[int, int] = {}
    for r, row in enumerate(rows):
        for i, cell in enumerate(row):
            for stage, ty, _ in _cell_actions(cell, f"{csv_path}: rank {r}, cell {i + 1}"):
                if ty not in _COMPUTE:
                    continue
                if where.setdefault(stage, r) != r:
                    raise SchedcTorchError(
                        f"{csv_path}: stage {stage} has compute actions on rank {where[stage]} "
                        f"and on rank {r}; torch places each stage on one rank"
                    )
    if not where:
        raise SchedcTorchError(f"{csv_path}: no compute action (F, I, B, W) in any row")
    missing = [s for s in range(max(where) + 1) if s not in where]
    if missing:
        raise SchedcTorchError(
            f"{csv_path}: stage {missing[0]} never appears, but stage {max(where)} does; "
            "stages are numbered from 0 without gaps"
        )
    return [where[s] for s in range(len(where))]


def stages_of_rank(csv_path: str | os.PathLike, rank: int) -> list[int]:
    """The stage ids rank ``rank`` must build (in increasing order) to run this CSV."""
    placement = stage_to_rank(csv_path)
    pp = len(read_schedule(csv_path))
    if not 0 <= rank < pp:
        raise SchedcTorchError(f"{csv_path}: rank {rank} is out of range; the CSV has {pp} rows")
    return [s for s, r in enumerate(placement) if r == rank]


def load_schedule(
    csv_path: str | os.PathLike,
    stages: Sequence[Any],
    n_microbatches: int,
    loss_fn: Callable | None = None,
    *,
    format: str | None = None,
    scale_grads: bool = True,
    **schedule_kwargs: Any,
):
    """Builds torch's ``_PipelineScheduleRuntime`` for this rank's ``stages`` and loads the CSV.

    Args:
        csv_path: A schedule CSV, from ``schedc convert ... --to torch-csv`` (or dumped by
            torch).
        stages: This rank's ``PipelineStage`` objects, one per stage the CSV puts on the rank
            (see :func:`stages_of_rank`), each built with the CSV's number of stages and the
            pipeline process group.
        n_microbatches: M; the CSV must run micro-batches 0..M-1 of every stage.
        loss_fn: ``loss_fn(output, target)``, applied on the last stage; required to train.
        format: ``None`` (the default: the form the file is in, see
            :func:`detect_format`), ``"compute_comms"`` (run the CSV as written, with the
            send/receive order ``schedc check`` verified) or ``"compute_only"`` (compute
            actions only; torch inserts its own sends, receives and bookkeeping). A form the
            file is not in is an error: torch would otherwise fail inside its runtime
            (``Computing action=3F0 before receiving input``).
        scale_grads: Divide gradients by M at the end of the step (torch's default), so that
            they match one backward of the mean loss over the whole batch.
        **schedule_kwargs: Passed to ``_PipelineScheduleRuntime`` (e.g. ``args_chunk_spec``).

    Returns:
        The schedule; call ``schedule.step(*inputs, target=..., losses=[])`` on every rank.

    Raises:
        SchedcTorchError: an unknown ``format`` or one the file is not in, no stages, an
            unreadable CSV, ``n_microbatches`` other than the M the CSV runs, a CSV whose row
            count is not the pipeline group size, or whose row for this rank holds other
            stages than ``stages``.
    """
    if format is not None and format not in FORMATS:
        raise SchedcTorchError(f"format must be one of {FORMATS} or None, not {format!r}")
    if not stages:
        raise SchedcTorchError("no stages: pass this rank's PipelineStage objects")
    if n_microbatches < 1:
        raise SchedcTorchError(f"n_microbatches must be at least 1, not {n_microbatches}")
    rows = read_schedule(csv_path)
    found = detect_format(csv_path)
    if format is None:
        format = found
    elif format == "compute_comms" and found == "compute_only":
        raise SchedcTorchError(
            f"{csv_path} is in torch's compute_only form (compute actions only, what "
            "`schedc convert --to torch-csv` writes by default), but format='compute_comms' "
            "was asked for: leave format unset (or pass format='compute_only') so that torch "
            "inserts the communication, or export the file with `--torch-format "
            "compute-comms` to run schedc's verified send/receive order"
        )
    placement = stage_to_rank(csv_path)
    first = stages[0]
    pp, rank, num_stages = first.group_size, first.group_rank, first.num_stages
    if len(rows) != pp:
        raise SchedcTorchError(
            f"{csv_path} has {len(rows)} rows (ranks) but the pipeline group has {pp} ranks"
        )
    if len(placement) != num_stages:
        raise SchedcTorchError(
            f"{csv_path} has {len(placement)} stages but the stages were built with "
            f"num_stages={num_stages}"
        )
    want = sorted(s for s, r in enumerate(placement) if r == rank)
    have = sorted(st.stage_index for st in stages)
    if want != have:
        raise SchedcTorchError(
            f"{csv_path} puts stages {want} on rank {rank}, but this rank built stages {have}; "
            "build the stages stages_of_rank(csv_path, rank) returns"
        )
    m = microbatches_of(csv_path)
    if m != n_microbatches:
        raise SchedcTorchError(
            f"{csv_path} runs micro-batches 0..{m - 1} (M = {m}), but n_microbatches = "
            f"{n_microbatches}: pass the M the file was exported for (`schedc convert --mb`)"
        )
    if format == "compute_only":
        for r, row in enumerate(rows):
            for i, cell in enumerate(row):
                for stage, ty, _ in _cell_actions(cell, ""):
                    if ty not in _COMPUTE:
                        raise SchedcTorchError(
                            f"{csv_path}: rank {r}, cell {i + 1}: `{cell.strip()}` is not a "
                            "compute action; load this file with format='compute_comms'"
                        )

    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    schedule = _PipelineScheduleRuntime(
        list(stages),
        n_microbatches,
        loss_fn=loss_fn,
        scale_grads=scale_grads,
        **schedule_kwargs,
    )
    schedule._load_csv(os.fspath(csv_path), format=format)
    return schedule


def activation_peaks(schedule, pp: int | None = None) -> list[int]:
    """Peak live (stage, micro-batch) activations of every rank, by torch's own
    ``analyze_pipeline_activation_liveness(granularity="stage_microbatch")`` on the loaded
    schedule: what ``schedc check --format json`` reports as ``ranks[r].peak_activations``.
    """
    from torch.distributed.pipelining import analyze_pipeline_activation_liveness

    order = schedule.pipeline_order_with_comms
    ranks = range(pp if pp is not None else len(order))
    placement = schedule.stage_index_to_group_rank
    peaks = []
    for r in ranks:
        local = sorted(s for s, rr in placement.items() if rr == r)
        live = analyze_pipeline_activation_liveness(
            schedule, pp_rank=r, stage_indices=local, granularity="stage_microbatch"
        )
        peaks.append(live.num_slots)
    return peaks
