"""Shared pytest setup: GPU markers are skipped where CUDA (or enough GPUs) is missing."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(skip_multi)
