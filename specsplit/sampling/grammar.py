"""Structured output: a request's grammar (JSON schema, any JSON object, regex, EBNF), compiled
with xgrammar, and one matcher per sequence on the verifier.

Where the matcher lives: on the verifier (TargetEngine), the process that holds the target's
logits. The rule "a token the grammar refuses has probability 0 at that position" is applied in
one place, to the rows of each verify, in split and colocated mode alike, with no per-step mask
on the wire (a mask is V/8 bytes per row: 6 KB per verified position for a 49k vocabulary). The
gateway compiles each grammar at admission (bounded in time, off the step thread) so a bad one is
an INVALID_ARGUMENT before anything is allocated; colocated, the verifier shares that compiler and
its cache, so the step thread only looks the grammar up. Split, the verifier compiles it again on
its add (the same text, its own cache; the gateway's bound has shown it compiles in time).
A model drafter may hold a matcher too (DraftEngine, to draft inside the grammar): an optimization
only; what is emitted is decided by the verifier's masks alone.

One verify of a sequence with drafts d_0 .. d_{k-1} (GrammarState.masks):
  * the matcher advances along the drafts; the first draft it refuses (d_c) cuts the draft: row j
    (j <= c) gets the mask of the state after d_0 .. d_{j-1}; nothing after d_c is verified;
  * the matcher rolls back to the step's start; the verifier's emitted tokens are accepted into it
    at the next verify (GrammarState.sync: it follows the sequence's tokens, through abandoned
    steps and preemption too).
Whether d_c itself stays in the verify depends on how the sequence accepts (TargetEngine):
greedy / coupled sequences drop it (the masked target never picks it: the bonus at c is the
target's own token, exactly), sampled ones keep it as a draft that is surely rejected (p(d_c) =
0), so the token at c comes from the residual max(0, p - q) as the rejection sampler requires;
sampling it from p instead would bias the output (the cut depends on the draft, which the draft's
other tokens are correlated with).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Sequence

import torch

from specsplit.sampling.params import Grammar
from specsplit.sampling.rejection import matched_prefix

log = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 10.0  # a grammar that does not compile within this is refused
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped first) ...
MAX_CACHED_BYTES = 256 * 2**20  # ... and at most this many bytes of them (xgrammar's own count)


class GrammarError(ValueError):
    """A grammar that cannot be used (does not parse, does not compile in time): a client error."""


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - a pinned dependency
        raise GrammarError("structured output needs the xgrammar package (pip install xgrammar)") from e
    return xgrammar


def _size(compiled) -> int:
    try:
        return int(compiled.memory_size_bytes)
    except Exception:  # pragma: no cover - older xgrammar
        return 0


class GrammarCompiler:
    """Grammars compiled for one tokenizer, cached by (kind, text), each compile bounded in time.

    tokenizer: a transformers tokenizer, or a callable returning one (loaded on first use: a split
    verifier loads it only when a request brings a grammar). vocab_size: the model's logits width
    (may exceed the tokenizer's; the extra ids are never allowed). stop_token_ids: the model's EOS
    ids, the tokens that end a complete output.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, max_cached: int = MAX_CACHED_GRAMMARS,
                 max_cached_bytes: int = MAX_CACHED_BYTES):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.timeout_s = timeout_s
        self.max_cached = max_cached
        self.max_cached_bytes = max_cached_bytes
        self._cached_bytes = 0
        self._lock = threading.Lock()  # the cache and the in-flight compiles (held briefly)
        self._build_lock = threading.Lock()  # building the tokenizer's vocabulary table (once)
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self.compiles = 0  # grammars compiled (cache misses), for tests and metrics

    def _xgr_compiler(self):
        """xgrammar's compiler for this tokenizer, built on first use (on a compile thread, so the
        first request's time bound covers loading the tokenizer, never a lock without a bound)."""
        with self._build_lock:
            if self._compiler is None:
                xgr = _xgr()
                tok = self._tokenizer() if callable(self._tokenizer) and not hasattr(self._tokenizer, "encode") \
                    else self._tokenizer
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def warm(self) -> float:
        """Load the tokenizer and build its vocabulary table now (in the caller's thread) instead of
        on the first grammar: -> seconds it took (0 when already built)."""
        t0 = time.perf_counter()
        built = self._compiler is not None
        self._xgr_compiler()
        return 0.0 if built else time.perf_counter() - t0

    def _compile_now(self, g: Grammar):
        compiler = self._xgr_compiler()
        try:
            if g.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if g.kind == "json_schema":
                try:
                    schema = json.loads(g.text)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
                if not isinstance(schema, dict):
                    raise GrammarError("the JSON schema must be a JSON object")
                return compiler.compile_json_schema(g.text, any_whitespace=False)
            if g.kind == "regex":
                return compiler.compile_regex(g.text)
            if g.kind == "ebnf":
                return compiler.compile_grammar(g.text)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar's parse errors: RuntimeError, InvalidJSONError, ...
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GrammarError(f"the {g.kind} grammar does not compile: {first[:300]}") from None
        raise GrammarError(f"unknown grammar kind {g.kind!r}")

    def _compile_and_cache(self, key, g: Grammar):
        """On a compile thread: compile, then cache (before the waiting caller wakes up)."""
        t0 = time.perf_counter()
        try:
            compiled = self._compile_now(g)
        except BaseException:
            with self._lock:
                self._inflight.pop(key, None)
            raise
        # once per distinct grammar (then cached); the first also loads the tokenizer's table
        log.info("grammar compiled: %s of %d characters in %.2fs", g.kind, len(g.text), time.perf_counter() - t0)
        with self._lock:
            self._inflight.pop(key, None)
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            self._cached_bytes += _size(compiled)
            # The newest stays even when it alone is over the bytes (sequences hold their own
            # reference: dropping a grammar from the cache frees it once they end).
            while len(self._cache) > 1 and (len(self._cache) > self.max_cached
                                            or self._cached_bytes > self.max_cached_bytes):
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= _size(old)
        return compiled

    def submit(self, g: Grammar) -> Future:
        """The grammar's compile, not waited for: a done future when it is cached, else the compile
        in flight (started on the compiler's threads when none is). Its result() is the compiled
        grammar, or raises GrammarError (invalid, does not compile)."""
        try:
            g.validate()
        except ValueError as e:
            future = Future()
            future.set_exception(GrammarError(str(e)))
            return future
        key = g.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                future = Future()
                future.set_result(self._cache[key])
                return future
            future = self._inflight.get(key)
            if future is None:
                future = self._pool.submit(self._compile_and_cache, key, g)
                self._inflight[key] = future
                self.compiles += 1
        return future

    def compile(self, g: Grammar, timeout_s: float | None = None):
        """The compiled grammar (cached), or GrammarError: invalid, or not compiled within the
        bound (it goes on compiling in the background and lands in the cache if it finishes)."""
        future = self.submit(g)
        bound = self.timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=bound)
        except FutureTimeout:
            raise GrammarError(f"the {g.kind} grammar did not compile within {bound:g} s; simplify it "
                               f"(fewer properties, alternatives or nesting)") from None

    def state(self, g: Grammar) -> "GrammarState":
        """A fresh matcher for one sequence (compiles, or takes the cached grammar)."""
        return GrammarState(self.compile(g), self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One sequence's matcher on the verifier; follows the sequence's generated tokens.

    A dead end (a state no token can leave: the tokens so far spell a prefix of the language that
    no token continues, e.g. a word that begins a longer one when no token holds the rest) allows
    the stop tokens only: the output ends there, as it would with the target alone."""

    def __init__(self, compiled, vocab_size: int):
        xgr = _xgr()
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.accepted: list[int] = []  # generated tokens the matcher has taken, in order
        self.stop_ids = list(self.matcher.stop_token_ids)
        self.dead_end = False  # a stop token ended the output at a dead end (after `accepted`)

    def sync(self, generated: Sequence[int]) -> None:
        """Make the matcher's tokens the sequence's generated tokens: roll back what is no longer
        there (an abandoned step), accept what is new. Tokens after the grammar terminated (its
        stop token) are ignored: the request ends there."""
        same = matched_prefix(self.accepted, generated)
        if same < len(self.accepted):
            self.matcher.rollback(len(self.accepted) - same)
            del self.accepted[same:]
        if self.dead_end and len(generated) > len(self.accepted):
            return
        self.dead_end = False
        for t in generated[same:]:
            if self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(int(t)):
                if int(t) in self.stop_ids and self._stuck():
                    self.dead_end = True
                    break
                raise GrammarError(f"generated token {t} is outside the grammar (its mask was not applied)")
            self.accepted.append(int(t))

    def masks(self, drafts: Sequence[int]) -> tuple[int, torch.Tensor]:
        """(c, bitmask [c + 1, ceil(V / 32)] int32): c = the drafts the grammar accepts in a row
        (c < len(drafts): d_c is the first it refuses), row j = the tokens allowed after d_0 ..
        d_{j-1}. Rows of a terminated grammar or a dead end allow its stop tokens only. The matcher
        ends where it started."""
        bitmask = self._xgr.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        if self.dead_end:
            self._stop_only(bitmask, 0)
            return 0, bitmask[:1]
        taken = 0
        for j in range(len(drafts) + 1):
            self._fill(bitmask, j)
            if j == len(drafts) or self.matcher.is_terminated() or not self.matcher.accept_token(int(drafts[j])):
                break
            taken += 1
        if taken:
            self.matcher.rollback(taken)
        return taken, bitmask[: taken + 1]

    def _stop_only(self, bitmask: torch.Tensor, j: int) -> None:
        bitmask[j] = 0
        for t in self.stop_ids:
            word, bit = divmod(t, 32)
            bitmask[j, word] |= (1 << bit) if bit < 31 else -(1 << 31)  # int32 words

    def _fill(self, bitmask: torch.Tensor, j: int) -> None:
        if self.matcher.is_terminated():
            self._stop_only(bitmask, j)
            return
        self.matcher.fill_next_token_bitmask(bitmask, j)
        if not bool(bitmask[j].any()):  # a dead end: nothing continues, the output stops here
            self._stop_only(bitmask, j)

    def _stuck(self) -> bool:
        row = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(row, 0)
        return not bool(row.any())


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [n, V] in place: in the first min(n, rows of bitmask) rows, tokens the mask refuses
    become -inf. A row past the masks is the bonus after a refused draft that a sampled sequence
    keeps (GrammarState.masks): never read, since that draft has probability 0 and is rejected."""
    xgr = _xgr()
    m = min(logits.shape[0], bitmask.shape[0])
    xgr.apply_token_bitmask_inplace(logits[:m], bitmask[:m].to(logits.device), vocab_size=logits.shape[1])
