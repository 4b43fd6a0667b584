"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Every sequence keeps one invariant: ``tokens`` holds every known token (prompt, then generated or
teacher-forced ones) and ``num_computed`` says how many of them already have K/V in the paged cache.
A step processes ``tokens[num_computed : num_computed + n]`` of each scheduled sequence, so prefill,
chunked prefill, decode (n == 1) and recompute after preemption are the same operation. When a chunk
reaches the end of ``tokens`` the step samples the next token.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from .allocator import BlockAllocator, blocks_needed

__all__ = ["SamplingParams", "Sequence", "SeqStatus", "ScheduledChunk", "SchedulerOutput", "Scheduler"]


@dataclass
class SamplingParams:
    """Decoding options of one request.

    ``temperature == 0`` is greedy. ``stop_token_ids`` end the sequence (the stop token is kept in
    the output). ``seed`` makes sampled decoding reproducible per request.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request's state. ``forced_ids`` (optional) are teacher-forced continuation tokens: the
    engine scores them (log-probs, argmax) instead of generating."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    forced_ids: list[int] | None = None
    index: int = -1  # position of the request in the caller's list
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    # per-(sequence, head) FP8 descales, (num_layers, nheads_k) float32 each; set at first prefill
    k_descale: object = None
    v_descale: object = None
    # scoring output for forced sequences: log p(token) and argmax at each forced position
    forced_logprobs: list[float] = field(default_factory=list)
    forced_argmax: list[int] = field(default_factory=list)
    # timing (perf_counter seconds)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    generator: object = None

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids) + list(self.forced_ids or [])

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :] if self.forced_ids is None else []

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len if self.forced_ids is None else 0

    @property
    def num_remaining(self) -> int:
        return len(self.tokens) - self.num_computed

    def max_total_len(self) -> int:
        if self.forced_ids is not None:
            return len(self.tokens)
        return self.prompt_len + self.params.max_new_tokens


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at ``start`` are computed this step; ``sample`` is
    True when the chunk ends at the last known token (a new token follows)."""

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_pure_decode(self) -> bool:
        return bool(self.chunks) and all(c.num_tokens == 1 for c in self.chunks)


class Scheduler:
    """Continuous batching: running sequences first (oldest first), then admits waiting ones.

    Parameters
    ----------
    allocator : BlockAllocator
    max_batch_size : int
        Most sequences in one step.
    max_batched_tokens : int
        Most tokens (prefill chunks + decode rows) in one step.
    prefill_chunk_size : int
        Most prompt tokens of one sequence in one step; longer prompts are prefilled in chunks.

    When a running sequence needs a new block and none is free, the most recently admitted running
    sequence is preempted: its blocks are freed and it returns to the front of the waiting queue with
    ``num_computed = 0`` (its prompt and generated tokens are recomputed when it is readmitted).
    """

    def __init__(
        self, allocator: BlockAllocator, max_batch_size: int, max_batched_tokens: int, prefill_chunk_size: int
    ):
        if min(max_batch_size, max_batched_tokens, prefill_chunk_size) <= 0:
            raise ValueError("max_batch_size, max_batched_tokens and prefill_chunk_size must be positive")
        self.alloc = allocator
        self.max_batch_size = int(max_batch_size)
        self.max_batched_tokens = int(max_batched_tokens)
        self.prefill_chunk_size = int(prefill_chunk_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue management
    def add(self, seq: Sequence) -> None:
        need = blocks_needed(seq.max_total_len(), self.alloc.page_size)
        if need > self.alloc.num_blocks:
            raise ValueError(
                f"sequence {seq.index} needs up to {seq.max_total_len()} tokens = {need} blocks but the "
                f"KV cache has only {self.alloc.num_blocks} blocks; raise the KV memory budget or lower "
                f"max_new_tokens / the prompt length"
            )
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and free its blocks."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.alloc.free(seq.block_table)
        seq.block_table = []
        if seq in self.running:
            self.running.remove(seq)

    def abort_all(self) -> list[Sequence]:
        """Drop every unfinished sequence (freeing its blocks); returns them."""
        out = list(self.running) + list(self.waiting)
        for s in self.running:
            self.alloc.free(s.block_table)
            s.block_table = []
        self.running.clear()
        self.waiting.clear()
        for s in out:
            s.status = SeqStatus.FINISHED
            s.finish_reason = "aborted"
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.alloc.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        n = seq.num_remaining
        if n > 1:
            n = min(n, self.prefill_chunk_size)
            if seq.num_computed == 0 and seq.forced_ids is not None:
                # the first chunk holds prompt tokens only: FP8 scales calibrated from the prompt's
                # prefill must not see the teacher-forced continuation
                n = min(n, seq.prompt_len)
        return min(n, budget)

    def _grow(self, seq: Sequence, n: int) -> None:
        need = blocks_needed(seq.num_computed + n, self.alloc.page_size) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.alloc.allocate(need))

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        budget = self.max_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk_len(seq, budget)
            need = blocks_needed(seq.num_computed + n, self.alloc.page_size) - len(seq.block_table)
            while need > self.alloc.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            self._grow(seq, n)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n, seq.num_computed + n == len(seq.tokens)))
            budget -= n
            i += 1
        if not preempted:
            while self.waiting and len(self.running) < self.max_batch_size and budget > 0:
                seq = self.waiting[0]
                n = self._chunk_len(seq, budget)
                if blocks_needed(n, self.alloc.page_size) > self.alloc.num_free:
                    break
                self.waiting.popleft()
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                self._grow(seq, n)
                chunks.append(ScheduledChunk(seq, 0, n, n == len(seq.tokens)))
                budget -= n
        return SchedulerOutput(chunks, preempted)

    def commit(self, out: SchedulerOutput) -> None:
        """Advance ``num_computed`` of every scheduled chunk (call after the forward pass)."""
        for c in out.chunks:
            c.seq.num_computed = c.start + c.num_tokens
