"""Compile-time flags the launchers choose (no GPU: the kernel launch is captured, not run).

Each flag selects a compiled variant; a wrong flag is silent (same numbers) but slow. Found on the
H200: the API's causal window (-1, 0) compiled the sliding-window path into every causal call.
"""

import pytest
import torch

import fp8attn.kernels.dense as KD
import fp8attn.kernels.paged as KP
from fp8attn.kernels.planning import paged_config, window_flags

E4M3 = torch.float8_e4m3fn


def _named(kwargs):
    """A paged launch's keywords with its constexpr bundles spelled out by field name (``KP.PAGED_CFG``,
    ``PAGED_TILE``, the small class's tile fields suffixed ``_S``, ``PAGED_SCHED``)."""
    out = {k: v for k, v in kwargs.items() if k not in ("CFG", "TILE", "TILE_S", "SCHED")}
    out.update(zip(KP.PAGED_CFG, kwargs["CFG"]))
    out.update(zip(KP.PAGED_TILE, kwargs["TILE"]))
    out.update((f"{n}_S", v) for n, v in zip(KP.PAGED_TILE, kwargs["TILE_S"]))
    out.update(zip(KP.PAGED_SCHED, kwargs["SCHED"]))
    return out


class _Capture:
    def __init__(self):
        self.kwargs = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kwargs = _named(kwargs)

        return launch


def _paged_launch(
    monkeypatch, *, causal, window, q_dtype=torch.bfloat16, page=64, v_seq_major=False, lse=True, token_scales=False
):
    cap = _Capture()
    monkeypatch.setattr(KP, "_paged_fwd_kernel", cap)
    monkeypatch.setattr(KP, "launch_combine", lambda *a, **k: None)
    b, hq, hk, d, L = 64, 32, 8, 128, 4096
    kc = torch.zeros(b * L // page, page, hk, d, dtype=E4M3)
    vc = torch.zeros(b * L // page, hk, d, page, dtype=E4M3).permute(0, 3, 1, 2) if v_seq_major else kc.clone()
    q = torch.zeros(b, 1, hq, d, dtype=q_dtype)
    dsc = torch.ones(b, hk)
    kw = {"q_descale": dsc} if q_dtype == E4M3 else {}
    if token_scales:
        kw.update(k_cache_scales=torch.ones(kc.shape[:3]), v_cache_scales=torch.ones(kc.shape[:3]))
    else:
        kw.update(k_descale=dsc, v_descale=dsc)
    KP.launch_paged_fwd(
        q,
        kc,
        vc,
        torch.zeros(b, L // page, dtype=torch.int32),
        torch.full((b,), L, dtype=torch.int32),
        torch.empty(b, 1, hq, d, dtype=torch.bfloat16),
        torch.empty(b, hq, 1) if lse else None,
        max_seqlen_q=1,
        softmax_scale=d**-0.5,
        causal=causal,
        window_size=window,
        num_splits=0,
        **kw,
    )
    return cap.kwargs


_WINDOW_CASES = [  # (causal, window) -> (CAUSAL, HAS_WINDOW)
    (True, (-1, 0), True, False),  # the API's causal: the diagonal is the right edge
    (True, (-1, 5), True, False),  # a right edge beyond the diagonal changes nothing under causal
    (True, (64, 0), True, True),  # a left window stays
    (False, (-1, 0), True, False),  # a window ending on the diagonal is the causal mask
    (False, (32, 0), True, True),  # ... with a left window
    (False, (-1, 3), False, True),  # a right edge past the diagonal is a window
    (False, (-1, -1), False, False),
]


@pytest.mark.parametrize("causal,window,kernel_causal,has_window", _WINDOW_CASES)
def test_window_flags(causal, window, kernel_causal, has_window):
    c, wl, wr, hw = window_flags(causal, window)
    assert (c, hw) == (kernel_causal, has_window)
    assert wl == window[0] and wr == (-1 if c else window[1])


@pytest.mark.parametrize("causal,window,kernel_causal,has_window", _WINDOW_CASES)
def test_paged_window_flag(monkeypatch, causal, window, kernel_causal, has_window):
    kw = _paged_launch(monkeypatch, causal=causal, window=window)
    assert kw["HAS_WINDOW"] is has_window and kw["CAUSAL"] is kernel_causal


@pytest.mark.parametrize(
    "q_dtype,v_seq_major,maxnreg,block_n,mma_fp8",
    [
        (torch.bfloat16, False, 128, 64, False),  # FA3 layout, 16-bit Q: capped for 4 resident blocks per SM
        (torch.bfloat16, True, 128, 64, False),
        (E4M3, True, 128, 64, True),
        (E4M3, False, 128, 64, False),  # FP8 Q with FA3's layout: the 16-bit path (no byte-wise V transpose)
    ],
)
@pytest.mark.parametrize("lse", [True, False])
def test_paged_decode_register_cap(monkeypatch, q_dtype, v_seq_major, maxnreg, block_n, mma_fp8, lse):
    """The cap does not depend on the LSE output (an LSE output once cost 8 registers and a block per SM)."""
    kw = _paged_launch(monkeypatch, causal=True, window=(-1, 0), q_dtype=q_dtype, v_seq_major=v_seq_major, lse=lse)
    assert kw["maxnreg"] == maxnreg and kw["BLOCK_N"] == block_n and kw["MMA_FP8"] is mma_fp8
    assert kw["SPLIT"] is False  # B64 x 8 kv heads = 512 programs: three per SM, unsplit


@pytest.mark.parametrize("v_seq_major", [False, True])
def test_paged_decode_token_scales_uncapped(monkeypatch, v_seq_major):
    """Per-token-head cache scales spill under the cap (sm90 compile): they keep the uncapped tiles."""
    kw = _paged_launch(monkeypatch, causal=True, window=(-1, 0), v_seq_major=v_seq_major, token_scales=True)
    assert kw["maxnreg"] is None and kw["HAS_KS"] and kw["HAS_VS"]


@pytest.mark.parametrize(
    "q_dtype,page,v_seq_major,tile",
    [
        (torch.bfloat16, 64, False, (128, 64, 4)),  # 16-bit Q over an FP8 cache: 4 warps of 32 query rows
        (torch.bfloat16, 16, False, (128, 64, 4)),
        (torch.bfloat16, 128, True, (128, 128, 8)),  # the 128-key sequence-major tile keeps 8 warps
        (E4M3, 64, False, (128, 64, 4)),  # FP8 Q over FA3's layout: P@V in fp16, 4 warps too
        (E4M3, 16, False, (128, 64, 4)),
        (E4M3, 64, True, (128, 64, 8)),  # FP8 MMAs for both dots keep 8 warps
    ],
)
def test_paged_prefill_warps(q_dtype, page, v_seq_major, tile):
    bm, bn, nw, _, _ = paged_config(2048, 4, 128, q_dtype == E4M3, None, page, v_seq_major, True, False)
    assert (bm, bn, nw) == tile


@pytest.mark.parametrize("causal,window,kernel_causal,has_window", _WINDOW_CASES)
def test_dense_window_flag(causal, window, kernel_causal, has_window):
    b, s, h, d = 1, 64, 2, 64
    q = torch.zeros(b, s, h, d, dtype=torch.bfloat16)
    one = torch.ones(b, h)
    _, kwargs, _ = KD._build_launch(
        q,
        q,
        q,
        torch.empty_like(q),
        None,
        softmax_scale=d**-0.5,
        causal=causal,
        window_size=window,
        softcap=0.0,
        q_descale=one,
        k_descale=one,
        v_descale=one,
        out_scale=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        seqused_q=None,
        seqused_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        pack_gqa=False,
        descale_block_q=None,
        descale_block_k=None,
        v_kmajor=False,
    )
    assert kwargs["HAS_WINDOW"] is has_window and kwargs["CAUSAL"] is kernel_causal


class _Launches:
    """Every launch of a captured kernel: (grid, positional args, keyword args)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, _named(kwargs)))

        return launch


@pytest.mark.parametrize("case", ["split_with_tma", "num_splits", "short_queries", "tma_off"])
def test_paged_varlen_launch_plan(monkeypatch, case):
    """A varlen call the TMA kernel accepts: the decode rows in a decode-tile launch of the small class only,
    the sequences of 5..127 queries in a large-tile launch, the rest on the TMA kernel (min_len_q 128).
    Explicit splits, a max_seqlen_q below 128 or config tma=False keep one two-class launch and no TMA
    (below 128, without even checking the TMA kernel's rules)."""
    kern, tma_calls = _Launches(), []
    monkeypatch.setattr(KP, "_paged_fwd_kernel", kern)
    monkeypatch.setattr(KP, "launch_combine", lambda *a, **k: None)
    monkeypatch.setattr(KP, "INTERPRET", False)  # the TMA dispatch is skipped under the interpreter
    checks = []

    def reason(*a, **k):
        checks.append(k["num_splits"])
        return None if k["num_splits"] <= 1 else "split"

    monkeypatch.setattr(KP.paged_launch, "unsupported_reason", reason)
    monkeypatch.setattr(KP.paged_launch, "launch_paged_prefill_tma", lambda *a, **k: tma_calls.append(k))
    hq, hk, d, page = 8, 2, 128, 64
    qlens = [1, 300, 1, 40]
    cu = torch.tensor([0, 1, 301, 302, 342], dtype=torch.int32)
    kc = torch.zeros(64, page, hk, d, dtype=E4M3)
    vc = torch.zeros(64, hk, d, page, dtype=E4M3).permute(0, 3, 1, 2)
    q = torch.zeros(sum(qlens), hq, d, dtype=E4M3)
    one = torch.ones(4, hk)
    splits = 3 if case == "num_splits" else 1
    KP.launch_paged_fwd(
        q,
        kc,
        vc,
        torch.zeros(4, 16, dtype=torch.int32),
        torch.full((4,), 900, dtype=torch.int32),
        torch.empty(sum(qlens), hq, d, dtype=torch.bfloat16),
        torch.empty(hq, sum(qlens)),
        cu_seqlens_q=cu,
        max_seqlen_q=100 if case == "short_queries" else 300,
        softmax_scale=0.1,
        causal=True,
        q_descale=one,
        k_descale=one,
        v_descale=one,
        num_splits=splits,
        config={"tma": False} if case == "tma_off" else None,
    )
    # (args: ptrs, batch, seqlen_q, list_min_q, strides, scalars; the scalars end with the query-count range)
    plan = [(kw["TWO_CLASS"], kw["BIG_CLASS"], args[5][-2], args[5][-1]) for _, args, kw in kern.calls]
    if case == "split_with_tma":
        small_q = paged_config(1, hq // hk, d, True, None, page, True)[0] // (hq // hk)
        assert plan == [(True, False, 0, 0), (False, True, small_q + 1, 127)]
        small, big = kern.calls[0], kern.calls[1]
        assert small[0][0] == 4 * hk  # one program per sequence and kv head
        assert (small[2]["BLOCK_M"], small[2]["BLOCK_N"], small[2]["maxnreg"]) == paged_config(
            1, hq // hk, d, True, None, page, True
        )[0:2] + (128,)  # the decode tiles, capped
        assert big[2]["BLOCK_M"] == 128 and big[2]["num_warps"] == 8
        assert len(tma_calls) == 1 and tma_calls[0]["min_len_q"] == 128 and tma_calls[0]["cu_seqlens_q"] is cu
        # the large-tile launch writes the TMA kernel's block list from one extra program (no list launch)
        assert (small[2]["BLOCK_LIST"], big[2]["BLOCK_LIST"]) == (False, True)
        capacity = sum(qlens) // (128 // (hq // hk)) + len(qlens)
        assert big[0] == (capacity * hk + 1, 1, 1)
        assert big[1][0][14] is tma_calls[0]["block_list"] and big[1][0][14].numel() == 8 * (1 + sum(qlens) // 128 + 4)
    else:
        assert plan == [(True, True, 0, 2**31 - 1)] and tma_calls == []
        assert kern.calls[0][2]["SPLIT"] is (case == "num_splits")
    # no sequence can fill a query block below 128 queries: the TMA kernel's checks are not run
    assert checks == ([] if case in ("short_queries", "tma_off") else [splits])


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 4), (12, 4), (32, 8), (48, 8), (64, 4), (64, 2)])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("v_seq_major", [False, True])
def test_mixed_batch_decode_class_matches_the_cpu_rule(monkeypatch, hq, hk, d, v_seq_major):
    """A varlen FP8 call of prefill tiles (launched on the Triton kernel: no GPU here): the kernel's small
    tile class is the sequences of at most ``decode_row_queries(qg)`` queries; both classes round P as the
    CPU path does (``paged.paged_precisions``: e4m3 over sequence-major V, fp16 over FA3's layout), and the
    small class over FA3's layout runs QK^T in fp16 too where it holds decode tiles."""
    from fp8attn.kernels.planning import decode_row_queries, decode_shaped, paged_precisions

    launches = []

    class _All(_Capture):
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append(_named(kw))

    monkeypatch.setattr(KP, "_paged_fwd_kernel", _All())
    monkeypatch.setattr(KP, "launch_combine", lambda *a, **k: None)
    qg, page, lens = hq // hk, 16, [1, 300]
    kc = torch.zeros(64, page, hk, d, dtype=E4M3)
    vc = torch.zeros(64, hk, d, page, dtype=E4M3).permute(0, 3, 1, 2) if v_seq_major else kc.clone()
    cu = torch.tensor([0, 1, 301], dtype=torch.int32)
    one = torch.ones(2, hk)
    KP.launch_paged_fwd(
        torch.zeros(301, hq, d, dtype=E4M3),
        kc,
        vc,
        torch.zeros(2, 20, dtype=torch.int32),
        torch.tensor([500, 500], dtype=torch.int32),
        torch.empty(301, hq, d, dtype=torch.bfloat16),
        None,
        cu_seqlens_q=cu,
        max_seqlen_q=max(lens),
        softmax_scale=d**-0.5,
        causal=True,
        q_descale=one,
        k_descale=one,
        v_descale=one,
    )
    kw = launches[0]
    assert kw["TWO_CLASS"] and kw["MMA_FP8"]  # prefill tiles: FP8 QK^T
    small_q = kw["BLOCK_M_S"] // kw["QG"]
    (_, p_e4m3, _), (qk8_s, p_e4m3_s, _) = paged_precisions(E4M3, E4M3, E4M3, False, False, max(lens), qg, v_seq_major)
    assert kw["P_FP8"] is p_e4m3 is kw["P_FP8_S"] is p_e4m3_s is v_seq_major
    assert kw["MMA_FP8_S"] is qk8_s is (v_seq_major or not decode_shaped(1, qg))
    if not qk8_s:  # the 16-bit small class: sequences of at most 16 // qg queries
        assert small_q == 16 // qg == decode_row_queries(qg)


@pytest.mark.parametrize("pages", [8, 64])
def test_paged_varlen_tma_rows_match_the_cpu_rule(monkeypatch, pages):
    """A varlen FP8 call over FA3's layout runs its sequences of 128+ queries on the TMA kernel when the
    launch plan does not split the keys, and all of it on the Triton kernel when the heuristic splits
    (a small batch over a long page table: 64 pages). The launcher decides as the CPU path models it
    (``ops._paged_tma_tokens``: those rows' P in e4m3, the others' in fp16)."""
    import fp8attn.ops as O
    from fp8attn.kernels.planning import paged_precisions

    kern, tma_calls = _Launches(), []
    monkeypatch.setattr(KP, "_paged_fwd_kernel", kern)
    monkeypatch.setattr(KP, "launch_combine", lambda *a, **k: None)
    monkeypatch.setattr(KP, "INTERPRET", False)  # the TMA dispatch is skipped under the interpreter
    monkeypatch.setattr(
        KP.paged_launch, "unsupported_reason", lambda *a, **k: None if k["num_splits"] <= 1 else "split"
    )
    monkeypatch.setattr(KP.paged_launch, "launch_paged_prefill_tma", lambda *a, **k: tma_calls.append(k))
    hq, hk, d, page = 8, 2, 128, 64
    qlens = [1, 300]
    cu = torch.tensor([0, 1, 301], dtype=torch.int32)
    kc = torch.zeros(2 * pages, page, hk, d, dtype=E4M3)
    q = torch.zeros(sum(qlens), hq, d, dtype=E4M3)
    pt = torch.zeros(2, pages, dtype=torch.int32)
    one = torch.ones(2, hk)
    KP.launch_paged_fwd(
        q,
        kc,
        kc.clone(),
        pt,
        torch.full((2,), 400, dtype=torch.int32),
        torch.empty(sum(qlens), hq, d, dtype=torch.bfloat16),
        None,
        cu_seqlens_q=cu,
        max_seqlen_q=300,
        softmax_scale=0.1,
        causal=True,
        q_descale=one,
        k_descale=one,
        v_descale=one,
        num_splits=0,
    )
    split = kern.calls[0][2]["SPLIT"]
    assert split is (pages == 64) and bool(tma_calls) is not split
    precisions = paged_precisions(E4M3, E4M3, E4M3, False, False, 300, hq // hk, False)
    rows = O._paged_tma_tokens(q, kc, kc, pt, cu, 300, torch.bfloat16, (-1, 0), 0.0, None, False, 0, False, precisions)
    assert (rows is not None) is bool(tma_calls)
    if rows is not None:
        assert rows.tolist() == [False] + [True] * 300
