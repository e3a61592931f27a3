"""lm-eval's `local-completions` against a live `specsplit serve`, checked against transformers.

    python tools/lm_eval_compare.py                      # SmolLM2-135M, n-gram drafts, both tasks
    python tools/lm_eval_compare.py --lm-eval-python /work/lmeval-venv/bin/python --draft none

1. starts `specsplit serve --target T --draft D --http-port P` (this Python: the project's);
2. runs lm-eval (`--lm-eval-python`: a Python with the `lm_eval` package and `transformers`, e.g. a
   venv of its own, `pip install lm-eval transformers`; default: this Python, or $LM_EVAL_PYTHON)
   with `--model local-completions`, the target's own tokenizer directory (no hub), on the local
   tasks in tools/eval/ (a 16-question multiple-choice task, scored by loglikelihood with echo +
   logprobs, and an 8-prompt generate_until task), logging every sample;
3. recomputes every loglikelihood lm-eval got with a transformers forward of the same checkpoint
   (fp32, the same token ids: lm-eval's own context/continuation split), and every greedy
   generation with transformers' greedy decoding cut at the same stop strings;
4. prints the metrics, the largest |difference| and a JSON report (--out); exits 1 when a
   loglikelihood differs by more than --tolerance (default 1e-3) or a generation differs.

Nothing is downloaded at run time (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set for lm-eval).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "tools" / "eval"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(port: int, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"specsplit serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"specsplit serve did not answer /health within {timeout:.0f} s")


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's LM._encode_pair with its huggingface backend (no special tokens): trailing spaces
    of the context move to the continuation; the continuation's ids are what follows the
    context's ids in the ids of the whole."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def reference_loglikelihood(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    import torch

    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        lsm = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [L, V]
    rows = lsm[len(ctx) - 1: len(ctx) + len(cont) - 1]  # row j scores cont[j]
    picked = rows.gather(1, torch.tensor(cont)[:, None])[:, 0]
    return float(picked.sum()), bool((rows.argmax(dim=-1) == torch.tensor(cont)).all())


def reference_generation(model, tok, context: str, until: list[str], max_gen_toks: int) -> str:
    import torch

    ids = tok(context, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_gen_toks, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    text = tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    for s in until:
        if s and s in text:
            text = text[: text.index(s)]
    return text


def _samples(out_dir: Path) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for path in glob.glob(str(out_dir / "**" / "samples_*.jsonl"), recursive=True):
        task = Path(path).name[len("samples_"):].rsplit("_", 1)[0]
        found[task] = [json.loads(line) for line in open(path)]
    return found


def _results(out_dir: Path) -> dict:
    paths = sorted(glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True))
    return json.loads(Path(paths[-1]).read_text())["results"] if paths else {}


def _args(sample: dict) -> list[tuple]:
    """A sample's requests' arguments: [(context, continuation | gen_kwargs), ...]."""
    a = sample["arguments"]
    if isinstance(a, dict):  # {"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...}
        return [(v["arg_0"], v["arg_1"]) for _, v in sorted(a.items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1]))]
    return [tuple(x) for x in a]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="ngram", help="the served draft (none: target alone)")
    p.add_argument("--lm-eval-python", default=os.environ.get("LM_EVAL_PYTHON", sys.executable))
    p.add_argument("--tasks", default="specsplit_mc,specsplit_gen")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="lm-eval's --batch_size: prompts per /v1/completions request (a batch of prompts)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="torch threads of the server")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--keep", default=None, help="keep lm-eval's output in this directory")
    p.add_argument("--http-port", type=int, default=None,
                   help="use the `specsplit serve --http-port` already running on this port (serving --target)")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specsplit.models.loader import hf_dir_for

    hf_dir = hf_dir_for(args.target)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="lm-eval-"))
    work.mkdir(parents=True, exist_ok=True)
    port, http_port = _free_port(), args.http_port or _free_port()
    serve = [sys.executable, "-m", "specsplit.cli", "serve", "--target", args.target, "--port", str(port),
             "--http-port", str(http_port), "--max-model-len", str(args.max_model_len), "--max-num-seqs", "4"]
    if args.draft != "none":
        serve += ["--draft", args.draft]
    if args.threads:
        serve += ["--threads", str(args.threads)]
    log = open(work / "serve.log", "w")
    server = None
    if args.http_port is None:
        server = subprocess.Popen(serve, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        if server is not None:
            _wait_http(http_port, server, 900)
        model_args = ",".join([
            f"model={args.target}", f"base_url=http://127.0.0.1:{http_port}/v1/completions",
            "tokenizer_backend=huggingface", f"tokenizer={hf_dir}", "tokenized_requests=True",
            "num_concurrent=1", "max_retries=1", f"max_length={args.max_model_len}",
        ])
        cmd = [args.lm_eval_python, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
               "--tasks", args.tasks, "--include_path", str(TASK_DIR), "--batch_size", str(args.batch_size), "--log_samples",
               "--output_path", str(work / "out")]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        print("+", " ".join(cmd), flush=True)
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=TASK_DIR, check=True, env={**os.environ, **OFFLINE})
        lm_eval_s = time.monotonic() - t0
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
        log.close()

    samples, results = _samples(work / "out"), _results(work / "out")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    worst, n_ll, greedy_flips, gen_diff, n_gen = 0.0, 0, 0, [], 0
    for task, docs in samples.items():
        for doc in docs:
            for (context, second), resp in zip(_args(doc), doc["resps"]):
                got = resp[0]
                if isinstance(second, str):  # loglikelihood: (ll, is_greedy)
                    ll, is_greedy = float(got[0]), got[1] in (True, "True")
                    ref, ref_greedy = reference_loglikelihood(model, *encode_pair(tok, context, second))
                    worst = max(worst, abs(ll - ref))
                    greedy_flips += int(is_greedy != ref_greedy)
                    n_ll += 1
                else:  # generate_until: the text
                    kw = second if isinstance(second, dict) else {}
                    ref = reference_generation(model, tok, context, list(kw.get("until", [])),
                                               int(kw.get("max_gen_toks", 16)))
                    n_gen += 1
                    if got != ref:
                        gen_diff.append({"context": context, "server": got, "transformers": ref})
    report = {
        "target": args.target, "draft": args.draft, "tasks": args.tasks.split(","),
        "metrics": {t: {k: v for k, v in r.items() if isinstance(v, (int, float))} for t, r in results.items()},
        "loglikelihoods": n_ll, "max_abs_diff": worst, "tolerance": args.tolerance, "is_greedy_flips": greedy_flips,
        "generations": n_gen, "generations_differing": gen_diff, "lm_eval_seconds": round(lm_eval_s, 1),
        "cpu": _cpu(), "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    ok = n_ll > 0 and worst <= args.tolerance and not gen_diff
    print(f"{'OK' if ok else 'FAIL'}: {n_ll} loglikelihoods, max |lm-eval - transformers| = {worst:.2e} "
          f"(tolerance {args.tolerance:g}); {n_gen} generations, {len(gen_diff)} differ")
    return 0 if ok else 1


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    sys.exit(main())
