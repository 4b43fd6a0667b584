"""Context-parallel decode (fp8attn.distributed): the shard plan, sharding and routing of new tokens, the
merge of empty shards, and cp_decode over real gloo process groups (2 ranks; 4 ranks as 2 x 2 with head
parallelism) against the single-process decode on the full cache and the float64 oracle.

Caches are NaN-poisoned outside the written slots, page tables random over a pool 3x larger, descales
random per (sequence, KV head). The process groups are forked (no re-import) under a collective timeout
and a deadline, so a hang fails the test instead of stalling the suite.
"""

import datetime

import pytest
import torch

import fp8attn.distributed as D
from fp8attn import flash_attn_combine, flash_attn_with_kvcache, write_kv_cache
from fp8attn.paged_cache import packed_token_seqs, slot_mapping_for, to_v_seq_major
from fp8attn.quant import quantize
from helpers import check_vs_oracle, naive_attention, page_table_3x, poisoned_cache, rand_descale, scatter_dense

E4M3 = torch.float8_e4m3fn
TIMEOUT = datetime.timedelta(seconds=20)  # each collective; launch_local's deadline bounds the whole run
DEADLINE = 180.0


def _problem(lens, ps=16, hq=4, hk=2, d=64, qkind="bf16", sq=1, spare_pages=0, seed=0):
    """A poisoned paged FP8 cache of ``lens`` tokens per sequence, its dense copy (for the oracle), q and
    descales. ``spare_pages``: pages allocated past each sequence's end (room for appends)."""
    g = torch.Generator().manual_seed(seed)
    b, L = len(lens), max(max(lens), 1)
    k8, kd = quantize(torch.randn(b, L, hk, d, generator=g), "per_head")
    v8, vd = quantize(torch.randn(b, L, hk, d, generator=g) * 2, "per_head")
    kd, vd = kd * rand_descale(b, hk, 0.8, 1.25), vd * rand_descale(b, hk, 0.8, 1.25)
    alloc = [n + spare_pages * ps for n in lens]
    pt, nblocks = page_table_3x(alloc, ps)
    kc, vc = poisoned_cache(nblocks, ps, hk, d), poisoned_cache(nblocks, ps, hk, d)
    scatter_dense(kc, pt, k8, lens)
    scatter_dense(vc, pt, v8, lens)
    if qkind == "fp8":
        q, qd = quantize(torch.randn(b, sq, hq, d, generator=g), "per_tensor")
        qd = qd.reshape(1, 1)
    else:
        q, qd = torch.randn(b, sq, hq, d, generator=g).bfloat16(), None
    return dict(q=q, qd=qd, kd=kd, vd=vd, kc=kc, vc=vc, pt=pt, cs=torch.tensor(lens, dtype=torch.int32), k8=k8, v8=v8)


def _single(p, **kw):
    return flash_attn_with_kvcache(
        p["q"],
        p["kc"],
        p["vc"],
        cache_seqlens=p["cs"],
        page_table=p["pt"],
        q_descale=p["qd"],
        k_descale=p["kd"],
        v_descale=p["vd"],
        return_softmax_lse=True,
        **kw,
    )


def _oracle(p, causal=False):
    b, sq = p["q"].shape[:2]
    return naive_attention(
        p["q"],
        p["k8"],
        p["v8"],
        seqlens_q=torch.full((b,), sq),
        seqlens_k=p["cs"],
        causal=causal,
        q_descale=p["qd"],
        k_descale=p["kd"],
        v_descale=p["vd"],
        p_round=torch.float16,
    )


def _assert_matches(out, lse, p, single=None, causal=False):
    """FA3's rule against the oracle (the paged tests' check), and close to the single-process decode."""
    ref, ref_lse, lowp = _oracle(p, causal)
    check_vs_oracle(out, lse, ref, ref_lse, lowp)
    if single is not None:
        torch.testing.assert_close(out.float(), single[0].float(), atol=2e-2, rtol=2e-2)
        fin = torch.isfinite(single[1])
        assert torch.equal(fin, torch.isfinite(lse))
        torch.testing.assert_close(lse[fin], single[1][fin], atol=1e-4, rtol=1e-5)


def _dense_tokens(cache, pt, n, b):
    """Bytes of sequence b's first n tokens in a paged cache (as uint8)."""
    ps = cache.shape[1]
    raw = cache.view(torch.uint8)
    return torch.stack([raw[int(pt[b, t // ps]), t % ps] for t in range(n)]) if n else raw[:0, 0]


def _with_dense(p, cs):
    """``p`` at lengths ``cs``, with the dense K/V (for the oracle) read back from its paged cache."""
    L, (hk, d) = int(cs.max()), p["kc"].shape[2:]
    dense = lambda c: torch.stack(
        [
            torch.cat([_dense_tokens(c, p["pt"], n, b).view(E4M3), torch.zeros(L - n, hk, d, dtype=E4M3)])
            for b, n in enumerate(cs.tolist())
        ]
    )
    return dict(p, cs=cs, k8=dense(p["kc"]), v8=dense(p["vc"]))


def _tokens_of_shards(plan, shards, b, n):
    """Reassemble sequence b's n tokens from the shards (global order), bytes."""
    ps = plan.page_size
    rows = []
    for t in range(n):
        page = t // ps
        s = shards[plan.owner(page)]
        rows.append(s.k_cache.view(torch.uint8)[int(s.page_table[b, plan.local_page(page)]), t % ps])
    return torch.stack(rows) if rows else shards[0].k_cache.view(torch.uint8)[:0, 0]


# ------------------------------------------------------------------------------------------ single process
@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_plan_owner_local_pages_and_lengths(layout):
    for world, ps, max_pages in ((1, 4, 3), (2, 4, 5), (3, 2, 7), (4, 1, 6)):
        plan = D.CPShardPlan(world, ps, max_pages, layout)
        lmp = plan.local_max_pages
        cols = {r: [plan.global_page(r, j) for j in range(lmp)] for r in range(world)}
        owned = sorted(p for r in cols for p in cols[r] if p < max_pages)
        assert owned == list(range(max_pages))  # every page has exactly one owner
        for r in range(world):
            for j, page in enumerate(cols[r]):
                if page < max_pages:
                    assert plan.owner(page) == r and plan.local_page(page) == j
            assert cols[r] == sorted(cols[r])  # pages keep their order on the owner
        lens = torch.arange(max_pages * ps + 1, dtype=torch.int32)
        tot = torch.zeros_like(lens)
        for r in range(world):
            got = plan.local_seqlens(lens, r)
            assert got.dtype == torch.int32
            want = torch.tensor([sum(1 for t in range(int(n)) if plan.owner(t // ps) == r) for n in lens])
            assert torch.equal(got, want.to(torch.int32)), (world, ps, r)
            tot += got
        assert torch.equal(tot, lens)
    with pytest.raises(ValueError, match="layout"):
        D.CPShardPlan(2, 16, 4, "striped")
    with pytest.raises(ValueError, match="world_size"):
        D.CPShardPlan(0, 16, 4)


@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_simulated_shards_equal_the_single_decode(layout):
    """Shards of both layouts (uneven, empty for the short and the empty sequences) merged == one decode."""
    for world, ps, qkind, sq in ((2, 16, "bf16", 1), (3, 4, "fp8", 1), (2, 8, "bf16", 3)):  # 3: non-causal queries
        p = _problem([0, 5, 37, 70], ps=ps, qkind=qkind, sq=sq)
        plan = D.CPShardPlan(world, ps, p["pt"].shape[1], layout)
        shards = [D.shard_paged_cache(p["kc"], p["vc"], p["pt"], p["cs"], plan, r) for r in range(world)]
        assert any(int(s.cache_seqlens[1]) == 0 for s in shards)  # the 5-token sequence leaves a shard empty
        for b, n in enumerate(p["cs"].tolist()):  # the shards hold exactly the cache's bytes, in order
            assert torch.equal(_tokens_of_shards(plan, shards, b, n), _dense_tokens(p["kc"], p["pt"], n, b))
        single = _single(p)
        for s in shards:  # unused slots of the shard pools are NaN too (a shard's partial page is copied whole)
            s.k_cache.view(torch.uint8)[s.page_table.max() + 1 :] = 0x7F
        out, lse = D.simulate_cp_decode(
            p["q"], shards, q_descale=p["qd"], k_descale=p["kd"], v_descale=p["vd"], return_softmax_lse=True
        )
        assert out.shape == single[0].shape and out.dtype == torch.bfloat16 and lse.shape == single[1].shape
        _assert_matches(out, lse, p, single)
        assert (out[0].float() == 0).all() and torch.isneginf(lse[0]).all()
        # out= and a workspace, fp32 output, causal with one query (it sees every key either way)
        ws = D.CPWorkspace(p["q"], p["vc"].shape[-1], world)
        buf = torch.full_like(out, float("nan"), dtype=torch.float32)
        got = D.simulate_cp_decode(
            p["q"],
            shards,
            q_descale=p["qd"],
            k_descale=p["kd"],
            v_descale=p["vd"],
            out=buf,
            out_dtype=torch.float32,
            workspace=ws,
            causal=sq == 1,
        )
        assert got is buf
        torch.testing.assert_close(buf.bfloat16(), out, atol=1e-2, rtol=0)


def test_simulated_shards_with_token_scales_and_fused_fp8_output():
    p = _problem([33, 70], ps=8)
    nb, ps, hk = p["kc"].shape[:3]
    ks, vs = torch.rand(nb, ps, hk) + 0.5, torch.rand(nb, ps, hk) + 0.5
    plan = D.CPShardPlan(2, ps, p["pt"].shape[1], "round_robin")
    shards = [
        D.shard_paged_cache(
            p["kc"], p["vc"], p["pt"], p["cs"], plan, r, k_cache_scales=ks, v_cache_scales=vs, num_blocks=40
        )
        for r in range(2)
    ]
    assert shards[0].k_cache.shape[0] == 40 and shards[0].k_cache_scales.shape == (40, ps, hk)
    single = flash_attn_with_kvcache(
        p["q"],
        p["kc"],
        p["vc"],
        cache_seqlens=p["cs"],
        page_table=p["pt"],
        k_cache_scales=ks,
        v_cache_scales=vs,
        out_dtype=torch.float32,
    )
    got = D.simulate_cp_decode(p["q"], shards, out_dtype=torch.float32)
    torch.testing.assert_close(got, single, atol=2e-3, rtol=2e-3)
    osc = torch.tensor(0.05)
    fp8 = D.simulate_cp_decode(p["q"], shards, out_scale=osc)
    assert fp8.dtype == E4M3
    want = (got / osc).clamp(-448, 448).to(E4M3).float()
    assert ((fp8.float() - want).abs() <= want.abs() / 8 + 1e-6).all()  # within one e4m3 ulp
    with pytest.raises(ValueError, match="^out_dtype: expected None when out_scale is given"):
        D.simulate_cp_decode(p["q"], shards, out_scale=osc, out_dtype=torch.float32)


def test_combine_weighs_empty_shards_zero():
    """flash_attn_combine: a split with lse = -inf weighs exactly 0 even when its output is NaN; all-empty
    rows give 0 and -inf (what cp_decode relies on for empty shards)."""
    o = torch.randn(3, 2, 1, 4, 8)
    lse = torch.randn(3, 2, 1, 4)
    o[1] = float("nan")
    lse[1] = float("-inf")
    lse[:, 1] = float("-inf")
    o[:, 1] = float("nan")
    out, l_out = flash_attn_combine(o, lse)
    w = torch.softmax(lse[[0, 2], 0], dim=0)
    torch.testing.assert_close(out[0], (w[..., None] * o[[0, 2], 0]).sum(0))
    torch.testing.assert_close(l_out[0], torch.logsumexp(lse[[0, 2], 0], dim=0))
    assert (out[1] == 0).all() and torch.isneginf(l_out[1]).all()


@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_route_new_tokens_writes_on_the_owner_only(layout):
    ps = 4
    p = _problem([0, 3, 9, 14], ps=ps, spare_pages=2)
    world = 2
    plan = D.CPShardPlan(world, ps, p["pt"].shape[1], layout)
    shards = [D.shard_paged_cache(p["kc"], p["vc"], p["pt"], p["cs"], plan, r) for r in range(world)]
    hk, d = p["kc"].shape[2:]
    cs = p["cs"].clone()
    g = torch.Generator().manual_seed(1)
    for step, s_new in enumerate((1, 3, 2)):  # fixed-length appends, then a packed (varlen) one
        b = cs.numel()
        if step < 2:
            k, v = torch.randn(b, s_new, hk, d, generator=g), torch.randn(b, s_new, hk, d, generator=g)
            kw = {}
            n_new = torch.full((b,), s_new, dtype=torch.int32)
        else:
            n_new = torch.tensor([2, 0, 1, 2], dtype=torch.int32)
            k = torch.randn(int(n_new.sum()) + 1, hk, d, generator=g)  # + a padding row past the last offset
            v = torch.randn_like(k)
            kw = dict(cu_seqlens_k_new=torch.nn.functional.pad(n_new.cumsum(0), (1, 0)).to(torch.int32))
        # the single-process cache appends through the attention call
        if step < 2:
            flash_attn_with_kvcache(
                p["q"],
                p["kc"],
                p["vc"],
                k=k,
                v=v,
                cache_seqlens=cs,
                page_table=p["pt"],
                k_descale=p["kd"],
                v_descale=p["vd"],
            )
        else:
            cu = kw["cu_seqlens_k_new"]
            seq, tok = packed_token_seqs(cu, k.shape[0])
            live = seq < b
            seq_c = seq.clamp(max=b - 1)
            slots = slot_mapping_for(p["pt"], ps, seq_c, cs.long()[seq_c] + tok - cu.long()[seq_c])
            write_kv_cache(
                k,
                v,
                p["kc"],
                p["vc"],
                torch.where(live, slots, -1),
                k_descale=p["kd"],
                v_descale=p["vd"],
                token_seq_idx=seq_c.to(torch.int32),
            )
        written = 0
        for r, s in enumerate(shards):
            slots = D.route_new_tokens(
                k, v, s.k_cache, s.v_cache, s.page_table, cs, plan, r, k_descale=p["kd"], v_descale=p["vd"], **kw
            )
            written += int((slots >= 0).sum())
        assert written == int(n_new.sum())  # each token written once, on its owner
        cs = cs + n_new
        for b_, n in enumerate(cs.tolist()):
            assert torch.equal(_tokens_of_shards(plan, shards, b_, n), _dense_tokens(p["kc"], p["pt"], n, b_))
        shards = [s._replace(cache_seqlens=plan.local_seqlens(cs, r)) for r, s in enumerate(shards)]
    # a token whose page the owner has not allocated, and a token past the capacity, raise before any write
    own = plan.owner(int(cs[3]) // ps)  # the rank that owns sequence 3's next token
    s = shards[own]
    before = s.k_cache.clone()
    bad = s.page_table.clone()
    bad[3] = -1
    k1 = torch.randn(4, 1, hk, d)
    with pytest.raises(ValueError, match="^page_table_shard: expected an allocated block"):
        D.route_new_tokens(k1, k1, s.k_cache, s.v_cache, bad, cs, plan, own, k_descale=p["kd"], v_descale=p["vd"])
    full = torch.full_like(cs, plan.max_pages * ps)
    with pytest.raises(ValueError, match="^cache_seqlens: expected lengths after the append <= the capacity"):
        D.route_new_tokens(k1, k1, s.k_cache, s.v_cache, s.page_table, full, plan, own)
    assert torch.equal(s.k_cache.view(torch.uint8), before.view(torch.uint8))


def test_local_argument_errors():
    p = _problem([5, 9])
    with pytest.raises(ValueError, match="^group: expected an initialized"):
        D.cp_decode(p["q"], p["kc"], p["vc"], p["pt"], p["cs"])
    with pytest.raises(ValueError, match="^tp_size"):
        D.tp_head_slices(32, 8, 0, 3)
    assert D.tp_head_slices(32, 8, 1, 2) == (slice(16, 32), slice(4, 8))
    plan = D.CPShardPlan(2, 16, p["pt"].shape[1] + 1)
    with pytest.raises(ValueError, match="^page_table: expected"):
        D.shard_paged_cache(p["kc"], p["vc"], p["pt"], p["cs"], plan, 0)
    plan = D.CPShardPlan(2, 8, p["pt"].shape[1])
    with pytest.raises(ValueError, match="^plan: expected page_size 16"):
        D.shard_paged_cache(p["kc"], p["vc"], p["pt"], p["cs"], plan, 0)
    bad = p["pt"].clone()
    bad[1, 0] = p["kc"].shape[0]
    with pytest.raises(ValueError, match="^page_table: expected block ids <"):
        D.shard_paged_cache(p["kc"], p["vc"], bad, p["cs"], D.CPShardPlan(1, 16, p["pt"].shape[1]), 0)
    with pytest.raises(ValueError, match="^rank"):
        D.shard_paged_cache(p["kc"], p["vc"], p["pt"], p["cs"], D.CPShardPlan(2, 16, p["pt"].shape[1]), 2)
    shards = [
        D.shard_paged_cache(p["kc"], p["vc"], p["pt"], p["cs"], D.CPShardPlan(2, 16, p["pt"].shape[1]), r)
        for r in range(2)
    ]
    with pytest.raises(NotImplementedError, match="causal=True with seqlen_q > 1"):
        D.simulate_cp_decode(p["q"].expand(2, 3, 4, 64).contiguous(), shards, causal=True)
    with pytest.raises(ValueError, match="^workspace"):
        D.simulate_cp_decode(p["q"], shards, workspace=D.CPWorkspace(p["q"], 64, 3))


# ------------------------------------------------------------------------------------------ process groups
def _two_rank_worker(rank, world, probs):
    """Runs on each of 2 gloo ranks; returns every case's result (checked by the parent)."""
    res = {}
    for name, (p, layout) in probs.items():
        plan = D.CPShardPlan(world, p["kc"].shape[1], p["pt"].shape[1], layout)
        s = D.shard_paged_cache(p["kc"], p["vc"], p["pt"], p["cs"], plan, rank)
        args = (p["q"], s.k_cache, s.v_cache, s.page_table, s.cache_seqlens)
        kw = dict(q_descale=p["qd"], k_descale=p["kd"], v_descale=p["vd"])
        res[name] = D.cp_decode(*args, return_softmax_lse=True, **kw)
        res[name + "/local"] = int(s.cache_seqlens.sum())
        if name == "rr":
            ws = D.CPWorkspace(p["q"], p["vc"].shape[-1], world)
            out = torch.empty(res[name][0].shape, dtype=torch.float32)
            for _ in range(2):  # the workspace is reused; out= is written in place
                got = D.cp_decode(*args, out=out, out_dtype=torch.float32, workspace=ws, check_ranks=False, **kw)
            res["rr/out"] = (got is out, out.clone())
            # a bad argument on rank 1 only (an int64 page table): every rank raises the same error type
            bad = args[:3] + (s.page_table.long(),) + args[4:] if rank == 1 else args
            try:
                D.cp_decode(*bad, **kw)
                res["bad_pt"] = None
            except Exception as e:
                res["bad_pt"] = (type(e).__name__, str(e))
            # arguments that must agree across ranks but do not (the softmax scale)
            try:
                D.cp_decode(*args, softmax_scale=0.125 if rank == 0 else 0.25, **kw)
                res["bad_scale"] = None
            except Exception as e:
                res["bad_scale"] = (type(e).__name__, str(e))
            # a query that differs across ranks (its values: the shapes agree)
            try:
                D.cp_decode(p["q"] * (1 + rank), *args[1:], **kw)
                res["bad_q"] = None
            except Exception as e:
                res["bad_q"] = (type(e).__name__, str(e))
            res["after_errors"] = D.cp_decode(*args, **kw)  # the group is still in step
        if name == "append":  # decode steps with new tokens routed to their owner
            cs = p["cs"].clone()
            g = torch.Generator().manual_seed(7)
            hk, d = p["kc"].shape[2:]
            outs = []
            for _ in range(3):
                k, v = torch.randn(cs.numel(), 1, hk, d, generator=g), torch.randn(cs.numel(), 1, hk, d, generator=g)
                D.route_new_tokens(
                    k, v, s.k_cache, s.v_cache, s.page_table, cs, plan, rank, k_descale=p["kd"], v_descale=p["vd"]
                )
                cs = cs + 1
                outs.append(
                    D.cp_decode(
                        p["q"],
                        s.k_cache,
                        s.v_cache,
                        s.page_table,
                        plan.local_seqlens(cs, rank),
                        return_softmax_lse=True,
                        **kw,
                    )
                )
            res["append/outs"] = outs
    return res


def test_cp_decode_two_gloo_ranks():
    probs = {
        "contig": (_problem([0, 5, 37, 70]), "contiguous"),
        "rr": (_problem([1, 16, 17, 90], ps=8), "round_robin"),
        "fp8q": (_problem([3, 64, 65], qkind="fp8", ps=16), "round_robin"),
        "append": (_problem([0, 6, 15], ps=4, spare_pages=1), "contiguous"),
    }
    res = D.launch_local(_two_rank_worker, 2, probs, timeout=TIMEOUT, deadline_s=DEADLINE)
    for name, (p, _) in probs.items():
        single = _single(p)
        for r in range(2):
            out, lse = res[r][name]
            _assert_matches(out, lse, p, single)
            assert torch.equal(out.view(torch.int16), res[0][name][0].view(torch.int16))  # same bits on every rank
        locals_ = [res[r][name + "/local"] for r in range(2)]
        assert sum(locals_) == int(p["cs"].sum())
    assert res[1]["contig/local"] < res[0]["contig/local"]  # uneven shards (rank 1 holds no token of two rows)
    for r in range(2):
        same, out = res[r]["rr/out"]
        assert same
        torch.testing.assert_close(out.bfloat16(), res[r]["rr"][0], atol=1e-2, rtol=0)
        typ, msg = res[r]["bad_pt"]
        assert typ == "TypeError" and msg.startswith("page_table_shard: expected an int32 tensor"), (r, msg)
        assert ("raised on rank 1" in msg) == (r == 0)
        typ, msg = res[r]["bad_scale"]
        assert typ == "ValueError" and msg.startswith("softmax_scale: expected the same value on every rank"), msg
        typ, msg = res[r]["bad_q"]
        assert typ == "ValueError" and msg.startswith("q: expected the same values on every rank"), msg
        assert torch.equal(res[r]["after_errors"], res[r]["rr"][0])
    # appends: the single-process cache gets the same tokens through the attention call
    p = probs["append"][0]
    g = torch.Generator().manual_seed(7)
    hk, d = p["kc"].shape[2:]
    cs = p["cs"].clone()
    for step in range(3):
        k, v = torch.randn(cs.numel(), 1, hk, d, generator=g), torch.randn(cs.numel(), 1, hk, d, generator=g)
        flash_attn_with_kvcache(
            p["q"],
            p["kc"],
            p["vc"],
            k=k,
            v=v,
            cache_seqlens=cs,
            page_table=p["pt"],
            k_descale=p["kd"],
            v_descale=p["vd"],
        )
        cs = cs + 1
        q = _with_dense(p, cs)
        for r in range(2):
            out, lse = res[r]["append/outs"][step]
            _assert_matches(out, lse, q, _single(q))


def _two_by_two_worker(rank, world, p):
    tp, cp = 2, 2
    grp = D.new_cp_tp_groups(tp, cp, timeout=TIMEOUT)
    assert rank == grp.cp_rank * tp + grp.tp_rank
    hq, hk = p["q"].shape[2], p["kc"].shape[2]
    sq_, sk_ = D.tp_head_slices(hq, hk, grp.tp_rank, tp)
    plan = D.CPShardPlan(cp, p["kc"].shape[1], p["pt"].shape[1], "round_robin")
    kc, vc = p["kc"][:, :, sk_].contiguous(), p["vc"][:, :, sk_].contiguous()
    s = D.shard_paged_cache(kc, vc, p["pt"], p["cs"], plan, grp.cp_rank)
    out, lse = D.cp_decode(
        p["q"][:, :, sq_].contiguous(),
        s.k_cache,
        s.v_cache,
        s.page_table,
        s.cache_seqlens,
        k_descale=p["kd"][:, sk_],
        v_descale=p["vd"][:, sk_],
        group=grp.cp_group,
        return_softmax_lse=True,
    )
    # the heads back together over the TP group (as an engine's output projection would reduce them)
    parts = [torch.empty_like(out) for _ in range(tp)]
    torch.distributed.all_gather(parts, out.contiguous(), group=grp.tp_group)
    lses = [torch.empty_like(lse) for _ in range(tp)]
    torch.distributed.all_gather(lses, lse.contiguous(), group=grp.tp_group)
    # a bad input on one rank raises on the ranks of its CP group (rank 3's CP peer is rank 1)
    try:
        bad_cs = s.cache_seqlens[:1] if rank == 3 else s.cache_seqlens
        D.cp_decode(
            p["q"][:, :, sq_].contiguous(),
            s.k_cache,
            s.v_cache,
            s.page_table,
            bad_cs,
            k_descale=p["kd"][:, sk_],
            v_descale=p["vd"][:, sk_],
            group=grp.cp_group,
        )
        err = None
    except ValueError as e:
        err = str(e)
    return torch.cat(parts, dim=2), torch.cat(lses, dim=1), (grp.tp_rank, grp.cp_rank), err


def test_cp_with_head_parallel_two_by_two():
    p = _problem([0, 20, 45, 70], hq=8, hk=4, ps=8)
    res = D.launch_local(_two_by_two_worker, 4, p, timeout=TIMEOUT, deadline_s=DEADLINE)
    single = _single(p)
    assert sorted(r[2] for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, (out, lse, _, err) in enumerate(res):
        _assert_matches(out, lse, p, single)
        if rank in (1, 3):
            assert err is not None and err.startswith("cache_seqlens_shard: expected 4 rows"), err
        else:
            assert err is None


# ------------------------------------------------------------------------------------------------- GPU
def _gpu_problem(b=2, L=8192, ps=64, seed=0):
    """A 32/8-head d128 decode over an e4m3 cache with sequence-major V pages, on cuda:0 values."""
    from fp8attn.bench.cp import HK as NK
    from fp8attn.bench.cp import HQ as NQ
    from fp8attn.bench.cp import D as HD  # the benchmark's head shape

    g = torch.Generator().manual_seed(seed)
    lens = [L, L // 3 + 5][:b]
    k8, kd = quantize(torch.randn(b, L, NK, HD, generator=g), "per_head")
    v8, vd = quantize(torch.randn(b, L, NK, HD, generator=g), "per_head")
    pt, nblocks = page_table_3x(lens, ps)
    kc, vc = poisoned_cache(nblocks, ps, NK, HD), poisoned_cache(nblocks, ps, NK, HD)
    scatter_dense(kc, pt, k8, lens)
    scatter_dense(vc, pt, v8, lens)
    q = torch.randn(b, 1, NQ, HD, generator=g).bfloat16()
    return dict(
        q=q,
        kd=kd * rand_descale(b, NK, 0.8, 1.25),
        vd=vd,
        kc=kc,
        vc=to_v_seq_major(vc),
        pt=pt,
        cs=torch.tensor(lens, dtype=torch.int32),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_gpu_simulated_shards_equal_the_single_decode(layout):
    """The ``bench cp-simulate`` path on one GPU: 2 shards through the kernels, merged == one decode."""
    from fp8attn.reference import paged_attention_ref

    p = {k: v.cuda() for k, v in _gpu_problem().items()}
    plan = D.CPShardPlan(2, p["kc"].shape[1], p["pt"].shape[1], layout)
    shards = [D.shard_paged_cache(p["kc"], p["vc"], p["pt"], p["cs"], plan, r) for r in range(2)]
    kw = dict(k_descale=p["kd"], v_descale=p["vd"])
    single = flash_attn_with_kvcache(
        p["q"], p["kc"], p["vc"], cache_seqlens=p["cs"], page_table=p["pt"], return_softmax_lse=True, **kw
    )
    ws = D.CPWorkspace(p["q"], 128, 2)
    out = torch.empty_like(single[0])
    got, lse = D.simulate_cp_decode(p["q"], shards, out=out, workspace=ws, return_softmax_lse=True, **kw)
    ref = paged_attention_ref(p["q"], p["kc"], p["vc"], p["pt"], p["cs"], out_dtype=torch.float32, **kw)
    err = lambda o: ((o.float() - ref).norm() / ref.norm()).item()
    assert err(got) <= 2 * err(single[0]) + 1e-3, (err(got), err(single[0]))
    torch.testing.assert_close(got.float(), single[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, single[1], atol=1e-3, rtol=1e-4)
    torch.cuda.set_sync_debug_mode("error")  # the path never waits for the device
    try:
        D.simulate_cp_decode(p["q"], shards, out=out, workspace=ws, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # CUDA-graph replay == eager
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        D.simulate_cp_decode(p["q"], shards, out=out, workspace=ws, **kw)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        D.simulate_cp_decode(p["q"], shards, out=out, workspace=ws, **kw)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


def _nccl_worker(rank, world, p):
    p = {k: v.cuda() for k, v in p.items()}
    plan = D.CPShardPlan(world, p["kc"].shape[1], p["pt"].shape[1], "round_robin")
    s = D.shard_paged_cache(p["kc"], p["vc"], p["pt"], p["cs"], plan, rank)
    ws = D.CPWorkspace(p["q"], 128, world)
    out = torch.empty(p["q"].shape, dtype=torch.bfloat16, device="cuda")
    args = (p["q"], s.k_cache, s.v_cache, s.page_table, s.cache_seqlens)
    kw = dict(k_descale=p["kd"], v_descale=p["vd"], out=out, workspace=ws)
    eager = D.cp_decode(*args, **kw).clone()
    try:  # a bad argument on rank 1 only raises on both ranks
        D.cp_decode(*args[:4], s.cache_seqlens.long() if rank == 1 else s.cache_seqlens, **kw)
        err = None
    except TypeError as e:
        err = str(e)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # without the rank check, no host sync on the path
    try:
        D.cp_decode(*args, check_ranks=False, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        D.cp_decode(*args, check_ranks=False, **kw)
    torch.cuda.current_stream().wait_stream(st)
    with torch.cuda.graph(g):
        D.cp_decode(*args, check_ranks=False, **kw)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    return eager.cpu(), out.cpu(), err


@pytest.mark.gpu
def test_gpu_cp_decode_two_nccl_ranks():
    """2 GPUs: cp_decode over NCCL equals the single decode; its CUDA-graph replay equals eager."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    import os

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    p = _gpu_problem()
    res = D.launch_local(_nccl_worker, 2, p, backend="nccl", deadline_s=300.0)
    pc = {k: v.cuda() for k, v in p.items()}
    single = flash_attn_with_kvcache(
        pc["q"], pc["kc"], pc["vc"], cache_seqlens=pc["cs"], page_table=pc["pt"], k_descale=pc["kd"], v_descale=pc["vd"]
    ).cpu()
    for eager, graphed, err in res:
        torch.testing.assert_close(eager.float(), single.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(graphed, eager)
        assert err is not None and err.startswith("cache_seqlens_shard: expected an int32 tensor")
