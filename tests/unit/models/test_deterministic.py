"""--deterministic: a sequence's logits are the same bits whatever batch it runs in and however many
tokens it brings (decode 1, verify K+1, prefill chunks), so speculative greedy == target-only
greedy is asserted exactly (==), at batches 1, 4 and 16, TP 1 and TP 2."""
from __future__ import annotations

import pytest
import torch

from specsplit.config import EngineConfig, SpecConfig
from specsplit.factory import build_colocated, build_draft_engine
from specsplit.request import GenerationRequest
from specsplit.scheduler import Scheduler
from specsplit.models.loader import load_model
from specsplit.models.runner import ForwardItem, ModelRunner
from specsplit.spec import SpecDecoder

MAX_LEN = 128


def _runner(path, dtype=torch.float32, deterministic=True):
    from specsplit.models.deterministic import make_deterministic

    model = load_model(str(path), dtype=dtype, show_progress=False).model
    if deterministic:
        make_deterministic(model)
    return ModelRunner(model, num_blocks=64, block_size=4, max_model_len=MAX_LEN)


def _ids(g, n):
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _logits_alone_and_in_company(runner):
    """The same sequence (prefill 13, then 4 tokens verified at once / decoded one by one) alone,
    and among other sequences of other lengths: returns (alone rows, in-company rows)."""
    g = torch.Generator().manual_seed(0)
    prompt, new = _ids(g, 13), _ids(g, 4)
    runner.forward([ForwardItem("a", 0, prompt[:5]), ])  # prefill in two chunks
    runner.forward([ForwardItem("a", 5, prompt[5:])])
    alone = [runner.forward([ForwardItem("a", 13 + i, [t])])[0] for i, t in enumerate(new)]  # decode 1 by 1
    others = [_ids(g, n) for n in (3, 21, 8)]
    items = [ForwardItem(f"o{i}", 0, o, num_logits=1) for i, o in enumerate(others)]
    runner.forward(items[:1] + [ForwardItem("b", 0, prompt)] + items[1:])  # whole prompt at once, mid-batch
    company = runner.forward([ForwardItem("o0", 3, _ids(g, 2), 2), ForwardItem("b", 13, new, num_logits=4),
                              ForwardItem("o1", 21, _ids(g, 1))])[1]  # K+1 = 4 verified in one step
    return torch.cat(alone), company


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_do_not_depend_on_the_batch_or_k(tiny_llama, dtype):
    alone, company = _logits_alone_and_in_company(_runner(tiny_llama, dtype))
    assert torch.equal(alone, company)


def test_deterministic_logits_stay_close_to_the_default_path(tiny_llama):
    a, _ = _logits_alone_and_in_company(_runner(tiny_llama))
    b, _ = _logits_alone_and_in_company(_runner(tiny_llama, deterministic=False))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-6)


def _requests(n, seed, max_tokens=24):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = _ids(g, int(torch.randint(1, 14, (1,), generator=g)))
        out.append(GenerationRequest(f"r{i}", tuple((base * 3)[: 3 * len(base)]), max_tokens, ignore_eos=True))
    return out


def _cfg(path):
    return EngineConfig(model=str(path), max_model_len=MAX_LEN, max_num_seqs=16, max_prefill_tokens=64,
                        deterministic=True)


@pytest.fixture(scope="module")
def colocated(tiny_llama, tiny_draft_close):
    spec = SpecConfig(num_speculative_tokens=3, disable_by_batch_size=0)
    colo = build_colocated(_cfg(tiny_llama), EngineConfig(model=str(tiny_draft_close), max_model_len=MAX_LEN,
                                                          max_num_seqs=16, max_prefill_tokens=64), spec, show_progress=False)
    yield colo
    colo.close()


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_spec_equals_target_only_exactly(colocated, batch):
    target_only = SpecDecoder(colocated.target, None, SpecConfig(num_speculative_tokens=0), MAX_LEN)
    ref = Scheduler(target_only, (), 16).run(_requests(batch, batch))
    out = Scheduler(colocated.decoder, (), 16).run(_requests(batch, batch))
    assert [s.output for s in out] == [s.output for s in ref]  # exact: no tie is certified here
    assert sum(s.accepted for s in out) > 0


def test_tp2_spec_equals_target_only_exactly(tiny_llama, tiny_draft_close):
    from specsplit.parallel.group import TPGroup
    from tests.helpers.orphans import assert_gone

    spec = SpecConfig(num_speculative_tokens=3, disable_by_batch_size=0)
    group, tp, _ = TPGroup.launch(_cfg(tiny_llama), spec, 2, threads=1)
    try:
        draft = build_draft_engine(EngineConfig(model=str(tiny_draft_close), max_model_len=MAX_LEN, max_num_seqs=16,
                                                max_prefill_tokens=64), spec).engine
        for batch in (1, 4, 16):
            ref = Scheduler(SpecDecoder(tp, None, SpecConfig(num_speculative_tokens=0), MAX_LEN), (), 16).run(
                _requests(batch, batch))
            out = Scheduler(SpecDecoder(tp, draft, spec, MAX_LEN), (), 16).run(_requests(batch, batch))
            assert [s.output for s in out] == [s.output for s in ref], batch
            assert sum(s.accepted for s in out) > 0
    finally:
        pids = [p.pid for p in group.procs]
        group.close()
        assert_gone(pids)
