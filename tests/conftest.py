"""Test configuration: seeds, markers, the tolerance rule (docs/design.md, Testing), hypothesis profiles."""
import os

import pytest
import torch

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


def assert_close_fa3(out, ref, ref_lowprec, floor=1e-3, name="out"):
    """FA3's rule: max|out - ref| <= 2 * max|ref_lowprec - ref| + floor, plus a bias check on the mean error.

    ``ref`` is the fp32/fp64 reference from the dequantized inputs; ``ref_lowprec`` is the reference
    run with the same low-precision steps as the kernel (P in e4m3).
    """
    o, r, rl = out.double(), ref.double(), ref_lowprec.double()
    assert not torch.isnan(o).any(), f"{name}: NaN in output"
    err = (o - r).abs().max().item()
    bound = 2 * (rl - r).abs().max().item() + floor
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"
    bias = (o - r).mean().abs().item()
    bias_bound = 2 * (rl - r).mean().abs().item() + floor / 10
    assert bias <= bias_bound, f"{name}: mean error {bias:.3e} > {bias_bound:.3e}"
