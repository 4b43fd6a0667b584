"""transformers integration: attn_implementation="fp8attn" and FP8Cache on tiny random models (CPU, no download)."""

import warnings

import pytest
import torch

from helpers import rel_err

transformers = pytest.importorskip("transformers")
fx = pytest.importorskip("fp8attn.integrations.transformers")

from fp8attn.capability import FallbackWarning  # noqa: E402

VOCAB = 96


def _llama_cfg(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _qwen2_sliding_cfg(window=True):
    # layer 0 full attention, layer 1 a sliding window of 5 tokens
    return transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        use_sliding_window=window,
        sliding_window=5,
        max_window_layers=1,
    )


def _pair(cfg_fn, impl="fp8attn", ref="sdpa"):
    """Two models with the same random weights: one on fp8attn, one on the reference implementation
    (separate config objects: from_config keeps the config it is given)."""
    torch.manual_seed(0)
    a = transformers.AutoModelForCausalLM.from_config(cfg_fn(), attn_implementation=impl).eval()
    b = transformers.AutoModelForCausalLM.from_config(cfg_fn(), attn_implementation=ref).eval()
    b.load_state_dict(a.state_dict())
    return a, b


def _left_padded(batch=3, seqlen=14, pads=(0, 5, 9)):
    ids = torch.randint(3, VOCAB, (batch, seqlen))
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    for i, p in enumerate(pads):
        mask[i, :p] = 0
        ids[i, :p] = 0
    return ids, mask


@pytest.fixture(scope="module")
def llama():
    return _pair(_llama_cfg)


def test_registered_with_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    fx.register()  # idempotent
    assert AttentionInterface._global_mapping["fp8attn"] is fx.fp8attn_attention_forward
    assert AttentionMaskInterface._global_mapping["fp8attn"] is flash_attention_mask


def test_set_attn_implementation_switches(llama):
    torch.manual_seed(1)
    m = transformers.AutoModelForCausalLM.from_config(_llama_cfg(), attn_implementation="sdpa").eval()
    m.set_attn_implementation("fp8attn")
    assert m.config._attn_implementation == "fp8attn"
    ids = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        m(ids)  # runs through fp8attn (the 4-D-mask guard would raise on an sdpa mask)


def test_left_padding_gqa_close_to_sdpa(llama):
    fp8, ref = llama
    ids, mask = _left_padded()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # the CPU path never warns
        with torch.no_grad():
            out = fp8(ids, attention_mask=mask).logits
    with torch.no_grad():
        exp = ref(ids, attention_mask=mask).logits
        unmasked = ref(ids).logits  # what ignoring the padding would give
    real = mask.bool()
    err = rel_err(out[real], exp[real])
    assert err < 0.03, err
    assert rel_err(unmasked[real], exp[real]) > 5 * err  # the check can tell padding handled from not
    assert torch.isfinite(out).all()


def test_right_padding_close_to_sdpa(llama):
    fp8, ref = llama
    ids = torch.randint(3, VOCAB, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        out, exp = fp8(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel_err(out[real], exp[real]) < 0.03


def test_packed_sequences_from_position_ids(llama):
    fp8, ref = llama
    ids = torch.randint(3, VOCAB, (1, 13))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        out = fp8(ids, position_ids=pos, use_cache=False).logits
        exp = ref(ids, position_ids=pos, use_cache=False).logits
        one_seq = ref(ids, use_cache=False).logits
    err = rel_err(out, exp)
    assert err < 0.03, err
    assert rel_err(one_seq, exp) > 5 * err


def test_sliding_window_per_layer_close_to_sdpa():
    fp8, ref = _pair(_qwen2_sliding_cfg)
    assert [getattr(layer.self_attn, "sliding_window", None) for layer in fp8.model.layers] == [None, 5]
    ids, mask = _left_padded(batch=2, seqlen=16, pads=(0, 3))
    with torch.no_grad():
        out, exp = fp8(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    real = mask.bool()
    err = rel_err(out[real], exp[real])
    assert err < 0.03, err
    _, full = _pair(lambda: _qwen2_sliding_cfg(window=False))
    with torch.no_grad():
        no_window = full(ids, attention_mask=mask).logits
    assert rel_err(no_window[real], exp[real]) > 5 * err  # the window changes the result beyond FP8 error


def test_softcap_and_scale_match_the_reference():
    """Direct call: softcap, a non-default scale, GQA and causal, against the fp64 reference on the
    dequantized inputs."""
    from fp8attn.reference import attention_ref

    class M(torch.nn.Module):
        is_causal = True
        config = None

    q = torch.randn(2, 4, 9, 16)
    k, v = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    out, w = fx.fp8attn_attention_forward(M(), q, k, v, None, scaling=1.0, softcap=2.0)
    assert w is None and out.shape == (2, 9, 4, 16) and out.dtype == q.dtype
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    ref = attention_ref(
        qt.double(), kt.double(), vt.double(), causal=True, softmax_scale=1.0, softcap=2.0, compute_dtype=torch.float64
    )
    no_cap = attention_ref(
        qt.double(), kt.double(), vt.double(), causal=True, softmax_scale=1.0, compute_dtype=torch.float64
    )
    err = rel_err(out, ref)
    assert err < 0.05, err
    assert rel_err(no_cap, ref) > 3 * err


def test_options_context_and_config(llama):
    fp8, _ = llama
    ids = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        base = fp8(ids).logits
        with fx.fp8attn_options(granularity="per_tensor", hadamard=True):
            other = fp8(ids).logits
        again = fp8(ids).logits
    assert not torch.equal(base, other) and torch.equal(base, again)
    fp8.config.fp8attn_granularity = "per_tensor"
    fp8.config.fp8attn_hadamard = True
    try:
        with torch.no_grad():
            from_cfg = fp8(ids).logits
    finally:
        del fp8.config.fp8attn_granularity, fp8.config.fp8attn_hadamard
    assert torch.equal(from_cfg, other)
    with pytest.raises(ValueError, match="granularity"):
        with fx.fp8attn_options(granularity="per_row"):
            pass


def _generate(model, ids, mask, cache=None, n=6, **kw):
    extra = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **extra,
            **kw,
        )


@pytest.fixture(scope="module")
def default_cache_run(llama):
    torch.manual_seed(0)
    ids, mask = _left_padded()
    return ids, mask, _generate(llama[0], ids, mask)


@pytest.mark.parametrize("scale,prealloc", [("per_seq_head", True), ("per_token_head", False)])
def test_generate_fp8_cache_matches_default_cache(llama, default_cache_run, scale, prealloc):
    fp8, _ = llama
    ids, mask, ref = default_cache_run
    kw = dict(max_batch_size=4, max_cache_len=32) if prealloc else {}
    cache = fx.FP8Cache(config=fp8.config, scale=scale, page_size=4, **kw)
    got = _generate(fp8, ids, mask, cache)
    a, b = got.sequences[:, ids.shape[1] :], ref.sequences[:, ids.shape[1] :]
    assert (a == b).float().mean() >= 0.75, (a, b)
    # the first step's logits (prefill over the FP8 cache) are close to the 16-bit-cache ones
    assert rel_err(got.scores[0], ref.scores[0]) < 0.05
    assert cache.get_seq_length() == ids.shape[1] + 5  # the last token is never fed back
    assert cache.layers[0].lens.tolist() == (mask.sum(1) + 5).tolist()  # padding never written
    lay = cache.layers[0]
    bf16_bytes = 2 * lay.keys.numel() * 2  # K and V of the same capacity in bf16
    assert lay.keys.dtype == torch.float8_e4m3fn
    extra = 2 * lay.k_scales.numel() * 4 if scale == "per_token_head" else 0
    assert lay.kv_bytes == bf16_bytes // 2 + extra


def test_prefill_over_cache_prefix_is_causal(llama):
    """A second chunk of tokens attends to the cached prefix and causally to itself: same logits as one
    prefill of the whole sequence (both through the FP8 cache)."""
    fp8, _ = llama
    ids = torch.randint(3, VOCAB, (2, 12))
    whole = fx.FP8Cache(config=fp8.config, page_size=4, scale="per_tensor", k_descale=0.02, v_descale=0.02)
    parts = fx.FP8Cache(config=fp8.config, page_size=4, scale="per_tensor", k_descale=0.02, v_descale=0.02)
    with torch.no_grad():
        ref = fp8(ids, cache=whole).logits
        fp8(ids[:, :7], cache=parts)
        got = fp8(ids[:, 7:], cache=parts).logits
        fresh = fp8(ids[:, 7:]).logits  # no prefix: differs
    assert rel_err(got, ref[:, 7:]) < 0.03
    assert rel_err(fresh, ref[:, 7:]) > 0.1


def test_crop_then_continue(llama):
    fp8, _ = llama
    ids = torch.randint(3, VOCAB, (2, 12))
    full = fx.FP8Cache(config=fp8.config, scale="per_token_head", page_size=4)
    cropped = fx.FP8Cache(config=fp8.config, scale="per_token_head", page_size=4)
    with torch.no_grad():
        ref = fp8(ids, cache=full).logits
        fp8(ids[:, :10], cache=cropped)
        fp8(torch.randint(3, VOCAB, (2, 4)), cache=cropped)  # tokens to be rolled back
        cropped.crop(-4)
        assert cropped.get_seq_length() == 10 and cropped.layers[1].lens.tolist() == [10, 10]
        got = fp8(ids[:, 10:], cache=cropped).logits
    assert torch.allclose(got, ref[:, 10:], atol=1e-5)  # per-token scales: same bytes as never written


def test_reorder_cache_moves_rows(llama):
    fp8, _ = llama
    ids, mask = _left_padded(batch=2, seqlen=9, pads=(0, 3))
    nxt = torch.randint(3, VOCAB, (2, 1))
    m2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    ref_cache = fx.FP8Cache(config=fp8.config, page_size=4)
    cache = fx.FP8Cache(config=fp8.config, page_size=4)
    with torch.no_grad():
        fp8(ids, attention_mask=mask, cache=ref_cache)
        ref = fp8(nxt, attention_mask=m2, cache=ref_cache).logits
        fp8(ids, attention_mask=mask, cache=cache)
        cache.reorder_cache(torch.tensor([1, 1]))
        got = fp8(nxt[[1, 1]], attention_mask=m2[[1, 1]], cache=cache).logits
    assert torch.allclose(got[0], ref[1], atol=1e-5) and torch.allclose(got[1], ref[1], atol=1e-5)


def test_beam_search_with_fp8_cache(llama):
    fp8, _ = llama
    ids, mask = _left_padded(batch=2, seqlen=8, pads=(0, 2))
    ref = _generate(fp8, ids, mask, n=4, num_beams=2)
    got = _generate(fp8, ids, mask, fx.FP8Cache(config=fp8.config, page_size=4), n=4, num_beams=2)
    a, b = got.sequences[:, ids.shape[1] :], ref.sequences[:, ids.shape[1] :]
    assert (a == b).float().mean() >= 0.7, (a, b)


def test_fp8_cache_with_sdpa_raises_clearly():
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(_llama_cfg(), attn_implementation="sdpa").eval()
    with pytest.raises(ValueError, match="attn_implementation='fp8attn'.*attends with 'sdpa'"):
        with torch.no_grad():
            m(torch.randint(0, VOCAB, (1, 5)), cache=fx.FP8Cache(config=m.config))


def test_fp8_cache_under_a_keyword_the_model_does_not_take_raises(llama, monkeypatch):
    """A cache passed under a keyword the forward does not take reaches attention as a kwarg while the model
    builds a cache of its own (older transformers named it past_key_values): refused, never run cacheless."""
    fp8, _ = llama
    assert fx.cache_keyword(fp8) == "cache"
    with pytest.raises(TypeError, match="kv_cache=: an FP8Cache arrived as an attention kwarg"):
        with torch.no_grad():
            fp8(torch.randint(0, VOCAB, (1, 5)), kv_cache=fx.FP8Cache(config=fp8.config))
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(RuntimeError, match=r"transformers >= 5\.24.*this is transformers 5\.17\.0"):
        fx.FP8Cache(config=fp8.config)


def test_fp8_cache_bad_arguments(llama):
    fp8, _ = llama
    with pytest.raises(TypeError, match="config"):
        fx.FP8Cache()
    with pytest.raises(ValueError, match="scale"):
        fx.FP8Cache(config=fp8.config, scale="per_block")
    cache = fx.FP8Cache(config=fp8.config, max_cache_len=8, page_size=4)
    with pytest.raises(ValueError, match="max_cache_len=8"):
        with torch.no_grad():
            fp8(torch.randint(0, VOCAB, (1, 9)), cache=cache)
    cache = fx.FP8Cache(config=fp8.config, max_batch_size=1)
    with pytest.raises(ValueError, match="max_batch_size=1"):
        with torch.no_grad():
            fp8(torch.randint(0, VOCAB, (2, 4)), cache=cache)


def test_training_step_gradient_close_to_sdpa():
    """Training goes through fp8attn.attention (FP8 forward and backward) over the padded varlen batch."""
    fp8, ref = _pair(_llama_cfg)
    fp8.train()
    ref.train()
    ids, mask = _left_padded(batch=2, seqlen=12, pads=(0, 4))
    labels = ids.masked_fill(mask == 0, -100)
    fp8(ids, attention_mask=mask, labels=labels).loss.backward()
    ref(ids, attention_mask=mask, labels=labels).loss.backward()
    for (name, p), q in zip(fp8.named_parameters(), ref.parameters()):
        if q.grad is None:
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if q.grad.norm() > 0:
            cos = torch.nn.functional.cosine_similarity(p.grad.flatten().double(), q.grad.flatten().double(), dim=0)
            assert cos > 0.98, (name, cos.item())


def _compiled_decode_steps(device, backend, dtype, page_size, steps=6):
    """Prefill a left-padded batch into two FP8Caches, then decode ``steps`` tokens with masks as generate
    passes them: through ``torch.compile(model.forward, backend=backend)`` on one cache and eagerly on the
    other, both fed the eager step's tokens. Returns ([(compiled logits, eager logits)] per step, the compiled
    graph count after each step, the two caches)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    with torch.device(device):
        m = transformers.AutoModelForCausalLM.from_config(
            _llama_cfg(), attn_implementation="fp8attn", dtype=dtype
        ).eval()
    ids = torch.randint(3, VOCAB, (2, 9), device=device)
    mask = torch.ones(2, 9, dtype=torch.long, device=device)
    mask[1, :3] = 0  # left padding
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    caches = [fx.FP8Cache(config=m.config, max_batch_size=2, max_cache_len=64, page_size=page_size) for _ in range(2)]
    torch._dynamo.reset()
    counters.clear()
    logits, graphs = [], []
    with torch.no_grad():
        for c in caches:
            m(ids, attention_mask=mask, position_ids=pos, cache=c)
        step_fn = torch.compile(m.forward, backend=backend)
        tok = torch.randint(3, VOCAB, (2, 1), device=device)
        for step in range(steps):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long, device=device)], 1)
            p = pos[:, -1:] + 1 + step
            got = step_fn(tok, attention_mask=mask, position_ids=p, cache=caches[0]).logits
            ref = m(tok, attention_mask=mask, position_ids=p, cache=caches[1]).logits
            logits.append((got, ref))
            graphs.append(counters["stats"]["unique_graphs"])
            tok = ref[:, -1:].argmax(-1)
    return logits, graphs, caches


def test_fp8_cache_compiled_decode_steps():
    """Decode steps through torch.compile(model.forward) with an FP8Cache (masks passed as generate passes
    them): the logits equal the eager steps', the cache state stays in tensors (no recompile per step once
    the step's shapes are seen), and a crop afterwards counts the same real tokens."""
    logits, graphs, caches = _compiled_decode_steps("cpu", "aot_eager", torch.float32, page_size=4)
    for step, (got, ref) in enumerate(logits):
        assert torch.equal(got, ref), step
    assert graphs[2:] == [graphs[2]] * 4, f"a recompile per decode step: {graphs}"
    for c in caches:
        c.crop(-4)
    assert torch.equal(caches[0].layers[0].lens, caches[1].layers[0].lens)
    assert caches[0].layers[0].lens.tolist() == [11, 8]


@pytest.mark.gpu
def test_fp8_cache_compiled_decode_steps_gpu():
    """The compiled decode step on a GPU (inductor, the default torch.compile backend, over fp8attn's paged
    kernels): logits within float rounding of the eager steps' (the same tokens fed to both), one graph for
    every step of one shape."""
    logits, graphs, caches = _compiled_decode_steps("cuda", "inductor", torch.bfloat16, page_size=64)
    for step, (got, ref) in enumerate(logits):
        assert rel_err(got.float(), ref.float()) < 2e-2, step
    assert graphs[2:] == [graphs[2]] * 4, f"a recompile per decode step: {graphs}"
    assert torch.equal(caches[0].layers[0].lens, caches[1].layers[0].lens)
