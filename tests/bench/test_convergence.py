"""The convergence routine's training loop (fp8attn.bench.convergence) on the CPU: a tiny Llama trained for a
few dozen steps with fp8attn.attention learns (the loss falls), and the goal checks read the runs right."""

import torch

from fp8attn.bench.convergence import TrainConfig, goals, train


def test_tiny_convergence_loss_falls_with_fp8_attention():
    g = torch.Generator().manual_seed(0)
    phrases = torch.randint(0, 64, (8, 16), generator=g)  # a stream of 8 recurring 16-token phrases
    tokens = phrases[torch.randint(0, 8, (400,), generator=g)].reshape(-1)
    cfg = TrainConfig(
        layers=1, width=64, heads=4, kv_heads=2, seqlen=32, batch=4, steps=30, lr=1e-2, warmup=3, vocab_size=64
    )
    loss = train(cfg, tokens, {"granularity": "per_head"}, seed=0, device="cpu")
    assert len(loss) == 30 and all(x == x for x in loss)
    assert sum(loss[-5:]) / 5 < 0.5 * loss[0], loss


def test_goals_windows_and_final():
    base = [3.0 - 0.001 * i for i in range(400)]
    runs = {
        "sdpa_bf16": base,
        "sdpa_bf16_seed1": [x + 0.02 for x in base],
        "fp8_good": [x + 0.01 for x in base],
        "fp8_bad": [x * 1.05 for x in base],
    }
    g = goals(runs, warmup=100)
    assert g["fp8_good"]["final_within_1pct"] and g["fp8_good"]["all_windows_within_spread"]
    assert g["fp8_good"]["windows"] == 3
    assert not g["fp8_bad"]["final_within_1pct"] and g["fp8_bad"]["windows_within_spread"] == 0
