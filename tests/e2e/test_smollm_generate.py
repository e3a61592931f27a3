"""On the real SmolLM2-135M: native greedy == transformers generate, token for token, fp32, except
from a certified near-tie of transformers' logits on (tests/helpers/greedy.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.models.registry import ASSETS_DIR, DRAFT_ALIAS
from tests.helpers.greedy import assert_greedy_equal_or_tie, hf_next_logits

pytestmark = [pytest.mark.smollm, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a list of the planets in the solar system:",
]
NEW = 64


@pytest.fixture(scope="module")
def target_only():
    colo = build_colocated(EngineConfig(model="smollm2-135m", max_model_len=256, max_num_seqs=4), None,
                           SpecConfig(num_speculative_tokens=0), show_progress=False)
    yield colo
    colo.close()


@pytest.fixture(scope="module")
def hf_model(target_only):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_only.target_model.hf_dir, dtype=torch.float32).eval()
    # ignore_eos semantics: EOS may be emitted and generation goes on, so HF must not stop at it.
    hf.generation_config.eos_token_id = None
    yield hf
    del hf


@pytest.fixture(scope="module")
def hf_logits(hf_model):
    return hf_next_logits(hf_model)


@pytest.fixture(scope="module")
def prompt_ids(target_only):
    return {p: target_only.tokenizer(p).input_ids for p in PROMPTS}


@pytest.fixture(scope="module")
def hf_reference(target_only, hf_model):
    hf = hf_model
    tok = target_only.tokenizer
    out = {}
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.eos_token_id)
        out[p] = gen[0, ids.shape[1]:].tolist()
    return out


def _requests(tok):
    return [GenerationRequest(f"p{i}", tuple(tok(p).input_ids), NEW, ignore_eos=True) for i, p in enumerate(PROMPTS)]


def test_native_greedy_equals_hf_generate(target_only, hf_reference, hf_logits, prompt_ids):
    states = Scheduler(target_only.decoder, target_only.eos_token_ids, 4).run(_requests(target_only.tokenizer))
    for p, s in zip(PROMPTS, states):
        assert_greedy_equal_or_tie(hf_reference[p], hf_logits, s.output, prompt=prompt_ids[p])


def test_cli_generate_json_matches(hf_reference, hf_logits, prompt_ids):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "generate", "--target", "smollm2-135m", "--max-tokens", str(NEW),
         "--ignore-eos", "--max-model-len", "256", "--threads", "1", "--json", PROMPTS[0]],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert_greedy_equal_or_tie(hf_reference[PROMPTS[0]], hf_logits, result["token_ids"], prompt=prompt_ids[PROMPTS[0]])
    assert result["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == NEW and result["usage"]["prompt_tokens"] == 5


def test_cli_generate_ngram_reports_drafts(hf_reference, hf_logits, prompt_ids):
    proc = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "generate", "--target", "smollm2-135m", "--draft", "ngram",
         "--k-policy", "fixed",  # the auto policy may price speculation out on a noisy machine: nothing tested then
         "--max-tokens", str(NEW), "--ignore-eos", "--max-model-len", "256", "--threads", "1", "--json", PROMPTS[2]],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert_greedy_equal_or_tie(hf_reference[PROMPTS[2]], hf_logits, result["token_ids"], prompt=prompt_ids[PROMPTS[2]])
    assert result["usage"]["proposed_draft_tokens"] > 0
    assert 0 <= result["usage"]["accepted_draft_tokens"] <= result["usage"]["proposed_draft_tokens"]


def test_cli_generate_logprobs_equal_the_targets_log_softmax(hf_model, prompt_ids):
    """`--logprobs 3 --json` with n-gram speculation: one entry per token, log_softmax of the
    target's fp32 logits (transformers, target-only, 1e-4), the 3 best most likely first."""
    n_new = 16
    proc = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "generate", "--target", "smollm2-135m", "--draft", "ngram",
         "--max-tokens", str(n_new), "--ignore-eos", "--max-model-len", "256", "--threads", "1", "--json",
         "--logprobs", "3", PROMPTS[2]],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ids, prompt = result["token_ids"], prompt_ids[PROMPTS[2]]
    assert len(result["logprobs"]) == len(ids) == n_new
    with torch.no_grad():
        logits = hf_model(torch.tensor([list(prompt) + ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1: len(prompt) + n_new - 1], dim=-1)  # [n_new, V]
    for j, (t, lp) in enumerate(zip(ids, result["logprobs"])):
        assert lp["token_id"] == t and abs(lp["logprob"] - float(ref[j, t])) < 1e-4, j
        assert len(lp["top"]) == 3
        for alt, best in zip(lp["top"], ref[j].topk(3).values.tolist()):
            assert abs(alt["logprob"] - float(ref[j, alt["token_id"]])) < 1e-4 and abs(alt["logprob"] - best) < 1e-4


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_speculative_greedy_equals_target_only(target_only, hf_reference, hf_logits, prompt_ids, draft):
    if draft == "model":
        name = DRAFT_ALIAS if (ASSETS_DIR / DRAFT_ALIAS / "config.json").exists() else "smollm2-135m"
    else:
        name = "ngram"
    colo = build_colocated(EngineConfig(model="smollm2-135m", max_model_len=256, max_num_seqs=4),
                           EngineConfig(model=name, max_model_len=256, max_num_seqs=4),
                           SpecConfig(num_speculative_tokens=3), show_progress=False)
    states = Scheduler(colo.decoder, colo.eos_token_ids, 4).run(_requests(colo.tokenizer))
    for p, s in zip(PROMPTS, states):
        assert_greedy_equal_or_tie(hf_reference[p], hf_logits, s.output, prompt=prompt_ids[p])
    assert sum(s.proposed for s in states) > 0
    colo.close()


def _cli_json(*flags: str):
    proc = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "generate", "--target", "smollm2-135m", "--draft", "ngram",
         "--max-tokens", "16", "--ignore-eos", "--max-model-len", "256", "--threads", "1", "--json", *flags, PROMPTS[0]],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_generate_n_without_a_server():
    """--n N locally: N choices, a list in index order; greedy ones are equal; sampled with a seed,
    choice i is the one-choice run of seed + i (the server's rule, specsplit.request.choice_seed)."""
    greedy = _cli_json("--n", "2")
    assert [c["index"] for c in greedy] == [0, 1] and greedy[0]["token_ids"] == greedy[1]["token_ids"]
    assert len(greedy[0]["token_ids"]) == 16 and greedy[0]["finish_reason"] == "length"
    sampled = _cli_json("--n", "2", "--temperature", "0.8", "--seed", "7")
    assert sampled[0]["token_ids"] != sampled[1]["token_ids"]
    alone = _cli_json("--temperature", "0.8", "--seed", "8")
    assert isinstance(alone, dict) and alone["token_ids"] == sampled[1]["token_ids"] and alone["text"] == sampled[1]["text"]


def test_bad_inputs_exit_nonzero_with_one_line():
    cases = [
        (["--target", "no-such-model", "hi"], "unknown model"),
        (["--prompt-token-ids", "1,99999999", "--max-model-len", "256"], "outside the vocabulary"),
        (["--prompt-token-ids", "1,2,3", "--max-tokens", "300", "--max-model-len", "256"], "exceeds --max-model-len"),
        (["--prompt-token-ids", "1,2,3", "--logprobs", "21"], "--logprobs must be in [0, 20]"),
    ]
    for extra, needle in cases:
        proc = subprocess.run([sys.executable, "-m", "specsplit.cli", "generate", "--json", "--threads", "1", *extra],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0
        assert needle in proc.stderr, proc.stderr
