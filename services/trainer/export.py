"""`sparrow export`: a published policy version as an HF folder that transformers and vLLM load directly.

The trainer publishes versions in float32 (it trains in float32); the export casts the weights back
to the dtype the user's checkpoint had (bf16 stays bf16) and writes config, weights (safetensors),
every tokenizer and chat-template file (whether the template lives in tokenizer_config.json or in
chat_template.jinja) and generation_config.json, taken from the version folder and, for any file
it lacks, from the model the run started from.
"""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

from services.trainer.weights import MODEL_SIDE_FILES, POLICY

DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


class ExportError(ValueError):
    """A run folder or version that cannot be exported; one line."""


def trainer_dir(run_dir: Path) -> Path:
    """The trainer's folder of a run: RUN_DIR/trainer for `sparrow up`, or RUN_DIR itself for `sparrow trainer`."""
    for candidate in (run_dir / "trainer", run_dir):
        if (candidate / POLICY).is_dir():
            return candidate
    raise ExportError(f"{run_dir}: no published policy versions here (expected {run_dir}/trainer/{POLICY}/)")


def source_model(run_dir: Path) -> Path | None:
    """The model folder the run started from, as its trainer config names it (None when not found)."""
    for config in (run_dir / "services" / "trainer.toml", run_dir.parent / "services" / "trainer.toml"):
        try:
            model = tomllib.loads(config.read_text()).get("model_dir")
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if model and Path(model).is_dir():
            return Path(model)
    return None


def versions(folder: Path) -> list[int]:
    """The published policy versions of a trainer folder, oldest first."""
    out = []
    for path in (folder / POLICY).glob("v*"):
        if path.is_dir() and path.name[1:].isdigit() and (folder / POLICY / f"{path.name}.json").is_file():
            out.append(int(path.name[1:]))
    return sorted(out)


def export_policy(run_dir: str | Path, out: str | Path, version: int = 0, dtype: str = "auto") -> dict:
    """Write version `version` (0: the latest) of the run's policy as an HF folder `out`; returns what was written."""
    import torch
    from transformers import AutoModelForCausalLM

    run_dir, out = Path(run_dir), Path(out)
    folder = trainer_dir(run_dir)
    available = versions(folder)
    if not available:
        raise ExportError(f"{run_dir}: no published policy versions")
    version = version or available[-1]
    if version not in available:
        raise ExportError(f"{run_dir}: no policy version {version} (kept: {', '.join(map(str, available))})")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder")
    src = folder / POLICY / f"v{version:08d}"
    origin = source_model(run_dir)
    if dtype == "auto":
        dtype = _checkpoint_dtype(origin) if origin is not None else "float32"
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)} or auto")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    copied = []
    for name in MODEL_SIDE_FILES:
        for base in (src, origin):
            if base is not None and (base / name).is_file():
                shutil.copyfile(base / name, out / name)
                copied.append(name)
                break
    return {"version": version, "out": str(out), "dtype": dtype, "files": sorted(p.name for p in out.iterdir()),
            "from_model": str(origin) if origin else None, "side_files": copied}  # fmt: skip


def _checkpoint_dtype(model_dir: Path) -> str:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return dtype if dtype in DTYPES else "float32"
