"""CUDA graphs for pure-decode steps (one new token per sequence), captured per batch-size bucket."""

from __future__ import annotations

import warnings

import torch

from .kv_cache import StepInputs

__all__ = ["DecodeGraphs"]


def _buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b = b * 2 if b < 16 else b + 16
    out.append(max_batch)
    return sorted(set(out))


class DecodeGraphs:
    """Captures ``model(input_ids, positions, cache)`` for decode batches on static buffers.

    Rows beyond the live batch (padding up to the bucket size) point at a scratch block that no
    sequence owns (``cache.num_blocks - 1``, withheld from the allocator): they write and read one
    slot there and their logits are dropped. Capture happens lazily, the first time a bucket is used;
    a capture failure disables graphs with a warning (eager steps continue).
    """

    def __init__(self, engine):
        self.eng = engine
        cache, cfg = engine.cache, engine.config
        dev = engine.device
        self.bmax = cfg.max_batch_size
        self.buckets = _buckets(self.bmax)
        self.scratch = engine.scratch_block
        ps = cache.page_size
        B, P = self.bmax, engine.max_pages
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(B, dtype=torch.int64, device=dev)
        self.cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.seqlens = torch.ones(B, dtype=torch.int32, device=dev)
        self.page_table = torch.full((B, P), self.scratch, dtype=torch.int32, device=dev)
        self.slots = torch.full((B,), self.scratch * ps, dtype=torch.int64, device=dev)
        self.seq_idx = torch.arange(B, dtype=torch.int32, device=dev)
        self.per_seq = cache.is_fp8 and cache.scale_mode == "per_seq_head"
        L, H = cache.num_layers, cache.nheads_k
        self.kd = torch.ones(L, B, H, device=dev) if self.per_seq else None
        self.vd = torch.ones(L, B, H, device=dev) if self.per_seq else None
        self.graphs: dict[int, tuple] = {}
        self.pool = None
        self.disabled = False

    def _meta(self, b: int) -> StepInputs:
        return StepInputs(
            cu_seqlens_q=self.cu[: b + 1],
            max_seqlen_q=1,
            cache_seqlens=self.seqlens[:b],
            page_table=self.page_table[:b],
            slot_mapping=self.slots[:b],
            token_seq_idx=self.seq_idx[:b],
            k_descale=self.kd[:, :b] if self.per_seq else None,
            v_descale=self.vd[:, :b] if self.per_seq else None,
        )

    def _reset_padding(self):
        ps = self.eng.cache.page_size
        self.input_ids.zero_()
        self.positions.zero_()
        self.seqlens.fill_(1)
        self.page_table.fill_(self.scratch)
        self.slots.fill_(self.scratch * ps)
        if self.per_seq:
            self.kd.fill_(1.0)
            self.vd.fill_(1.0)

    def _capture(self, b: int):
        model, cache = self.eng.model, self.eng.cache
        self._reset_padding()
        meta = self._meta(b)
        cache.meta = meta
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode():
            with torch.cuda.stream(s):
                for _ in range(2):
                    model(self.input_ids[:b], self.positions[:b], cache, None)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = model(self.input_ids[:b], self.positions[:b], cache, None)
        if self.pool is None:
            self.pool = g.pool()
        self.graphs[b] = (g, out, meta)

    def run(self, input_ids, positions, meta: StepInputs):
        """Replay the graph of the smallest bucket >= batch; returns (batch, vocab) logits or None."""
        if self.disabled:
            return None
        n = input_ids.shape[0]
        b = next((x for x in self.buckets if x >= n), None)
        if b is None:
            return None
        if b not in self.graphs:
            try:
                self._capture(b)
            except Exception as e:  # pragma: no cover - GPU only
                warnings.warn(
                    f"CUDA graph capture failed ({type(e).__name__}: {e}); running decode eagerly", stacklevel=2
                )
                self.disabled = True
                torch.cuda.synchronize()
                return None
        g, out, gmeta = self.graphs[b]
        self._reset_padding()
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seqlens[:n].copy_(meta.cache_seqlens)
        w = meta.page_table.shape[1]
        self.page_table[:n, :w].copy_(meta.page_table)
        self.slots[:n].copy_(meta.slot_mapping)
        if self.per_seq:
            self.kd[:, :n].copy_(meta.k_descale)
            self.vd[:, :n].copy_(meta.v_descale)
        self.eng.cache.meta = gmeta
        g.replay()
        return out[:n]
