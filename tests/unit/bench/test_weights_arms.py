"""bench/weights_arms: an arm's suffixes switch their load-time choices off inside the block and
restore the environment after, on success and on error; an unknown suffix is refused."""
from __future__ import annotations

import os

import pytest

from specsplit.bench import weights_arms
from specsplit.kernels import layer_stack, quant_linear
from specsplit.kv import huge_pages


def test_suffixes_switch_off_inside_and_restore_after(monkeypatch):
    monkeypatch.delenv(quant_linear.ENV_AMX, raising=False)
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "1")
    with weights_arms.loading("native-rows-4k") as weights:
        assert weights == "native"
        assert os.environ[quant_linear.ENV_AMX] == "0" and os.environ[huge_pages.ENV_SWITCH] == "0"
        assert not quant_linear.uses_amx() and not huge_pages.available()
    assert quant_linear.ENV_AMX not in os.environ and os.environ[huge_pages.ENV_SWITCH] == "1"
    with pytest.raises(RuntimeError), weights_arms.loading("native-4k"):
        raise RuntimeError("a failed load")
    assert os.environ[huge_pages.ENV_SWITCH] == "1"
    with weights_arms.loading("fp32") as weights:
        assert weights == "fp32" and quant_linear.ENV_AMX not in os.environ


def test_an_unknown_suffix_is_refused():
    with pytest.raises(ValueError, match="unknown suffix 'fast'"), weights_arms.loading("native-fast"):
        pass


def test_the_layers_suffix_loads_without_the_stack(monkeypatch):
    monkeypatch.delenv(layer_stack.ENV_SWITCH, raising=False)
    with weights_arms.loading("native-layers") as weights:
        assert weights == "native" and not layer_stack.enabled()
    assert layer_stack.enabled()
