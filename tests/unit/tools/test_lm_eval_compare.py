"""tools/lm_eval_compare.py without lm-eval: the committed task files are well formed, its
context/continuation split is lm-eval's (trailing spaces move to the continuation, ids taken from
the whole), and its reference loglikelihood is the sum of the target's log_softmax over the
continuation (tiny random model, checked against a forward per prefix). The run itself against a
live server: tests/e2e/test_smollm_lm_eval.py (when lm-eval is installed)."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from tests.helpers.tools import TOOLS, load_tool


compare = load_tool("lm_eval_compare")


@pytest.mark.parametrize("task", ["specsplit_mc", "specsplit_gen"])
def test_task_files_are_well_formed(task):
    cfg = yaml.safe_load((TOOLS / "eval" / f"{task}.yaml").read_text())
    assert cfg["task"] == task and cfg["dataset_path"] == "json"
    data = TOOLS / "eval" / cfg["dataset_kwargs"]["data_files"]["test"]
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) >= 8 and all(r["question"] for r in rows)
    if cfg["output_type"] == "multiple_choice":
        assert all(0 <= r["answer"] < len(r["choices"]) and len(set(r["choices"])) == len(r["choices"]) for r in rows)
        assert sorted({r["answer"] for r in rows}) == [0, 1, 2, 3]  # the right answer is not always in one place
    else:
        assert cfg["output_type"] == "generate_until" and all(r["answer"] for r in rows)


class _WordTok:
    """Each character is a token (id = its code point): splits are easy to see."""

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": [ord(c) for c in text]})()


def test_encode_pair_moves_trailing_spaces_to_the_continuation():
    ctx, cont = compare.encode_pair(_WordTok(), "Answer: ", "Paris")
    assert ctx == [ord(c) for c in "Answer:"] and cont == [ord(c) for c in " Paris"]
    ctx, cont = compare.encode_pair(_WordTok(), "Answer:", " Paris")
    assert ctx == [ord(c) for c in "Answer:"] and cont == [ord(c) for c in " Paris"]


def test_reference_loglikelihood_sums_the_continuation_s_log_softmax(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ctx, cont = [5, 9, 17, 4], [33, 8, 60]
    ll, greedy = compare.reference_loglikelihood(model, ctx, cont)
    want, all_argmax = 0.0, True
    with torch.no_grad():
        for j, t in enumerate(cont):  # one forward per prefix: the next token's log_softmax
            row = torch.log_softmax(model(torch.tensor([ctx + cont[:j]])).logits[0, -1].float(), dim=-1)
            want += float(row[t])
            all_argmax &= int(row.argmax()) == t
    assert abs(ll - want) < 1e-4 and greedy == all_argmax
