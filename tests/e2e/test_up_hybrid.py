"""`specsplit up --draft MODEL+ngram`: the drafter service runs the model draft with prompt lookup
in front; over real gRPC the greedy stream is the local target-only output, token for token (a
difference only at a certified near-tie of the target, tests/helpers/greedy.py)."""
from __future__ import annotations

import json

import pytest

from tests.helpers.greedy import assert_greedy_equal_or_tie, hf_next_logits
from tests.services.procs import REPO, TINY_ENGINE, server_info

# A fixed K: these compare usage (drafts proposed/accepted) across processes, and the K policy's
# per-step choice rests on each process's own timings (tests/unit/test_k_policy.py tests it).
FIXED_K = [*TINY_ENGINE, "--k-policy", "fixed"]

PROMPT_IDS = "5,9,13,5,9,13,5,9,13,5,9"


@pytest.fixture(scope="module")
def up(tmp_path_factory, tiny_llama, tiny_draft_close):
    from specsplit.gateway.launch import specsplit_up

    log = tmp_path_factory.mktemp("up-hybrid-logs") / "up.log"
    env = dict(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with specsplit_up(str(tiny_llama), f"{tiny_draft_close}+ngram", max_num_seqs=4, num_speculative_tokens=3,
                      extra=FIXED_K, log=log, env=env, cwd=REPO, startup_timeout=240) as stack:
        yield stack


def _cli_json(capsys, argv) -> dict:
    from specsplit.cli import main

    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_hybrid_split_greedy_equals_target_only(up, capsys, tiny_llama):
    info = server_info(up.address)
    assert info.mode == "split" and info.draft_model.endswith("+ngram") and info.num_speculative_tokens == 3
    common = ["--prompt-token-ids", PROMPT_IDS, "--max-tokens", "24", "--ignore-eos", "--json"]
    remote = _cli_json(capsys, ["generate", "--server", up.address, *common])
    target_only = _cli_json(capsys, ["generate", "--target", str(tiny_llama), *common, *FIXED_K])
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompt = [int(t) for t in PROMPT_IDS.split(",")]
    assert_greedy_equal_or_tie(target_only["token_ids"], hf_next_logits(hf), remote["token_ids"], prompt=prompt)
    assert remote["usage"]["proposed_draft_tokens"] > 0 and remote["usage"]["accepted_draft_tokens"] > 0
