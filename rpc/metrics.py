"""Prometheus metrics of every specsplit service (one process = one registry, the default one).

Served over HTTP by `start_metrics_server` when a service gets --metrics-port. Names:

  specsplit_requests_total{outcome}                 gateway: length, stop, abort, cancelled, or a status code
  specsplit_prompt_tokens_total, specsplit_generation_tokens_total
  specsplit_preemptions_total                       gateway: sequences preempted for KV (requeued, recomputed)
  specsplit_draft_tokens_proposed_total, specsplit_draft_tokens_accepted_total
  specsplit_draft_position_proposed_total{position}, specsplit_draft_position_accepted_total{position}
                                                    acceptance per draft position = accepted / proposed
  specsplit_step_seconds{phase}                     gateway: draft, verify (engine time), network, total
  specsplit_steps_total{k}                          gateway: steps by the drafts per sequence the step asked for
                                                    (the K policy's choice; 0: speculation off that step)
  specsplit_sequences{service,state}                running / waiting sequences
  specsplit_drafter_up                              gateway: 0 while decoding target-only after a drafter failure
  specsplit_drafter_catch_up_pieces_total           gateway: bounded pieces the drafter computed to catch up with a
                                                    sequence (after a re-sync, or after speculation was off)
  specsplit_branches_total{outcome}                 gateway, pre-drafting: branches that came true (hit) or not (miss);
                                                    hit rate = hit / (hit + miss); branches per step = total / steps
  specsplit_draft_wait_seconds                      gateway, pre-drafting: per step, the time the verifier waited for drafts
  specsplit_engine_seconds{service,op}              drafter / verifier: engine time per session message
  specsplit_kv_blocks{service,state}                used / free KV blocks of every engine in the process
  specsplit_prefix_cache_tokens_total{service,outcome}
                                                    prompt tokens looked up (queried) / found computed (hit) in the
                                                    prefix cache; hit rate = hit / queried
  specsplit_prefix_cache_blocks{service}            KV blocks registered in the prefix cache (held or evictable)
  specsplit_suffix_cache{unit}                      suffix drafter: shared cache size (tokens, outputs)
  specsplit_hybrid_draft_tokens_total{source,outcome}
                                                    MODEL+ngram / MODEL+suffix: drafts by lookup or model, proposed / accepted
  specsplit_suffix_proposals_total, specsplit_suffix_proposed_tokens_total, specsplit_suffix_seconds_total
                                                    suffix drafter: steps that proposed, tokens, lookup time
"""
from __future__ import annotations

import logging

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specsplit.hybrid_drafter import HybridDrafter
from specsplit.protocols import DrafterTraits

log = logging.getLogger(__name__)
disable_created_metrics()  # no *_created series: counters and histograms only

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

REQUESTS = Counter("specsplit_requests", "Generate requests by outcome", ["outcome"])
PROMPT_TOKENS = Counter("specsplit_prompt_tokens", "Prompt tokens of admitted requests")
PREEMPTIONS = Counter("specsplit_preemptions", "Sequences preempted when the KV caches ran out (requeued, recomputed)")
GENERATION_TOKENS = Counter("specsplit_generation_tokens", "Tokens streamed to clients")
DRAFT_PROPOSED = Counter("specsplit_draft_tokens_proposed", "Draft tokens sent to the verifier")
DRAFT_ACCEPTED = Counter("specsplit_draft_tokens_accepted", "Draft tokens the verifier accepted")
TREE_NODES = Counter("specsplit_draft_tree_nodes", "Branch nodes of draft trees verified, beyond their main chains "
                     "(--tree-nodes)")
POSITION_PROPOSED = Counter("specsplit_draft_position_proposed", "Drafts proposed at each position", ["position"])
POSITION_ACCEPTED = Counter("specsplit_draft_position_accepted", "Drafts accepted at each position", ["position"])
STEP_SECONDS = Histogram("specsplit_step_seconds", "Step latency by phase", ["phase"], buckets=_STEP_BUCKETS)
STEPS = Counter("specsplit_steps", "Steps by the drafts per sequence they asked for (the K policy's choice; "
                "0: speculation off that step)", ["k"])
SEQUENCES = Gauge("specsplit_sequences", "Sequences by state", ["service", "state"])
BRANCHES = Counter("specsplit_branches", "Pre-drafted branches by outcome (hit: the step emitted its prefix)", ["outcome"])
DRAFT_WAIT = Histogram("specsplit_draft_wait_seconds", "Per step: seconds the verifier waited for drafts (pre-drafting)",
                       buckets=_STEP_BUCKETS)
DRAFTER_UP = Gauge("specsplit_drafter_up", "1 while speculation can use the drafter")
CATCH_UP_PIECES = Counter("specsplit_drafter_catch_up_pieces", "Bounded catch-up pieces sent to the drafter "
                          "(a re-synced sequence, or one after speculation was off)")
ENGINE_SECONDS = Histogram("specsplit_engine_seconds", "Engine time per session message", ["service", "op"],
                           buckets=_STEP_BUCKETS)


class KvCollector:
    """Reads used / free blocks of each engine's block manager at scrape time."""

    def __init__(self):
        self.engines: dict[str, object] = {}

    def collect(self):
        g = GaugeMetricFamily("specsplit_kv_blocks", "KV cache blocks by state", labels=["service", "state"])
        for name, engine in list(self.engines.items()):
            bm = engine.block_manager  # DrafterTraits / VerifierTraits
            if bm is None:
                continue
            g.add_metric([name, "used"], bm.num_used_blocks)
            g.add_metric([name, "free"], bm.num_free_blocks)
        yield g
        yield from _prefix_cache_metrics(self.engines)
        yield from _suffix_metrics([e.suffix for e in list(self.engines.values())
                                    if isinstance(e, DrafterTraits) and e.suffix is not None])
        hybrids = [e for e in list(self.engines.values()) if isinstance(e, HybridDrafter)]
        if hybrids:
            g = CounterMetricFamily("specsplit_hybrid_draft_tokens", "MODEL+lookup drafts by who drafted them "
                                    "(lookup, model) and outcome (proposed, accepted)", labels=["source", "outcome"])
            for source, (proposed, accepted) in hybrids[0].judged.items():
                g.add_metric([source, "proposed"], proposed)
                g.add_metric([source, "accepted"], accepted)
            yield g


def _prefix_cache_metrics(engines: dict):
    """Automatic prefix caching (kv/block_manager.py): prompt tokens looked up and found computed
    (hit rate = hit / queried), and the registered blocks a new prompt can reuse."""
    managers = {name: e.block_manager for name, e in list(engines.items()) if e.block_manager is not None}
    if not managers:
        return
    tokens = CounterMetricFamily("specsplit_prefix_cache_tokens", "Prompt tokens looked up in the prefix cache "
                                 "(queried) and found there (hit)", labels=["service", "outcome"])
    blocks = GaugeMetricFamily("specsplit_prefix_cache_blocks", "KV blocks registered in the prefix cache",
                               labels=["service"])
    for name, bm in managers.items():
        tokens.add_metric([name, "queried"], bm.prefix_queried_tokens)
        tokens.add_metric([name, "hit"], bm.prefix_hit_tokens)
        blocks.add_metric([name], bm.num_cached_blocks)
    yield tokens
    yield blocks


def _suffix_metrics(drafters):
    """A suffix drafter's shared cache and its proposals (specsplit/suffix_drafter.py)."""
    if not drafters:
        return
    d = drafters[0]
    cache = GaugeMetricFamily("specsplit_suffix_cache", "The suffix drafter's shared cache of finished outputs",
                              labels=["unit"])
    cache.add_metric(["tokens"], d.shared.num_tokens)
    cache.add_metric(["outputs"], d.shared.outputs)
    yield cache
    proposals = CounterMetricFamily("specsplit_suffix_proposals", "Suffix drafter steps that proposed drafts")
    proposals.add_metric([], d.proposals)
    yield proposals
    tokens = CounterMetricFamily("specsplit_suffix_proposed_tokens", "Draft tokens the suffix drafter proposed")
    tokens.add_metric([], d.proposed_tokens)
    yield tokens
    busy = CounterMetricFamily("specsplit_suffix_seconds", "Seconds the suffix drafter spent in lookups and updates")
    busy.add_metric([], d.busy_s)
    yield busy


KV = KvCollector()
REGISTRY.register(KV)


def watch_kv(name: str, engine) -> None:
    KV.engines[name] = engine


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus text page -> {'name{labels}': value} (comments and blank lines skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def read_metrics(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> dict[str, float]:
    """A process's /metrics page (its --metrics-port, or a gateway's HTTP port), parsed: what the
    tools and tests read a running stack's counters with."""
    import urllib.request

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        return parse_metrics(r.read().decode())


def start_metrics_server(host: str, port: int | None) -> None:
    """Prometheus's page on host:port in a daemon thread; nothing when `port` is None. RuntimeError,
    saying which flag to change, when the port cannot be bound."""
    if port is None:
        return
    try:
        start_http_server(port, addr=host)
    except OSError as e:
        raise RuntimeError(f"cannot serve metrics on {host}:{port} ({e.strerror or e}); is the port in use? "
                           "Pick another --metrics-port") from None
    log.info("Prometheus metrics on http://%s:%d/metrics", host, port)
