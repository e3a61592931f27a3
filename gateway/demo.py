"""`make demo`: start the split services (`specsplit up`), stream one speculative generation
through the gateway, print the tokens as they arrive and the acceptance rate, then run the same
prompt target-only (speculation disabled for that request) and print both speeds side by side;
stop everything.

    python -m specsplit.gateway.demo [--target smollm2-135m] [--draft smollm2-135m-eagle3+ngram] [--max-tokens 96] [--port 0]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import grpc

from specsplit.v1 import gateway_pb2, gateway_pb2_grpc

PROMPT = (
    "Here is a Python function that adds two numbers:\n"
    "```python\ndef add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n```\n"
    "Here is the same function for multiplication:\n```python\n"
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="smollm2-135m-eagle3+ngram",
                   help="the default draft: the EAGLE-3 head with prompt lookup in front (or a model, or ngram)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--port", type=int, default=0, help="gateway port (0 = a free one)")
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args(argv)
    from specsplit.gateway.launch import specsplit_up

    print(f"$ specsplit up --target {args.target} --draft {args.draft} --port {args.port}", flush=True)
    try:
        with specsplit_up(args.target, args.draft, port=args.port, max_model_len=args.max_model_len, max_num_seqs=4) as up:
            print(f"[the gateway serves on {up.address}]")
            return _generate(up.address, args)
    except RuntimeError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 1
    finally:
        print("[services stopped]")


def _generate(address: str, args) -> int:
    try:
        with grpc.insecure_channel(address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            info = stub.GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=10)
            print(f"\n[{info.mode}: target {info.target_model}, draft {info.draft_model or 'none'}, "
                  f"K={info.num_speculative_tokens}, max_model_len {info.max_model_len}]")
            for s in info.services:
                kv = f"{s.kv.free_blocks}/{s.kv.num_blocks} KV blocks free" if s.kv.paged else "no KV cache"
                print(f"  {s.name:8s} {s.model} on {s.device or '-'}: {kv}")
            # one short request first: the services' first-call costs stay out of both timings
            for _ in stub.Generate(gateway_pb2.GenerateRequest(prompt=args.prompt, max_tokens=4), timeout=600):
                pass
            print(f"\nprompt: {json.dumps(args.prompt)}\n" + "-" * 72)
            spec = _timed(stub, gateway_pb2.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens), echo=True)
            alone = _timed(stub, gateway_pb2.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens,
                                                             speculation=gateway_pb2.Speculation(disable=True)))
        u = spec.last.usage
        rate = u.accepted_draft_tokens / u.proposed_draft_tokens if u.proposed_draft_tokens else 0.0
        print("\n" + "-" * 72)
        print(f"speculative: {spec.tokens} tokens in {spec.seconds:.2f}s = {spec.tokens_per_s:.1f} tok/s "
              f"(first after {spec.first:.2f}s), finish={spec.last.finish_reason}")
        print(f"target-only: {alone.tokens} tokens in {alone.seconds:.2f}s = {alone.tokens_per_s:.1f} tok/s "
              f"(the same prompt, speculation disabled for that request)")
        same = "the same tokens" if spec.token_ids == alone.token_ids else "DIFFERENT tokens"
        print(f"speculative / target-only: {spec.tokens_per_s / alone.tokens_per_s:.2f}x, {same}")
        print(f"acceptance rate {rate:.2f}: {u.accepted_draft_tokens} of {u.proposed_draft_tokens} drafted tokens accepted")
        return 0
    except grpc.RpcError as e:
        print(f"\ndemo: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


class _Run:
    def __init__(self):
        self.token_ids: list[int] = []
        self.first = 0.0
        self.seconds = 0.0
        self.last = None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _timed(stub, req, echo: bool = False) -> _Run:
    run = _Run()
    t0 = time.perf_counter()
    for msg in stub.Generate(req, timeout=600):
        if not run.token_ids:
            run.first = time.perf_counter() - t0
        run.token_ids.extend(msg.token_ids)
        if echo:
            sys.stdout.write(msg.text)
            sys.stdout.flush()
        run.last = msg
    run.seconds = time.perf_counter() - t0
    return run


if __name__ == "__main__":
    sys.exit(main())
