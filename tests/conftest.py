import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import ref.py and the *_cases.py modules by name


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Run a module with one intra-op thread: simulated ranks are threads on 2 shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
