"""The reference's next-token logits as the verifier scores them for a request with penalties,
logit_bias and a grammar: what certifies a greedy near-tie of the *constrained* target
(tests/helpers/greedy.py)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

from specsplit.sampling.grammar import GrammarCompiler, apply_masks
from specsplit.sampling.params import SamplingParams
from specsplit.sampling.penalties import penalize
from tests.helpers.greedy import NextLogits


def constrained_next_logits(next_logits: NextLogits, params: SamplingParams, prompt_len: int,
                            compiler: GrammarCompiler | None) -> NextLogits:
    """next_logits with the request's penalties (the context past prompt_len is generated), then its
    grammar's mask after those generated tokens (a fresh matcher), applied."""

    def f(context: Sequence[int]):
        context = list(context)
        rows = penalize(next_logits(context)[None], params, context[:prompt_len], context[prompt_len:])
        if params.grammar is not None:
            st = compiler.state(params.grammar)
            st.sync(context[prompt_len:])
            apply_masks(rows, st.masks(())[1])
        return rows[0]

    return f


def serve_smollm_http(root, max_model_len: int, target: str = "smollm2-135m", max_num_seqs: int = 2):
    """A real `serve` of SmolLM2-135M (or `target`: a copy of its directory) with the n-gram draft
    and the HTTP API (1 thread, 30 s grammar timeout) for the structured-output and tools tests:
    yields the process (its `.http_port` set), stops it and checks it exited 0."""
    from tests.services.procs import ServiceProcess, free_port

    port, http_port = free_port(), free_port()
    proc = ServiceProcess("serve", ["serve", "--target", target, "--draft", "ngram", "--port", str(port),
                                    "--http-port", str(http_port), "--max-model-len", str(max_model_len),
                                    "--max-num-seqs", str(max_num_seqs), "--threads", "1", "--grammar-timeout", "30"],
                          root, port)
    proc.serving(300)
    proc.http_port = http_port
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_tail()


@contextmanager
def constrained_target(model, max_tokens: int):
    """Target-only greedy generation in-process, with whatever penalties and grammar the params
    carry: yields (run(ids, params) -> output tokens, the target's grammar compiler)."""
    from specsplit.config import EngineConfig, SpecConfig
    from specsplit.factory import build_colocated
    from specsplit.request import GenerationRequest
    from specsplit.scheduler import Scheduler

    colo = build_colocated(EngineConfig(model=str(model), max_model_len=256, max_prefill_tokens=128, max_num_seqs=1),
                           None, SpecConfig(num_speculative_tokens=0), show_progress=False)

    def run(ids, params):
        (state,) = Scheduler(colo.decoder, colo.eos_token_ids, 1).run([GenerationRequest("ref", tuple(ids), max_tokens,
                                                                                        params=params)])
        return state.output

    try:
        yield run, colo.target.grammars
    finally:
        colo.close()
