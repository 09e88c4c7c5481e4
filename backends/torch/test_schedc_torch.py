#!/usr/bin/env python3
"""Unit tests of schedc_torch's checks that need no torch (plain python3).

    python3 backends/torch/test_schedc_torch.py

``load_schedule`` checks the file before it imports torch: the form it is in
(``detect_format``), the number of micro-batches (``microbatches_of``), and that an explicit
form matches; these run with stub stages. ``tests/tests/torch_py.rs`` runs this file from
``cargo test`` when python3 is there; ``run_e2e.sh`` runs it with torch too.
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True

import schedc_torch  # noqa: E402
from schedc_torch import SchedcTorchError  # noqa: E402

# 1F1B, P = 2, M = 2, in both of torch's forms (as `schedc convert --to torch-csv` writes).
COMPUTE_ONLY = "0F0,0F1,0B0,0B1\n,1F0,1B0,1F1,1B1\n"
COMPUTE_COMMS = (
    "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
    "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n"
)


def stage(index: int, rank: int) -> types.SimpleNamespace:
    """What load_schedule reads of a PipelineStage."""
    return types.SimpleNamespace(stage_index=index, group_rank=rank, group_size=2, num_stages=2)


class Checks(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.TemporaryDirectory()
        self.only = os.path.join(self.dir.name, "only.csv")
        self.comms = os.path.join(self.dir.name, "comms.csv")
        with open(self.only, "w") as f:
            f.write(COMPUTE_ONLY)
        with open(self.comms, "w") as f:
            f.write(COMPUTE_COMMS)

    def tearDown(self) -> None:
        self.dir.cleanup()

    def test_detects_the_form(self) -> None:
        self.assertEqual(schedc_torch.detect_format(self.only), "compute_only")
        self.assertEqual(schedc_torch.detect_format(self.comms), "compute_comms")

    def test_counts_the_microbatches(self) -> None:
        self.assertEqual(schedc_torch.microbatches_of(self.only), 2)
        self.assertEqual(schedc_torch.microbatches_of(self.comms), 2)
        cut = os.path.join(self.dir.name, "cut.csv")
        with open(cut, "w") as f:
            f.write("0F0,0F2\n1F0,1F1,1F2\n")
        with self.assertRaisesRegex(SchedcTorchError, "stage 0 has no forward of micro-batch 1"):
            schedc_torch.microbatches_of(cut)

    def test_wrong_microbatch_count_is_refused_before_torch(self) -> None:
        with self.assertRaisesRegex(SchedcTorchError, r"runs micro-batches 0\.\.1 \(M = 2\)"):
            schedc_torch.load_schedule(self.only, [stage(0, 0)], 4)

    def test_compute_only_file_loaded_as_compute_comms_says_how_to_fix(self) -> None:
        # The issue: convert's default (compute-only) loaded with format="compute_comms" failed
        # inside torch with "Computing action=3F0 before receiving input".
        with self.assertRaisesRegex(SchedcTorchError, "compute_only form") as e:
            schedc_torch.load_schedule(self.only, [stage(0, 0)], 2, format="compute_comms")
        self.assertIn("--torch-format compute-comms", str(e.exception))
        with self.assertRaisesRegex(SchedcTorchError, "not a compute action"):
            schedc_torch.load_schedule(self.comms, [stage(0, 0)], 2, format="compute_only")
        with self.assertRaisesRegex(SchedcTorchError, "format must be one of"):
            schedc_torch.load_schedule(self.only, [stage(0, 0)], 2, format="comms")

    def test_stages_must_match_the_row(self) -> None:
        with self.assertRaisesRegex(SchedcTorchError, r"puts stages \[0\] on rank 0"):
            schedc_torch.load_schedule(self.only, [stage(1, 0)], 2)

    def test_a_matching_load_gets_past_the_checks(self) -> None:
        # With the checks passed, load_schedule imports torch: without torch that import is
        # the only failure; with torch, the stub stages fail inside torch's runtime.
        try:
            import torch  # noqa: F401
        except ImportError:
            for path in (self.only, self.comms):
                with self.assertRaises(ImportError):
                    schedc_torch.load_schedule(path, [stage(0, 0)], 2)
        else:
            self.skipTest("torch is installed: test_e2e.py loads real stages")


if __name__ == "__main__":
    unittest.main()
