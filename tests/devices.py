"""Markers for tests that need an accelerator. They are skipped on the CPU-only CI and run by scripts/gpu_check.sh."""

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")
