"""A chat template that refuses the messages (its own raise_exception) or a tokenizer without one:
INVALID_ARGUMENT with the template's reason, not an internal error (gateway/service.py Tokenizer)."""
from __future__ import annotations

import grpc
import pytest

from specsplit.gateway.service import Tokenizer
from specsplit.rpc.wire import ServiceError
from tests.helpers.tiny_models import write_tokenizer


@pytest.fixture
def hf_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


def test_a_template_that_raises_is_invalid_argument(hf_tokenizer):
    hf_tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                                  "{{ raise_exception('System role not supported') }}{% endif %}"
                                  "{{ m['content'] }} {% endfor %}")
    tok = Tokenizer(hf_tokenizer)
    assert tok.encode_chat([{"role": "user", "content": "a b"}])  # the template works otherwise
    with pytest.raises(ServiceError) as e:
        tok.encode_chat([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "System role not supported" in e.value.message


def test_no_template_is_invalid_argument(hf_tokenizer):
    hf_tokenizer.chat_template = None
    with pytest.raises(ServiceError) as e:
        Tokenizer(hf_tokenizer).encode_chat([{"role": "user", "content": "a"}])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in e.value.message
