"""A trained version as a Hugging Face model directory an evaluation harness loads as it is.

Why: a run's per-version snapshots (:mod:`.snapshots`) hold what the engines need (weights,
``config.json``, the tokenizer files) but not the chat template or everything else a tokenizer may
keep, and they are pruned as versions retire. :func:`export_hf` writes one version as a complete
directory: the version's weights and ``config.json`` (its ``dtype`` set to what the tensors are),
and every tokenizer, chat-template and generation file of the source model, so
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` and vLLM load it and render prompts as the
run did. ``RUN_DIR/hf_final`` is the last version of every run; ``dora export`` writes any kept one.

Weight files are hard-linked when the output is on the snapshot's file system (a 60 GB checkpoint
costs no copy; snapshots are immutable once written), else copied. The directory appears whole or
not at all (written beside it, then renamed).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

#: Files of a model directory that describe its tokenizer, chat template and generation settings.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "generation_config.json")
TOKENIZER_DIRS = ("additional_chat_templates",)
MANIFEST = "dora_export.json"
FINAL_DIR = "hf_final"
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def weight_files(weights_dir: Path) -> list[Path]:
    """``model.safetensors``, or the index and its shards."""
    index = weights_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [index, *(weights_dir / s for s in shards)]
    single = weights_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {weights_dir}")
    return [single]


def tensors_dtype(path: Path) -> str | None:
    """The dtype of a safetensors file's tensors when they share one (``float32`` ...), else None."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        kinds = {f.get_slice(k).get_dtype() for k in f.keys()}
    return _DTYPES.get(kinds.pop()) if len(kinds) == 1 else None


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst)


def export_hf(weights_dir: str | Path, model_dir: str | Path, out: str | Path, *, version: int | None = None,
              dtype: str | None = None) -> Path:
    """Write ``out``: the weights and ``config.json`` of ``weights_dir`` (a snapshot, or the model
    directory itself for version 0), cast to ``dtype`` when given, plus every tokenizer / chat
    template / generation file of ``model_dir``. An existing ``out`` is replaced."""
    import torch

    weights_dir, model_dir, out = Path(weights_dir), Path(model_dir), Path(out)
    files = weight_files(weights_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if dtype is None:
        for f in files:
            _link_or_copy(f, tmp / f.name)
    else:
        from safetensors.torch import load_file, save_file

        for f in files:
            if f.suffix == ".json":
                shutil.copy2(f, tmp / f.name)
                continue
            state = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v) for k, v in load_file(str(f)).items()}
            save_file(state, str(tmp / f.name), metadata={"format": "pt"})
    config = json.loads((weights_dir / "config.json").read_text())
    held = tensors_dtype(tmp / files[-1].name)
    if held:  # say what the tensors are, so a loader's dtype="auto" keeps the trained precision
        for key in ("dtype", "torch_dtype"):
            if key in config or (key == "dtype" and "torch_dtype" not in config):
                config[key] = held
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        src = model_dir / name if (model_dir / name).is_file() else weights_dir / name
        if src.is_file():
            shutil.copy2(src, tmp / name)
    for name in TOKENIZER_DIRS:
        if (model_dir / name).is_dir():
            shutil.copytree(model_dir / name, tmp / name)
    (tmp / MANIFEST).write_text(json.dumps({"version": version, "weights": str(weights_dir.resolve()),
                                            "source_model": str(model_dir.resolve())}, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def kept_versions(run_dir: str | Path) -> list[int]:
    """Versions of a run with a complete snapshot, and 0 (the source model)."""
    from dora_megatron.weights.snapshots import SnapshotStore

    return sorted({0, *SnapshotStore(Path(run_dir) / "weights").versions()})


def version_weights(run_dir: str | Path, model_dir: str | Path, version: int) -> Path:
    """Where version ``version``'s weights are: the model directory for 0, else its snapshot."""
    from dora_megatron.weights.snapshots import SnapshotStore

    if version == 0:
        return Path(model_dir)
    store = SnapshotStore(Path(run_dir) / "weights")
    if version not in store.versions():
        raise FileNotFoundError(f"{run_dir}: no snapshot of version {version} (kept: "
                                f"{', '.join(map(str, kept_versions(run_dir)))}; older ones are pruned once no live "
                                "version or checkpoint needs them)")
    return store.path(version)


def export_final(run_dir: str | Path, model_dir: str | Path) -> tuple[int, Path]:
    """``RUN_DIR/hf_final``: the newest version of the run; returns ``(version, path)``."""
    run_dir = Path(run_dir)
    version = kept_versions(run_dir)[-1]
    return version, export_hf(version_weights(run_dir, model_dir, version), model_dir, run_dir / FINAL_DIR,
                              version=version)
