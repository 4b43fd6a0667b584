"""The benchmark routines' optional FlashInfer peers (CPU parts): the page description handed to FlashInfer,
and the peers' absence when flashinfer is not importable."""

import sys

import pytest
import torch

from fp8attn.bench import paged as bp


@pytest.mark.parametrize("seqlen,page_size", [(70, 16), (64, 16), (1, 64), (8192 + 2048, 64)])
def test_flashinfer_pages_describe_the_used_pages(seqlen, page_size):
    """indptr / indices / last_page_len: each row's first ceil(seqlen / page_size) page ids, in order, and the
    tokens in its last page (a full page when seqlen is a multiple of the page size)."""
    pages = -(-seqlen // page_size)
    pt = torch.randperm(3 * (pages + 2), dtype=torch.int32).view(3, pages + 2)  # extra columns: never described
    indptr, indices, last = bp._flashinfer_pages(pt, seqlen, page_size)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert indptr.tolist() == [0, pages, 2 * pages, 3 * pages]
    for b in range(3):
        assert indices[indptr[b] : indptr[b + 1]].tolist() == pt[b, :pages].tolist()
        assert int(last[b]) == seqlen - (pages - 1) * page_size and 1 <= int(last[b]) <= page_size
    assert indices.is_contiguous()


def test_flashinfer_peers_absent_without_flashinfer(monkeypatch):
    """Without an importable flashinfer both peers are left out (no entry, no error)."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` raise ImportError
    q = torch.zeros(1, 1, bp.HQ, bp.D)
    pt = torch.zeros(1, 1, dtype=torch.int32)
    assert bp._flashinfer_peers(q, None, None, [pt], 16, 16, 1) == {}
    assert (
        bp._flashinfer_prefill_peers(
            q, q, torch.zeros(1, 16, bp.HK, bp.D), None, pt, torch.full((1,), 16, dtype=torch.int32), 1.0
        )
        == {}
    )


def test_graph_step_falls_back_to_none_when_capture_fails():
    """When a call cannot be captured (here it raises after its warm-up; on a machine without CUDA the graph
    itself cannot be made) the step timing is None, not an error or a made-up time."""
    from fp8attn.bench.common import graph_step_ms

    calls = []

    def fn():
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("operation not permitted when stream is capturing")

    assert graph_step_ms([fn], calls=4) is None


@pytest.mark.gpu
def test_graph_step_replays_every_call():
    """One captured graph holds ``calls`` calls cycling the fns: every replay adds ``calls`` to the counters
    (one warm-up call of each fn before capture), and the time per call is positive."""
    from fp8attn.bench.common import graph_step_ms

    xs = [torch.zeros(1, device="cuda", dtype=torch.float64) for _ in range(2)]
    ms = graph_step_ms([lambda x=x: x.add_(1) for x in xs], calls=8)
    torch.cuda.synchronize()
    assert ms is not None and ms > 0
    for x in xs:  # 1 warm-up + 4 per replay
        n = int(x.item()) - 1
        assert n > 0 and n % 4 == 0
