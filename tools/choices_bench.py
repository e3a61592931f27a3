"""Wall time of `n` choices of one prompt through running servers' HTTP APIs, alternating between
them, with each verifier's prefix-cache hits (docs/prefill.md, "Requests that arrive together").

    python tools/choices_bench.py --server old=http://127.0.0.1:8918 --server new=http://127.0.0.1:8917 \\
        [--rounds 7] [--repeat 5] [--n 4] [--max-tokens 32]

--server NAME=URL[,METRICS_URL]: the HTTP API's root, and where the verifier's Prometheus metrics
are (default URL/metrics: a colocated `specsplit serve`; a split stack's verifier has its own
--metrics-port).

Each round sends one `/v1/completions` request (`n` choices, temperature 1, a seed per round) to
every server in turn, the order reversed every other round, and reads the server's
`specsplit_prefix_cache_tokens_total{service="verifier"}` before and after it. The prompt starts
with the round's number, so no round reuses an earlier one's blocks; `--repeat` sets its length
(a 20-token sentence repeated). Prints each server's median seconds and the hits per request.
Start the servers yourself (`specsplit serve --target smollm2-135m --http-port P`; two trees side
by side for a before/after).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specsplit.rpc.metrics import parse_metrics  # noqa: E402

SENTENCE = "You are a helpful assistant for a travel agency. Answer questions about trips, hotels and flights politely. "


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()


def prefix_tokens(metrics_url: str) -> dict[str, float]:
    """The verifier's prefix-cache counters: {"hit": ..., "queried": ...} (0 where none are there)."""
    page = parse_metrics(_get(metrics_url).decode())
    return {o: page.get(f'specsplit_prefix_cache_tokens_total{{outcome="{o}",service="verifier"}}', 0.0)
            for o in ("hit", "queried")}


def complete(base: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True,
                    help="NAME=URL[,METRICS_URL]: the HTTP API's root (and the verifier's metrics), repeatable")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=5, help="the prompt's sentence repeated this many times")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    servers, metrics = {}, {}
    for s in args.server:
        name, urls = s.split("=", 1)
        servers[name], _, metrics[name] = urls.partition(",")
        metrics[name] = metrics[name] or f"{servers[name]}/metrics"
    model = {name: json.loads(_get(f"{base}/v1/models"))["data"][0]["id"] for name, base in servers.items()}
    runs: dict[str, list[tuple[float, float, float, int]]] = {name: [] for name in servers}
    for rnd in range(args.rounds):
        prompt = f"Round {rnd}. " + SENTENCE * args.repeat + "Question: what should I pack for a trip to Norway in winter?"
        order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
        for name in order:
            base = servers[name]
            before = prefix_tokens(metrics[name])
            t0 = time.perf_counter()
            out = complete(base, {"model": model[name], "prompt": prompt, "max_tokens": args.max_tokens, "n": args.n,
                                  "temperature": 1.0, "seed": rnd})
            seconds = time.perf_counter() - t0
            after = prefix_tokens(metrics[name])
            runs[name].append((seconds, after["hit"] - before["hit"], after["queried"] - before["queried"],
                               out["usage"]["prompt_tokens"]))
        print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1][0]:.2f} s" for k, v in runs.items()), flush=True)
    for name, v in runs.items():
        print(f"{name}: median {statistics.median(r[0] for r in v):.3f} s over {len(v)} requests "
              f"(n {args.n}, a {v[-1][3]}-token prompt); verifier prefix hits per request: "
              f"{statistics.median(r[1] for r in v):.0f} of {statistics.median(r[2] for r in v):.0f} prompt tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
