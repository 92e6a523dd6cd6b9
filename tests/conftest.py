"""Test set-up. TRITON_INTERPRET must be set before any Triton kernel module is imported."""
import os
import sys
from pathlib import Path

import torch

# Shared test helpers (engine_fixtures, family_checks, model_harness, ...) live in tests/;
# test files live in tests/<area>/ like the code they test.
sys.path.insert(0, str(Path(__file__).parent))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One thread: on these small ops OpenMP workers spin, and two threads on a 2-core machine run
# several times slower than one (and far slower still when another process shares the cores).
torch.set_num_threads(1)
