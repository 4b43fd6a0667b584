"""Serving metrics (TTFT / ITL percentiles as vLLM defines them) and FP8-vs-reference accuracy."""

from __future__ import annotations

import math

__all__ = ["percentiles", "latency_summary", "agreement", "perplexity", "forced_agreement"]


def percentiles(xs, ps=(50, 90, 99)) -> dict:
    """Linear-interpolated percentiles (numpy's default method) of ``xs``; None when empty."""
    xs = sorted(float(x) for x in xs)
    out = {}
    for p in ps:
        if not xs:
            out[f"p{p}"] = None
            continue
        k = (len(xs) - 1) * p / 100.0
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
    return out


def latency_summary(outputs) -> dict:
    """TTFT: request arrival to its first output token. ITL: gaps between consecutive output tokens
    of one request, pooled over all requests (vLLM benchmark_serving definitions). Milliseconds."""
    ttft = [o.ttft * 1e3 for o in outputs if o.ttft is not None]
    itl = [x * 1e3 for o in outputs for x in o.itl]
    return {
        "ttft_ms": percentiles(ttft),
        "itl_ms": percentiles(itl),
        "ttft_mean_ms": sum(ttft) / len(ttft) if ttft else None,
        "itl_mean_ms": sum(itl) / len(itl) if itl else None,
    }


def agreement(ref_outputs: list[list[int]], outputs: list[list[int]]) -> dict:
    """Greedy-output agreement of ``outputs`` with ``ref_outputs`` (pairs in the same order).

    identical_share : share of sequences whose tokens are all equal.
    mean_first_divergence : mean index of the first differing token (the full length when identical).
    token_share : share of positions (up to the shorter of each pair) with equal tokens, counted
        position-wise (after a divergence the texts usually drift, so this undercounts agreement).
    prefix_share : share of reference tokens before the first divergence.
    """
    n = len(ref_outputs)
    if n == 0:
        return {"identical_share": None, "mean_first_divergence": None, "token_share": None, "prefix_share": None}
    ident, firsts, eq, tot, pre, reftot = 0, [], 0, 0, 0, 0
    for a, b in zip(ref_outputs, outputs):
        m = min(len(a), len(b))
        d = next((i for i in range(m) if a[i] != b[i]), m)
        if d == m and len(a) == len(b):
            ident += 1
        firsts.append(d)
        eq += sum(1 for i in range(m) if a[i] == b[i])
        tot += max(m, 1)
        pre += d
        reftot += max(len(a), 1)
    return {
        "identical_share": ident / n,
        "mean_first_divergence": sum(firsts) / n,
        "token_share": eq / tot,
        "prefix_share": pre / reftot,
        "first_divergence": firsts,
    }


def perplexity(logprob_lists) -> float:
    """exp(mean negative log-likelihood) over all tokens of all sequences."""
    lp = [x for xs in logprob_lists for x in xs]
    return math.exp(-sum(lp) / len(lp)) if lp else float("nan")


def forced_agreement(ref_tokens: list[list[int]], argmax_lists: list[list[int]]) -> float:
    """Teacher-forced top-1 agreement: with the reference continuation as context, the share of
    positions whose argmax equals the reference token (no error cascade after a divergence)."""
    eq = tot = 0
    for a, b in zip(ref_tokens, argmax_lists):
        for x, y in zip(a, b):
            eq += int(x == y)
            tot += 1
    return eq / tot if tot else float("nan")
