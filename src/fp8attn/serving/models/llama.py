"""A compact Llama forward (RMSNorm, RoPE, GQA, SwiGLU) whose attention goes through a paged KV cache.

The model is stateless about the cache: every attention layer calls ``attn(layer_idx, q, k, v)``,
an object that writes k/v into its paged cache and attends (see
:class:`fp8attn.engine.kv_cache.PagedKVCache`). Inputs are flat (varlen) token batches, so one call
can mix prefill chunks and decode rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["LlamaConfig", "LlamaModel", "rope_inv_freq", "LLAMA3_8B"]


@dataclass
class LlamaConfig:
    """Shape and numerics of a Llama-architecture model (names follow transformers' LlamaConfig)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        self.eos_token_id = list(self.eos_token_id or [])

    @classmethod
    def from_hf(cls, hf) -> "LlamaConfig":
        """Build from a transformers config object (LlamaConfig or compatible)."""
        rope_theta = getattr(hf, "rope_theta", None)
        rope_scaling = getattr(hf, "rope_scaling", None)
        rp = getattr(hf, "rope_parameters", None)  # transformers >= 5 keeps rope settings here
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default":
                rope_scaling = dict(rp)
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
            None,
            "default",
        ):
            rope_scaling = None
        eos = getattr(hf, "eos_token_id", None)
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=getattr(hf, "head_dim", None),
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(hf, "max_position_embeddings", 8192),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_id=[] if eos is None else eos,
        )


# Llama-3-8B shapes (32 layers, 32 query / 8 KV heads, head dim 128). Used with RANDOM weights for
# speed measurements only.
LLAMA3_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse RoPE frequencies, (head_dim // 2,) float32, with Llama-3 frequency scaling if set."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
            old = rs.get("original_max_position_embeddings", 8192)
            wavelen = 2 * math.pi / inv
            smooth = (old / wavelen - lo) / (hi - lo)
            scaled = torch.where(wavelen > old / lo, inv / factor, inv)
            mid = (wavelen <= old / lo) & (wavelen >= old / hi)
            inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        elif kind == "linear":
            inv = inv / rs["factor"]
        else:
            raise NotImplementedError(f"rope scaling type {kind!r} is not supported by the compact Llama")
    return inv.float()


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x (T, H, D); cos/sin (T, 1, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaModel(torch.nn.Module):
    """Llama decoder with flat (varlen) inputs and an external paged-attention callable.

    Weights are held as plain tensors: per layer ``wqkv`` (fused q/k/v, ((Hq + 2 Hk) * D, hidden)),
    ``wo``, ``w13`` (fused gate/up, (2 * inter, hidden)), ``w2``, ``ln1``, ``ln2``; plus ``embed``,
    ``norm``, ``lm_head``.
    """

    def __init__(self, cfg: LlamaConfig, weights: dict, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        put = lambda t: t.to(device=self.device, dtype=dtype).contiguous()
        self.embed = put(weights["embed"])
        self.norm = put(weights["norm"])
        self.lm_head = self.embed if weights.get("lm_head") is None else put(weights["lm_head"])
        self.layers = [{k: put(v) for k, v in lw.items()} for lw in weights["layers"]]
        self.inv_freq = rope_inv_freq(cfg).to(self.device)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_model(cls, hf_model, dtype=torch.float32, device="cpu") -> "LlamaModel":
        """Take the weights of a transformers LlamaForCausalLM (or same-named architecture)."""
        cfg = LlamaConfig.from_hf(hf_model.config)
        sd = hf_model.state_dict()
        p = "model."
        layers = []
        for i in range(cfg.num_hidden_layers):
            a, m = f"{p}layers.{i}.self_attn.", f"{p}layers.{i}.mlp."
            layers.append(
                {
                    "wqkv": torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]),
                    "wo": sd[a + "o_proj.weight"],
                    "w13": torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]),
                    "w2": sd[m + "down_proj.weight"],
                    "ln1": sd[f"{p}layers.{i}.input_layernorm.weight"],
                    "ln2": sd[f"{p}layers.{i}.post_attention_layernorm.weight"],
                }
            )
        lm = None if cfg.tie_word_embeddings or "lm_head.weight" not in sd else sd["lm_head.weight"]
        w = {"embed": sd[p + "embed_tokens.weight"], "norm": sd[p + "norm.weight"], "lm_head": lm, "layers": layers}
        return cls(cfg, w, dtype=dtype, device=device)

    @classmethod
    def random(cls, cfg: LlamaConfig, dtype=torch.bfloat16, device="cpu", seed: int = 0) -> "LlamaModel":
        """RANDOM weights of the given shape (for speed tests only; outputs are meaningless).

        Scaled like a trained model (std 1/sqrt(fan_in), unit norms) so activations stay bounded.
        """
        g = torch.Generator(device=device).manual_seed(seed)
        D, Hq, Hk, hd, I = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        )

        def rnd(*shape):
            return torch.randn(*shape, generator=g, device=device, dtype=dtype) * shape[-1] ** -0.5

        layers = [
            {
                "wqkv": rnd((Hq + 2 * Hk) * hd, D),
                "wo": rnd(D, Hq * hd),
                "w13": rnd(2 * I, D),
                "w2": rnd(D, I),
                "ln1": torch.ones(D, device=device, dtype=dtype),
                "ln2": torch.ones(D, device=device, dtype=dtype),
            }
            for _ in range(cfg.num_hidden_layers)
        ]
        w = {
            "embed": torch.randn(cfg.vocab_size, D, generator=g, device=device, dtype=dtype),
            "norm": torch.ones(D, device=device, dtype=dtype),
            "lm_head": rnd(cfg.vocab_size, D),
            "layers": layers,
        }
        return cls(cfg, w, dtype=dtype, device=device)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, logits_indices=None) -> torch.Tensor:
        """Run the decoder over a flat token batch.

        Parameters
        ----------
        input_ids : torch.Tensor
            (num_tokens,) int64 token ids of every scheduled chunk, concatenated.
        positions : torch.Tensor
            (num_tokens,) int64 absolute position of each token in its sequence.
        attn : callable
            ``attn(layer_idx, q, k, v) -> out`` with q (num_tokens, Hq, D), k/v (num_tokens, Hk, D) in
            the model dtype; it stores k/v in its cache and returns (num_tokens, Hq, D).
        logits_indices : torch.Tensor, optional
            (n,) int64 rows whose logits are wanted (default: all rows).

        Returns
        -------
        torch.Tensor
            (n, vocab_size) float32 logits.
        """
        cfg = self.cfg
        T = input_ids.shape[0]
        Hq, Hk, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]
        h = F.embedding(input_ids, self.embed)
        for li, L in enumerate(self.layers):
            x = _rms_norm(h, L["ln1"], cfg.rms_norm_eps)
            qkv = x @ L["wqkv"].T
            q, k, v = qkv.split([Hq * hd, Hk * hd, Hk * hd], dim=-1)
            q = _rope(q.view(T, Hq, hd), cos, sin)
            k = _rope(k.view(T, Hk, hd), cos, sin)
            o = attn(li, q, k, v.reshape(T, Hk, hd))
            h = h + o.reshape(T, Hq * hd).to(self.dtype) @ L["wo"].T
            x = _rms_norm(h, L["ln2"], cfg.rms_norm_eps)
            gu = x @ L["w13"].T
            g, u = gu.chunk(2, dim=-1)
            h = h + (F.silu(g) * u) @ L["w2"].T
        if logits_indices is not None:
            h = h.index_select(0, logits_indices)
        h = _rms_norm(h, self.norm, cfg.rms_norm_eps)
        return (h @ self.lm_head.T).float()
