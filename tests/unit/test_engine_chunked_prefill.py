"""The engines' side of chunked prefill (VerifyRequest / ProposeRequest .prefill_tokens): a piece
computes that many uncached tokens and emits nothing; the rest is an ordinary step."""
from __future__ import annotations

import pytest

from specsplit.config import EngineConfig, SpecConfig
from specsplit.engine import EngineError
from specsplit.factory import build_colocated
from specsplit.protocols import ProposeRequest, SeqAdd, VerifyRequest


@pytest.fixture(scope="module")
def colo(tiny_llama, tiny_draft_close):
    cfg = dict(max_model_len=256, max_num_seqs=4, max_prefill_tokens=64, num_blocks=64)
    c = build_colocated(EngineConfig(model=str(tiny_llama), **cfg), EngineConfig(model=str(tiny_draft_close), **cfg),
                        SpecConfig(num_speculative_tokens=2, k_policy="fixed"), show_progress=False)
    yield c
    c.close()


PROMPT = tuple(3 + (j * 13) % 200 for j in range(100))


def test_verifier_pieces_then_the_same_first_token(colo):
    """Pieces of 40 + 40 then the rest emit nothing, nothing, then the token the whole prompt
    gives (up to fp32 rounding of another reduction order: the logits are compared)."""
    target = colo.target
    target.add([SeqAdd("whole", PROMPT), SeqAdd("pieces", PROMPT)])
    try:
        blocks = len(target.block_manager.block_table("pieces"))
        for n in (40, 40):
            (res,) = target.verify([VerifyRequest("pieces", prefill_tokens=n)])
            assert res.token_ids == () and res.num_accepted == 0
            assert len(target.block_manager.block_table("pieces")) == blocks, "the prompt's blocks stay reserved"
        assert target.seqs["pieces"].num_computed == 80
        with pytest.raises(EngineError, match="cannot verify drafts"):
            target.verify([VerifyRequest("pieces", (5, 6), prefill_tokens=10)])
        (a,) = target.verify([VerifyRequest("whole")])
        (b,) = target.verify([VerifyRequest("pieces", prefill_tokens=40)])  # 20 left: an ordinary step
        assert a.token_ids == b.token_ids and len(b.token_ids) == 1
        assert target.seqs["pieces"].num_computed == target.seqs["whole"].num_computed == 100
        # the next decode reads the pieced KV: same token again
        (a,) = target.verify([VerifyRequest("whole")])
        (b,) = target.verify([VerifyRequest("pieces")])
        assert a.token_ids == b.token_ids
    finally:
        target.release(["whole", "pieces"])


def test_drafter_pieces_never_compute_the_last_token(colo):
    """A drafter piece computes at most prefill_tokens and never the context's last token; the
    drafts that follow equal those of a drafter that took the prompt whole."""
    drafter = colo.drafter
    drafter.add([SeqAdd("whole", PROMPT), SeqAdd("pieces", PROMPT)])
    try:
        (p,) = drafter.propose([ProposeRequest("pieces", (), 0, prefill_tokens=64)])
        assert p.token_ids == () and drafter.seqs["pieces"].num_computed == 64
        drafter.propose([ProposeRequest("pieces", (), 0, prefill_tokens=64)])
        assert drafter.seqs["pieces"].num_computed == 99  # never the last one
        (a,) = drafter.propose([ProposeRequest("whole", (), 3)])
        (b,) = drafter.propose([ProposeRequest("pieces", (), 3)])
        assert a.token_ids == b.token_ids and len(a.token_ids) == 3
    finally:
        drafter.release(["whole", "pieces"])
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks


def test_a_scored_prompt_in_pieces_scores_each_piece_once(colo):
    """prompt_logprobs with chunked prefill: each piece's positions are scored as the piece is
    computed (the pieces before were registered in the prefix cache, so the last piece may not go
    back and recompute them: that raised 'cannot truncate to 0 tokens'), and the prompt's logprobs
    and first token equal the unpieced sequence's (logits of another reduction order: 1e-4)."""
    target = colo.target
    target.add([SeqAdd("whole", PROMPT, prompt_logprobs=2), SeqAdd("pieces", PROMPT, prompt_logprobs=2)])
    try:
        for n in (40, 1, 39):
            (res,) = target.verify([VerifyRequest("pieces", prefill_tokens=n)])
            assert res.token_ids == () and res.prompt_logprobs is None
        (a,) = target.verify([VerifyRequest("whole")])
        (b,) = target.verify([VerifyRequest("pieces", prefill_tokens=40)])  # the rest: an ordinary step
        assert a.token_ids == b.token_ids and len(b.prompt_logprobs) == len(a.prompt_logprobs) == len(PROMPT) - 1
        for x, y in zip(a.prompt_logprobs, b.prompt_logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4 and x.rank >= 1 and y.rank >= 1
            assert all(abs(u - v) < 1e-4 for (_, u), (_, v) in zip(x.top, y.top)) and len(x.top) == len(y.top) == 2
        assert target.seqs["pieces"].num_computed == target.seqs["whole"].num_computed == 100
        (a,) = target.verify([VerifyRequest("whole")])
        (b,) = target.verify([VerifyRequest("pieces")])
        assert a.token_ids == b.token_ids and b.prompt_logprobs is None
    finally:
        target.release(["whole", "pieces"])
