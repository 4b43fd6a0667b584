"""Continuous-batching engine with a paged (bf16 or FP8) KV cache, chunked prefill and preemption."""

from .allocator import BlockAllocator, OutOfBlocks, blocks_needed
from .engine import EngineConfig, LLMEngine, PromptTooLong, RequestOutput
from .kv_cache import KV_DTYPES, SCALE_MODES, PagedKVCache, StepInputs
from .scheduler import SamplingParams, ScheduledChunk, Scheduler, SchedulerOutput, SeqStatus, Sequence

__all__ = [
    "BlockAllocator",
    "OutOfBlocks",
    "blocks_needed",
    "EngineConfig",
    "LLMEngine",
    "PromptTooLong",
    "RequestOutput",
    "KV_DTYPES",
    "SCALE_MODES",
    "PagedKVCache",
    "StepInputs",
    "SamplingParams",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SeqStatus",
]
