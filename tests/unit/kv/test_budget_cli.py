"""`specsplit profile`: the plan without serving, and refusals that name the numbers."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from specsplit.cli import main

SIZE = r"\d+(\.\d\d)? (B|KiB|MiB|GiB)"
SERVICE_KEYS = {"weights_bytes", "activation_peak_bytes", "non_torch_bytes", "kv_cache_bytes", "num_blocks",
                "block_size", "max_tokens", "budget_bytes"}
SMALL = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-prefill-tokens", "32"]


def _cli() -> list[str]:
    exe = Path(sys.executable).with_name("specsplit")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "import sys; from specsplit.cli import main; sys.exit(main())"]


def test_too_small_a_budget_exits_non_zero_naming_the_numbers(tiny_llama, tiny_draft_far):
    # dense kernels only: the byte counts below are sized for one copy of each weight
    env = dict(os.environ, SPECSPLIT_TEST_THREADS="1", OMP_NUM_THREADS="1", SPECSPLIT_LINEAR_KERNEL="dense")
    proc = subprocess.run(
        _cli() + ["profile", "--target", str(tiny_llama), "--draft", str(tiny_draft_far), "--colocated",
                  "--memory-budget", "600KiB", "--json", *SMALL],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode != 0
    msg = proc.stderr.strip().splitlines()[-1]
    assert msg.startswith("specsplit profile: memory budget 600.00 KiB (--memory-budget) cannot hold the weights")
    assert re.search(rf"verifier {SIZE} \+ drafter {SIZE} = {SIZE}", msg), msg
    assert proc.stdout == ""


def test_budget_below_max_model_len_exits_non_zero(tiny_llama, capsys):
    # 640 KiB: the weights (~450 KiB of parameters) fit, but weights + one 512-token sequence of KV
    # (256 KiB) do not, whatever the (noisy, RSS-based) non-torch and activation terms measure.
    rc = main(["profile", "--target", str(tiny_llama), "--memory-budget", "640KiB", "--json",
               "--max-model-len", "512", "--max-num-seqs", "1", "--max-prefill-tokens", "16"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "memory budget 640.00 KiB" in err and "--max-model-len 512" in err
    for part in ("weights", "activation peak", "non-torch"):
        assert re.search(rf"{part} {SIZE}", err), (part, err)


def test_json_plan(warm, tiny_llama, tiny_draft_far, capsys):
    rc = main(["profile", "--target", str(tiny_llama), "--draft", str(tiny_draft_far), "--colocated",
               "--memory-budget", "512MiB", "--json", *SMALL])
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["joint"] is True and plan["budget_bytes"] == 512 << 20
    assert set(plan["services"]) == {"verifier", "drafter"}
    for s in plan["services"].values():
        assert SERVICE_KEYS <= set(s)
    assert plan["services"]["verifier"]["max_tokens"] == plan["services"]["drafter"]["max_tokens"]

    rc = main(["profile", "--target", str(tiny_llama), "--draft", "ngram", "--memory-budget", "256MiB", "--json", *SMALL])
    split = json.loads(capsys.readouterr().out)
    assert rc == 0 and split["joint"] is False and split["budget_bytes"] == 256 << 20
    assert all(split["services"]["drafter"][k] == 0 for k in SERVICE_KEYS)
