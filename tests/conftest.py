"""Test configuration: the interpreter without a GPU, seeds, markers, hypothesis profiles. The shared checks
(the tolerance rule of docs/design.md, Testing) live in helpers.py."""

import os

import pytest
import torch

# helpers.py holds the shared checks: rewrite its asserts as pytest rewrites a test module's.
pytest.register_assert_rewrite("helpers")

# Without a GPU the Triton kernels run in the interpreter; set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, max_examples=25, deadline=None)
    settings.register_profile("dev", max_examples=25, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
except ImportError:  # pragma: no cover
    pass

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_finish(session):
    # the sm90 compile jobs of the selected tests start now, on a second core (tests/background.py)
    import background

    background.start(session.items)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_slow = pytest.mark.skip(reason="slow; set FP8ATTN_SLOW=1")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and os.environ.get("FP8ATTN_SLOW") != "1":
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
