"""The eager-plan signature on the CPU: which calls may select a plan and what tells two keys apart
(the plans themselves run only on CUDA: tests/test_host_path.py)."""

import pytest
import torch

from fp8attn import local_attention, plan


def test_env_sig_follows_the_environment(monkeypatch):
    for name in plan.ENV_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    unset = plan.env_sig()
    assert unset == (None,) * len(plan.ENV_SWITCHES)
    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "triton")
    triton = plan.env_sig()
    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "tma")
    tma = plan.env_sig()
    assert len({unset, triton, tma}) == 3
    monkeypatch.delenv("FP8ATTN_DENSE_BACKEND")
    assert plan.env_sig() == unset


def test_call_key_tells_equal_values_of_other_types_apart():
    t = torch.zeros(2, 3, 4, 8)
    keys = {plan.call_key("dense", (t, None), (s,)) for s in (1, 1.0, True)}
    assert len(keys) == 3  # (1 == 1.0 == True as dict keys; the checked path accepts or refuses each)
    assert plan.call_key("dense", (t,), (1,)) == plan.call_key("dense", (t,), (1,))
    assert plan.call_key("dense", (t,), (1,)) != plan.call_key("varlen", (t,), (1,))
    # strides, dtype and alignment are part of the signature
    assert plan.call_key("dense", (t,), ()) != plan.call_key("dense", (t.transpose(1, 2),), ())
    assert plan.call_key("dense", (t,), ()) != plan.call_key("dense", (t.half(),), ())
    flat = torch.zeros(64)
    assert plan.call_key("dense", (flat[:32],), ()) != plan.call_key("dense", (flat[1:33],), ())
    assert plan.call_key("dense", ("q",), ()) != plan.call_key("dense", (None,), ())


def test_call_key_holds_each_tensors_tensor_sig():
    """call_key spells tensor_sig inline for plain tensors (a hot path): the two stay one definition."""
    t = torch.zeros(2, 3, 4, 8)[:, 1:]

    class Sub(torch.Tensor):
        pass

    tensors = (t, None, "q", t.as_subclass(Sub))
    assert plan.call_key("dense", tensors, (1,))[2:6] == tuple(map(plan.tensor_sig, tensors))


@pytest.mark.parametrize("window", [(-1, -1), (64, 0)])
def test_plannable_only_plain_eager_signatures(window):
    q = torch.zeros(1, 4, 2, 8)
    assert not plan.plannable(q, False, True, False, False, window)  # a CPU call: the reference, never a plan
    meta = torch.empty(1, 4, 2, 8, device="meta")
    assert not plan.plannable(meta, False, True, False, False, window)


def test_plannable_refuses_what_the_checks_tell_apart(monkeypatch):
    """With the device test opened, only exact bools and int pairs select a plan."""

    class Cuda(torch.Tensor):
        pass

    q = torch.zeros(1, 4, 2, 8)
    assert not plan.plannable(q.as_subclass(Cuda), False, True, False, False, (-1, -1))  # (not a plain tensor)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert plan.plannable(q, False, True, False, False, (-1, -1))
    ok = {"validate": False, "causal": True, "return_lse": False, "flag": False, "window_size": (-1, -1)}
    for bad in [
        {"validate": True},
        {"causal": 1},
        {"return_lse": 0},
        {"flag": None},
        {"window_size": [-1, -1]},
        {"window_size": (True, 0)},
        {"window_size": (1.0, 0)},
        {"window_size": (-1, -1, -1)},
    ]:
        assert not plan.plannable(q, **{**ok, **bad}), bad


@pytest.mark.parametrize(
    "chunk,sq,sk,split",
    [
        (0, 8, 8, False),
        (16, 8, 8, False),
        (16, 16, 16, False),
        (16, 8, 17, True),
        (16, 17, 16, True),
        (4, 1, 5, True),
        (4, 0, 9, False),
        (4, 3, 0, False),
    ],
)
def test_splits_into_chunks(chunk, sq, sk, split):
    assert local_attention.splits_into_chunks(chunk, sq, sk) is split
