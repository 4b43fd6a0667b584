"""Continuous-batching inference engine over the compact Llama and a paged (optionally FP8) KV cache."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .allocator import BlockAllocator, blocks_needed
from .kv_cache import KV_DTYPES, PagedKVCache, StepInputs
from .scheduler import SamplingParams, Scheduler, SchedulerOutput, SeqStatus, Sequence

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "PromptTooLong"]


class PromptTooLong(ValueError):
    """A prompt does not fit the context limit (and truncation was not asked for)."""

    def __init__(self, index: int, length: int, limit: int):
        super().__init__(
            f"prompt {index} has {length} tokens, more than the context limit of {limit} "
            f"tokens allows (max_context_len={limit}); shorten it, raise --max-context-len, "
            f"or pass --truncate to keep its last tokens"
        )
        self.index, self.length, self.limit = index, length, limit


@dataclass
class EngineConfig:
    """Engine settings.

    kv_cache_dtype : "bf16" | "fp16" | "fp32" | "fp8" (e4m3fn) | "fp8_e5m2".
    kv_scale : FP8 scale granularity, "per_tensor" | "per_seq_head" | "per_token_head".
    kv_scale_dtype : storage of per-token-head scales, "float32" | "bfloat16" (half the scale bytes).
    v_seq_major : store V sequence-major inside each page (same results; K-major FP8 P@V for prefill,
        one-page decode tiles). None (default): on for FP8 caches, off for 16/32-bit caches; FP8
        decode at page 64 runs faster with it than with FA3's layout (``fp8attn bench engine``,
        benchmarks/results/h200/engine.json).
    static_k_descale / static_v_descale : per-tensor descales (float or one per layer); None = calibrate
        from the first prefill step ("per_tensor") or from each sequence's first prefill chunk
        ("per_seq_head"), with ``calib_margin`` headroom.
    page_size : tokens per KV block (default 64: one-page 64-key kernel tiles, one page id per tile).
    num_blocks : KV blocks in the pool; None = derive from ``kv_memory_bytes``, or else enough for
        ``max_batch_size`` sequences of ``max_context_len`` tokens.
    kv_memory_bytes : KV-cache memory budget in bytes (K and V over all layers).
    max_batch_size : most sequences per step; max_batched_tokens : most tokens per step;
    prefill_chunk_size : most prompt tokens of one sequence per step.
    max_context_len : prompt + generated tokens limit per sequence.
    truncate_prompts : keep the last tokens of too-long prompts instead of rejecting them.
    cuda_graphs : capture pure-decode steps in CUDA graphs (GPU only).
    poison_cache : fill the cache with NaN at start (tests: unwritten slots must never be read).
    record_steps : keep one timing record per step in ``LLMEngine.step_log``.
    seed : base seed of sampled decoding (request i uses ``seed * 1000003 + i`` unless it sets one).
    """

    kv_cache_dtype: str = "bf16"
    kv_scale: str = "per_tensor"
    kv_scale_dtype: str = "float32"
    v_seq_major: bool | None = None
    static_k_descale: object = None
    static_v_descale: object = None
    calib_margin: float = 1.0
    page_size: int = 64
    num_blocks: int | None = None
    kv_memory_bytes: int | None = None
    max_batch_size: int = 32
    max_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    max_context_len: int = 2048
    truncate_prompts: bool = False
    cuda_graphs: bool = True
    poison_cache: bool = False
    record_steps: bool = False
    seed: int = 0


@dataclass
class RequestOutput:
    """Result of one request. Times in seconds; ``itl`` lists the gaps between consecutive tokens."""

    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str | None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    num_preemptions: int = 0
    forced_logprobs: list[float] = field(default_factory=list)
    forced_argmax: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)


def _finish_output(seq: Sequence, t0: float) -> RequestOutput:
    tt = seq.token_times
    return RequestOutput(
        index=seq.index,
        prompt_ids=list(seq.prompt_ids),
        output_ids=list(seq.output_ids),
        finish_reason=seq.finish_reason,
        ttft=(seq.first_token_time - t0) if seq.first_token_time is not None else None,
        itl=[b - a for a, b in zip(tt[:-1], tt[1:])],
        latency=(tt[-1] - t0) if tt else None,
        num_preemptions=seq.num_preemptions,
        forced_logprobs=list(seq.forced_logprobs),
        forced_argmax=list(seq.forced_argmax),
        output_logprobs=list(getattr(seq, "output_logprobs", [])),
    )


class LLMEngine:
    """Continuous-batching engine.

    Parameters
    ----------
    model : fp8attn.models.LlamaModel
    config : EngineConfig
    """

    def __init__(self, model, config: EngineConfig | None = None):
        self.model = model
        self.config = cfg = config or EngineConfig()
        mc = model.cfg
        if cfg.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_DTYPES)}, got {cfg.kv_cache_dtype!r}")
        bpt = PagedKVCache.bytes_per_token_for(
            mc.num_hidden_layers,
            mc.num_key_value_heads,
            mc.head_dim,
            cfg.kv_cache_dtype,
            cfg.kv_scale,
            cfg.kv_scale_dtype,
        )
        if cfg.num_blocks is not None:
            nb = int(cfg.num_blocks)
        elif cfg.kv_memory_bytes is not None:
            nb = int(cfg.kv_memory_bytes) // (bpt * cfg.page_size)
        else:
            nb = cfg.max_batch_size * blocks_needed(cfg.max_context_len, cfg.page_size)
        if nb < 1:
            raise ValueError(
                f"KV cache budget holds no block of {cfg.page_size} tokens "
                f"({bpt * cfg.page_size} bytes each); raise kv_memory_bytes/num_blocks"
            )
        self.device = model.device
        self.max_pages = blocks_needed(cfg.max_context_len, cfg.page_size)
        self.v_seq_major = cfg.kv_cache_dtype.startswith("fp8") if cfg.v_seq_major is None else bool(cfg.v_seq_major)
        static = cfg.kv_scale == "per_tensor" and cfg.static_k_descale is not None
        use_graphs = bool(cfg.cuda_graphs and self.device.type == "cuda")
        # one extra block, owned by no sequence, for the padding rows of CUDA-graph decode batches
        self.scratch_block = nb if use_graphs else None
        self.cache = PagedKVCache(
            mc.num_hidden_layers,
            nb + (1 if use_graphs else 0),
            cfg.page_size,
            mc.num_key_value_heads,
            mc.head_dim,
            cfg.kv_cache_dtype,
            cfg.kv_scale,
            k_descale=cfg.static_k_descale if static else None,
            v_descale=(cfg.static_v_descale if cfg.static_v_descale is not None else cfg.static_k_descale)
            if static
            else None,
            calib_margin=cfg.calib_margin,
            device=self.device,
            poison=cfg.poison_cache,
            scale_dtype=cfg.kv_scale_dtype,
            v_seq_major=self.v_seq_major,
        )
        self.allocator = BlockAllocator(nb, cfg.page_size)
        self.scheduler = Scheduler(self.allocator, cfg.max_batch_size, cfg.max_batched_tokens, cfg.prefill_chunk_size)
        self._next_id = 0
        self.num_steps = 0
        self.step_log: list[dict] = []
        self.graphs = None
        if use_graphs:
            from .cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self)

    # ------------------------------------------------------------------ requests
    def add_request(
        self, prompt_ids, params: SamplingParams | None = None, forced_ids=None, index: int | None = None
    ) -> Sequence:
        """Queue a request. ``forced_ids`` turns it into a scoring request (teacher forcing)."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        idx = self._next_id if index is None else index
        limit = self.config.max_context_len
        total = len(prompt_ids) + (len(forced_ids) if forced_ids is not None else 1)
        if len(prompt_ids) == 0:
            raise ValueError(f"prompt {idx} is empty")
        if total > limit:
            if not self.config.truncate_prompts or forced_ids is not None:
                raise PromptTooLong(idx, len(prompt_ids), limit)
            keep = max(1, limit - max(1, params.max_new_tokens))
            prompt_ids = prompt_ids[-keep:]
        seq = Sequence(
            self._next_id,
            prompt_ids,
            params,
            forced_ids=list(forced_ids) if forced_ids is not None else None,
            index=idx,
        )
        seq.output_logprobs = []
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + idx
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq

    def _max_len(self, seq: Sequence) -> int:
        return min(seq.prompt_len + seq.params.max_new_tokens, self.config.max_context_len)

    # ------------------------------------------------------------------ one step
    def _build_inputs(self, out: SchedulerOutput):
        cfg, dev = self.config, self.device
        ps = cfg.page_size
        ids, pos, slots, seq_idx, cu, lens, logits_rows = [], [], [], [], [0], [], []
        forced_rows = []  # (seq, first logits row, target tokens)
        sample_rows = []  # (seq, logits row)
        B = len(out.chunks)
        page_table = np.full((B, self.max_pages), -1, dtype=np.int32)
        row = 0
        for b, c in enumerate(out.chunks):  # plain Python/numpy: a few microseconds per sequence
            s = c.seq
            a, e = c.start, c.start + c.num_tokens
            bt = s.block_table
            ids.extend(s.tokens[a:e])
            pos.extend(range(a, e))
            slots.extend(bt[t // ps] * ps + t % ps for t in range(a, e))
            seq_idx.extend([b] * c.num_tokens)
            page_table[b, : len(bt)] = bt
            cu.append(cu[-1] + c.num_tokens)
            lens.append(e)
            if s.forced_ids is not None:
                lo = max(a, s.prompt_len - 1)
                hi = min(e, len(s.tokens) - 1)
                if hi > lo:
                    forced_rows.append((s, len(logits_rows), s.tokens[lo + 1 : hi + 1]))
                    logits_rows.extend(range(row + lo - a, row + hi - a))
            elif c.sample:
                sample_rows.append((s, len(logits_rows)))
                logits_rows.append(row + c.num_tokens - 1)
            row += c.num_tokens
        to = lambda t: t.to(dev, non_blocking=True)
        meta = StepInputs(
            cu_seqlens_q=to(torch.tensor(cu, dtype=torch.int32)),
            max_seqlen_q=max(c.num_tokens for c in out.chunks),
            cache_seqlens=to(torch.tensor(lens, dtype=torch.int32)),
            page_table=to(torch.from_numpy(page_table)),
            slot_mapping=to(torch.tensor(slots, dtype=torch.int64)),
            token_seq_idx=to(torch.tensor(seq_idx, dtype=torch.int32)),
        )
        cache = self.cache
        if cache.is_fp8 and cache.scale_mode == "per_seq_head":
            L, H = cache.num_layers, cache.nheads_k
            one = torch.ones(L, H, device=dev)
            seqs = [c.seq for c in out.chunks]
            meta.k_descale = torch.stack([one if q.k_descale is None else q.k_descale for q in seqs], dim=1)
            meta.v_descale = torch.stack([one if q.v_descale is None else q.v_descale for q in seqs], dim=1)
            calib = [q.k_descale is None for q in seqs]
            meta.calib_rows = to(torch.tensor(calib)) if any(calib) else None
        if cache.is_fp8 and cache.scale_mode == "per_tensor" and not cache.tensor_calibrated:
            meta.calib_tensor = True
        input_ids = to(torch.tensor(ids, dtype=torch.int64))
        positions = to(torch.tensor(pos, dtype=torch.int64))
        logits_idx = to(torch.tensor(logits_rows, dtype=torch.int64))
        return input_ids, positions, meta, logits_idx, forced_rows, sample_rows

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        greedy = all(s.params.temperature <= 0 for s in seqs)
        if greedy:
            return logits.argmax(-1).tolist()
        out = []
        for i, s in enumerate(seqs):
            p = s.params
            row = logits[i]
            if p.temperature <= 0:
                out.append(int(row.argmax()))
                continue
            row = row / p.temperature
            if p.top_k > 0:
                kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, -1)
            if p.top_p < 1.0:
                sp, si = probs.sort(descending=True)
                keep = sp.cumsum(-1) - sp < p.top_p
                probs = torch.zeros_like(probs).scatter(0, si, sp * keep)
            out.append(int(torch.multinomial(probs, 1, generator=s.generator)))
        return out

    def step(self) -> list[Sequence]:
        """Schedule, run one forward pass, sample; returns the sequences that finished this step."""
        out = self.scheduler.schedule()
        if not out.chunks:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress (KV cache too small for any waiting sequence)")
            return []
        t_start = time.perf_counter()
        input_ids, positions, meta, logits_idx, forced_rows, sample_rows = self._build_inputs(out)
        self.cache.meta = meta
        logits = None
        used_graph = False
        if (
            self.graphs is not None
            and out.is_pure_decode
            and len(sample_rows) == len(out.chunks)
            and not meta.calib_tensor
            and meta.calib_rows is None
        ):
            logits = self.graphs.run(input_ids, positions, meta)
            used_graph = logits is not None
        if logits is None:
            with torch.inference_mode():
                logits = self.model(input_ids, positions, self.cache, logits_idx)
        self.num_steps += 1
        if meta.calib_tensor:
            self.cache.tensor_calibrated = True
        if meta.calib_rows is not None:
            for b, c in enumerate(out.chunks):
                if c.seq.k_descale is None:
                    c.seq.k_descale = meta.k_descale[:, b].clone()
                    c.seq.v_descale = meta.v_descale[:, b].clone()
        self.scheduler.commit(out)
        finished = []
        if forced_rows:
            lp = torch.log_softmax(logits.float(), -1)
            am = logits.argmax(-1)
            for s, r0, targets in forced_rows:
                t = torch.tensor(targets, device=lp.device)
                rows = torch.arange(r0, r0 + len(targets), device=lp.device)
                s.forced_logprobs.extend(lp[rows, t].tolist())
                s.forced_argmax.extend(am[rows].tolist())
        if sample_rows:
            sample_seqs = [s for s, _ in sample_rows]
            srows = [r for _, r in sample_rows]
            sl = logits[torch.tensor(srows, device=logits.device)]
            toks = self._sample(sl, sample_seqs)
            lps = (
                torch.log_softmax(sl.float(), -1)
                .gather(1, torch.tensor(toks, device=sl.device)[:, None])[:, 0]
                .tolist()
            )
            now = time.perf_counter()
            for s, t, lpv in zip(sample_seqs, toks, lps):
                s.tokens.append(int(t))
                s.output_logprobs.append(lpv)
                s.token_times.append(now)
                if s.first_token_time is None:
                    s.first_token_time = now
                if t in s.params.stop_token_ids:
                    self.scheduler.finish(s, "stop")
                elif len(s.tokens) >= self._max_len(s):
                    self.scheduler.finish(s, "length")
                if s.status is SeqStatus.FINISHED:
                    finished.append(s)
        if self.config.record_steps:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.step_log.append(
                {
                    "step": self.num_steps - 1,
                    "start_s": t_start,
                    "ms": (time.perf_counter() - t_start) * 1e3,
                    "num_seqs": len(out.chunks),
                    "num_tokens": out.num_tokens,
                    "prefill_tokens": sum(
                        c.num_tokens for c in out.chunks if c.num_tokens > 1 or c.start < c.seq.prompt_len
                    ),
                    "decode_seqs": sum(1 for c in out.chunks if c.num_tokens == 1 and c.start >= c.seq.prompt_len),
                    "preempted": len(out.preempted),
                    "graph": bool(used_graph),
                }
            )
        for c in out.chunks:
            s = c.seq
            if s.forced_ids is not None and s.num_computed == len(s.tokens) and s.status is not SeqStatus.FINISHED:
                self.scheduler.finish(s, "scored")
                finished.append(s)
        return finished

    # ------------------------------------------------------------------ batch APIs
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        forced: list[list[int]] | None = None,
        progress=None,
    ) -> tuple[list[RequestOutput], dict]:
        """Run every prompt to completion (all arrive at once).

        Returns (outputs in input order, stats). Ctrl-C stops cleanly: unfinished requests are dropped,
        finished ones are returned and ``stats["interrupted"]`` is True. ``progress(n_done, n_total, tokens, max_tokens)``
        is called after every step.
        """
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        # validate everything first: a bad prompt rejects the batch before any work
        limit = self.config.max_context_len
        for i, p in enumerate(prompts):
            extra = len(forced[i]) if forced is not None else 1
            if len(p) + extra > limit and (not self.config.truncate_prompts or forced is not None):
                raise PromptTooLong(i, len(p), limit)
        t0 = time.perf_counter()
        seqs = []
        for i, p in enumerate(prompts):
            s = self.add_request(p, plist[i], forced_ids=forced[i] if forced is not None else None, index=i)
            s.arrival_time = t0
            seqs.append(s)
        done: dict[int, RequestOutput] = {}
        interrupted = False
        steps0, pre0 = self.num_steps, self.scheduler.num_preemptions
        try:
            while self.scheduler.has_unfinished():
                for s in self.step():
                    done[s.index] = _finish_output(s, t0)
                if progress is not None:  # finished requests, and tokens produced so far / at most
                    progress(
                        len(done),
                        len(prompts),
                        sum(len(x.output_ids) for x in seqs),
                        sum(x.params.max_new_tokens for x in seqs),
                    )
        except KeyboardInterrupt:
            interrupted = True
            self.scheduler.abort_all()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        outs = [done[i] for i in sorted(done)]
        stats = {
            "elapsed_s": elapsed,
            "num_steps": self.num_steps - steps0,
            "num_preemptions": self.scheduler.num_preemptions - pre0,
            "interrupted": interrupted,
            "generated_tokens": sum(len(o.output_ids) for o in outs),
            "kv_cache_bytes": self.cache.total_bytes,
            "kv_bytes_per_token": self.cache.bytes_per_token,
        }
        stats["tokens_per_s"] = stats["generated_tokens"] / elapsed if elapsed > 0 else 0.0
        return outs, stats

    def kv_descales(self) -> dict:
        """Current per-tensor descales (lists of floats, one per layer)."""
        return {"k": self.cache.k_descale[:, 0].tolist(), "v": self.cache.v_descale[:, 0].tolist()}
