"""Read ShareGPT V3 conversations, tolerating a truncated file.

The shipped JSON is one top-level array that is cut off part-way through an entry, so it is read
entry by entry with ``json.JSONDecoder.raw_decode`` and reading stops at the first entry that does
not parse. Used by tools/distill_draft.py and by `specsplit bench` (same prompts, same ids).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

_WS = " \t\r\n"


def iter_conversations(path: str | Path) -> Iterator[dict]:
    """Yield each whole entry of the top-level array; stop quietly at a truncated tail."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while i < n:
        while i < n and (text[i] in _WS or text[i] == ","):
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated entry at the end
        if isinstance(obj, dict):
            yield obj


def first_prompt(conv: dict) -> str | None:
    """The first non-empty human turn of a conversation, or None."""
    for turn in conv.get("conversations") or ():
        if turn.get("from") == "human":
            value = (turn.get("value") or "").strip()
            return value or None
    return None


def load_prompts(path: str | Path) -> list[tuple[str, str]]:
    """``[(id, first human prompt)]`` for every whole conversation that has one, in file order."""
    out = []
    for k, conv in enumerate(iter_conversations(path)):
        prompt = first_prompt(conv)
        if prompt is not None:
            out.append((str(conv.get("id", f"#{k}")), prompt))
    return out


def split_heldout(prompts: list[tuple[str, str]], n_heldout: int = 200):
    """Fixed split: the last ``n_heldout`` whole conversations are held out (eval + benchmark)."""
    if n_heldout <= 0:
        return list(prompts), []
    return list(prompts[:-n_heldout]), list(prompts[-n_heldout:])


def first_exchange(conv: dict) -> tuple[str, str] | None:
    """(first non-empty human turn, the gpt reply right after it), or None."""
    turns = conv.get("conversations") or ()
    for i, turn in enumerate(turns):
        if turn.get("from") == "human" and (turn.get("value") or "").strip():
            if i + 1 < len(turns) and turns[i + 1].get("from") == "gpt" and (turns[i + 1].get("value") or "").strip():
                return turn["value"].strip(), turns[i + 1]["value"].strip()
            return None
    return None


def load_exchanges(path: str | Path) -> list[tuple[str, str, str]]:
    """``[(id, human, gpt)]`` for the first exchange of every whole conversation that has one."""
    out = []
    for k, conv in enumerate(iter_conversations(path)):
        ex = first_exchange(conv)
        if ex is not None:
            out.append((str(conv.get("id", f"#{k}")), ex[0], ex[1]))
    return out
