"""A randomized soak of a real split stack through the OpenAI-compatible HTTP API.

`specsplit up` (the target and its default draft unless told otherwise) with a small KV cache,
so requests are preempted, and a mix of requests from several client threads: completions and
chat, streamed or not, n > 1, logprobs, echo, prompt_logprobs, stop strings, min_tokens, min_p,
top_k, penalties, seeds, a JSON schema; a quarter of the streams are dropped by the client
mid-way. Each round prints the status counts and each service's resident memory; at the end, the
running / waiting counts and every engine's free KV blocks. Exit 1 when a request got anything
but 200 (or was dropped by design), a non-streamed schema answer that finished with "stop" did
not parse, or a KV block stayed allocated.

    PYTHONPATH=. OMP_NUM_THREADS=1 python tools/http_soak.py [--rounds 3] [--requests 12] [--threads 8]
        [--seed 0] [--num-blocks 34] [--target smollm2-135m] [--draft DRAFT] [--log soak.log]

The nineteenth session's run of it found a verifier bug (prompt_logprobs with chunked prefill
over a cached prefix), fixed in specsplit/engine.py.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LONG = "Summarize the following text. " + " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
PROMPTS = [LONG, "The capital of France is", "Write a haiku about the sea.", "List three colors:", "def fib(n):",
           "Explain speculative decoding in one sentence.", "1, 2, 3, 4,", "Once upon a time"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def random_body(rng: random.Random, model: str) -> tuple[str, dict]:
    b = {"model": model, "max_tokens": rng.choice([1, 16, 64, 150, 300]), "temperature": rng.choice([0, 0, 0.7, 1.0]),
         "stream": rng.random() < 0.5}
    for field, p, value in (("seed", 0.3, rng.randrange(1000)), ("n", 0.2, rng.choice([2, 3])),
                            ("stop", 0.2, [rng.choice([".", "\n", " the"])]), ("frequency_penalty", 0.15, 0.5),
                            ("top_k", 0.1, 20), ("min_p", 0.1, 0.05)):
        if rng.random() < p:
            b[field] = value
    if rng.random() < 0.15:
        b["min_tokens"] = min(3, b["max_tokens"])
    if rng.random() < 0.5:
        b["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        if rng.random() < 0.2:
            b["logprobs"], b["top_logprobs"] = True, 2
        if rng.random() < 0.1 and "min_tokens" not in b:
            b["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
        if rng.random() < 0.1 and not b["stream"]:
            b["prompt_logprobs"] = 1
        return "/v1/chat/completions", b
    b["prompt"] = rng.choice(PROMPTS)
    if rng.random() < 0.2:
        b["logprobs"] = 1
    if rng.random() < 0.1 and not b["stream"]:
        b["echo"] = True
    if rng.random() < 0.1 and not b["stream"]:
        b["prompt_logprobs"] = 2
    return "/v1/completions", b


def client(port: int, model: str, seed: int, n: int, out: dict, bad: list, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        path, body = random_body(rng, model)
        drop = body["stream"] and rng.random() < 0.25
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            if drop:
                r.read(200)
                outcome = "dropped by the client"
            else:
                data, outcome = r.read(), r.status
                if r.status != 200:
                    with lock:
                        bad.append((r.status, path, body, data[:300]))
                elif body["stream"]:
                    if not data.decode().rstrip().endswith("data: [DONE]"):
                        raise AssertionError("a stream did not end with [DONE]")
                elif "response_format" in body:
                    for c in json.loads(data)["choices"]:
                        if c["finish_reason"] == "stop":
                            json.loads(c["message"]["content"])
        except Exception as e:  # noqa: BLE001 - reported, counted
            outcome = f"{type(e).__name__}: {e}"[:160]
            with lock:
                bad.append(("exception", path, body, outcome))
        finally:
            conn.close()
        with lock:
            out[outcome] = out.get(outcome, 0) + 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default=None, help="default: the target's default draft")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=12, help="per client thread and round")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=34, help="the engines' KV blocks (16 tokens each)")
    p.add_argument("--log", default="http_soak.log", help="the services' log")
    a = p.parse_args(argv)

    import grpc
    import psutil

    from specsplit.defaults import resolve_draft
    from specsplit.gateway.launch import specsplit_up
    from specsplit.rpc.health import free_port
    from specsplit.v1 import gateway_pb2, gateway_pb2_grpc

    port = free_port()
    extra = ["--http-port", str(port), "--num-blocks", str(a.num_blocks), "--block-size", "16", "--max-num-seqs", "6",
             "--max-model-len", "512", "--threads", "1"]
    ok = True
    with specsplit_up(a.target, resolve_draft(a.target, a.draft), extra=extra, log=a.log, log_level="INFO",
                      env={"OMP_NUM_THREADS": "1"}, cwd=str(REPO)) as up:
        model = a.target
        children = psutil.Process(up.proc.pid).children(recursive=True)

        def rss() -> dict[str, float]:
            out = {}
            for c in children:
                name = next((w for w in c.cmdline() if w in ("verifier", "drafter", "gateway")), str(c.pid))
                out[name] = round(c.memory_info().rss / 2**20, 1)
            return out

        for rnd in range(a.rounds):
            counts: dict = {}
            bad: list = []
            lock = threading.Lock()
            t0 = time.monotonic()
            threads = [threading.Thread(target=client, args=(port, model, 1000 * (a.seed + rnd) + i, a.requests, counts,
                                                             bad, lock)) for i in range(a.threads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            print(f"round {rnd}: {time.monotonic() - t0:.0f} s, {counts}, resident MiB {rss()}", flush=True)
            for x in bad[:5]:
                print("   not 200:", x, flush=True)
            ok = ok and not bad
        time.sleep(2)
        with grpc.insecure_channel(up.address) as ch:
            info = gateway_pb2_grpc.GatewayStub(ch).GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=10)
        print(f"after: {info.num_running} running, {info.num_waiting} waiting; "
              + ", ".join(f"{s.name} {s.kv.free_blocks} of {s.kv.num_blocks} KV blocks free" for s in info.services))
        ok = ok and info.num_running == 0 and all(s.kv.free_blocks == s.kv.num_blocks for s in info.services)
    print("soak:", "clean" if ok else "FAILED (see above and the log)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
