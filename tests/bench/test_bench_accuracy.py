"""`fp8attn bench accuracy` runs without a GPU (reference path) and its error budget adds up."""

import json

from fp8attn.bench.accuracy import run


def test_accuracy_routine_on_cpu(tmp_path):
    seen = []
    path = run(out_dir=tmp_path, seqlen=128, growth_lens=[128, 256], progress=lambda *a: seen.append(a))
    assert path == tmp_path / "accuracy.json"
    assert [(i, total) for i, total, _ in seen] == [(i, 15) for i in range(1, 16)]  # progress: one call per case
    saved = json.loads(path.read_text())
    assert saved["device"] in ("cpu", "cuda")
    rmse = {c["case"]: c["ours"]["rmse"] for c in saved["cases"]}
    assert len(rmse) == 7 + 2 * 4
    # FP8 quantization error dwarfs the 16-bit path's; the rotation cuts it on outlier inputs
    assert rmse["per_tensor S128"] > 10 * rmse["bf16 S128"]
    assert rmse["per_tensor+hadamard S128"] < rmse["per_tensor S128"]
    budget = saved["error_budget"]["rmse"]
    assert set(budget) == {"all", "qk_only", "v_only", "p_only", "qkv_p_exact"}
    # independent error sources add (roughly in quadrature): the whole exceeds each part
    assert budget["all"] > max(budget["qk_only"], budget["v_only"], budget["p_only"]) > 0
    assert budget["qkv_p_exact"] > max(budget["qk_only"], budget["v_only"])
    assert set(saved["growth_ratio"]) == {"bf16", "per_tensor", "per_head", "per_block+hadamard"}
