"""schedc on PyTorch, as ``pip install`` of a schedc checkout installs it.

One import for both ways of running a schedule that ``schedc check`` verified:

- schedc's runtime (any schedule, your model, ``torch.distributed``): :func:`load_program`
  reads what ``schedc compile --granularity stage -o DIR`` wrote and returns a
  :class:`ProgramRuntime` whose ``step(inputs, targets)`` trains one step;
- torch's own runtime: :func:`load_schedule` loads a schedule CSV from ``schedc convert --to
  torch-csv`` into ``torch.distributed.pipelining``'s ``_PipelineScheduleRuntime``
  (:func:`stages_of_rank`, :func:`stage_to_rank`, :func:`read_schedule`, ...).

Launch one process per rank with ``torchrun`` (``torchrun --nproc-per-node P train.py``).

The submodules are the files of ``backends/torch`` in the checkout (``python/schedc_torch``
links to them): :mod:`schedc_torch.runtime` (``schedc_torch_runtime.py``),
:mod:`schedc_torch.program` (``schedc_program.py``), :mod:`schedc_torch.autograd`
(``schedc_autograd.py``) and :mod:`schedc_torch.torch_csv` (``schedc_torch.py``). The runtime
imports its siblings by their flat names, as in the repository: importing this package
registers ``schedc_program``, ``schedc_autograd`` and ``schedc_torch_runtime`` under those
names (unless modules of those names are already imported, e.g. from ``backends/torch`` on
``sys.path``).
"""

import sys as _sys

from . import program
from . import autograd

_sys.modules.setdefault("schedc_program", program)
_sys.modules.setdefault("schedc_autograd", autograd)

from . import runtime  # noqa: E402 - after the flat names it imports exist

_sys.modules.setdefault("schedc_torch_runtime", runtime)

from . import torch_csv  # noqa: E402
from .runtime import *  # noqa: E402,F401,F403 - load_program, ProgramRuntime, ...
from .torch_csv import *  # noqa: E402,F401,F403 - load_schedule, stages_of_rank, ...

__all__ = list(runtime.__all__) + list(torch_csv.__all__)
