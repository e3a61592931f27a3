"""A token's own bytes, and the name the OpenAI API gives a token that is not text on its own.

Byte-level BPE (GPT-2's byte alphabet: SmolLM2, Llama 3, Qwen2) and SentencePiece with byte
fallback (Llama 2, Mistral: `<0xNN>` pieces) split a character of several UTF-8 bytes over several
tokens: 🎉 is three SmolLM2 tokens. Such a token decoded alone is not UTF-8, and the tokenizer gives
U+FFFD for it. The logprobs' `bytes` field exists so a client can join a character's pieces back
(OpenAI: "useful in instances where characters are represented by multiple tokens"); built from
that U+FFFD it read [239, 191, 189] for every piece, and the pieces joined to nothing.

Here a token's bytes are:
  * its decoded text's UTF-8, where the decode is text (no U+FFFD): the tokens almost every answer
    is made of;
  * otherwise the bytes its vocabulary piece stands for (byte-level: GPT-2's byte alphabet read
    back; byte fallback: `<0xNN>`), where the tokenizer's decoder is of one of those kinds and
    those bytes decode (invalid bytes replaced) to the tokenizer's own text for the token, so the
    two never disagree;
  * otherwise the decoded text's UTF-8, as before.
(A SentencePiece word piece such as `▁the` decodes alone to "the": its name and bytes stay that
text, the space dropped, as they were before; only the pieces of characters change.)
A token whose bytes are not UTF-8 on their own is named `bytes:\\xf0\\x9f` (its bytes as escapes),
as OpenAI's API names such tokens; any other token is named by its decoded text.
"""
from __future__ import annotations

import json
from typing import Callable

REPLACEMENT = "\ufffd"


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character a byte-level vocabulary writes for each
    byte -> that byte (printable Latin-1 bytes stand for themselves, the other 68 for U+0100..)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _decoder_kinds(hf_tokenizer) -> set[str]:
    """The decoder steps of a fast tokenizer ({"ByteLevel"}, {"Replace", "ByteFallback", ...});
    empty where it has none that can be read (a slow tokenizer, a custom one). The decoder's own
    state: the whole tokenizer's (to_str) is 1.5 MB of JSON for SmolLM2, 21 ms a Tokenizer."""
    try:
        decoder = hf_tokenizer.backend_tokenizer.decoder
        spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
    except Exception:  # no backend tokenizer, or a decoder that does not serialize
        return set()
    kinds, todo = set(), [spec]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            kinds.add(d.get("type"))
            todo.extend(d.get("decoders") or [])
    return kinds


def piece_bytes(piece: str, kinds: set[str], alphabet: dict[str, int]) -> bytes | None:
    """The bytes a vocabulary piece stands for under the decoder `kinds`, or None where it cannot
    say (a character outside the byte-level alphabet, a decoder of another kind)."""
    if "ByteLevel" in kinds:
        try:
            return bytes(alphabet[c] for c in piece)
        except KeyError:
            return None
    if "ByteFallback" in kinds:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        return piece.replace("▁", " ").encode()
    return None


class TokenBytes:
    """Token id -> its bytes (see the module's docstring). decode: ids -> text, the tokenizer's
    own; hf_tokenizer: where the vocabulary pieces come from (convert_ids_to_tokens)."""

    def __init__(self, hf_tokenizer, decode: Callable[[list[int]], str]):
        self.hf = hf_tokenizer
        self.decode = decode
        self.kinds = _decoder_kinds(hf_tokenizer)
        self.alphabet = byte_level_alphabet() if "ByteLevel" in self.kinds else {}

    def __call__(self, token_id: int) -> bytes:
        text = self.decode([token_id])
        if REPLACEMENT not in text or not self.kinds:
            return text.encode()
        try:
            piece = self.hf.convert_ids_to_tokens(token_id)
        except Exception:  # an id the vocabulary does not name
            return text.encode()
        raw = piece_bytes(piece, self.kinds, self.alphabet) if isinstance(piece, str) else None
        if raw is None or raw.decode("utf-8", "replace") != text:
            return text.encode()
        return raw


def token_name(text: str, raw: bytes) -> str:
    """The name of a token whose decoded text is `text` and whose bytes are `raw`: the text, or
    `bytes:\\xNN...` where the bytes are not UTF-8 on their own (OpenAI's name for such tokens)."""
    try:
        raw.decode("utf-8")
        return text
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


__all__ = ["TokenBytes", "byte_level_alphabet", "piece_bytes", "token_name"]
