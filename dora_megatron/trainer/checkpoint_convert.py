"""Hugging Face <-> Megatron ``dist_checkpointing`` conversion (the code behind ``dora convert``
and ``tools/convert_*.py``).

WHY: researchers start from HF checkpoints and want Megatron checkpoints in the layout they train
with (and back, to publish or to serve). The conversion builds the project's own Megatron model
(:mod:`dora_megatron.trainer.model`, the same one the trainer trains) in the requested TP/PP/EP
layout, fills it with :func:`dora_megatron.trainer.hf_weights.load_hf_into_model` and saves its
``sharded_state_dict`` under the key ``model`` (the key the trainer's checkpoints use too, so
``megatron-to-hf`` also reads a trainer checkpoint). ``dist_checkpointing`` reshards on load, so a
checkpoint of any layout can be read back in any other; the way back gathers with
:func:`dora_megatron.trainer.hf_weights.export_hf`. HF -> Megatron -> HF is bit-exact for fp32 (and,
through the fp32 trainer parameters, for bf16/fp16 sources written back in their dtype).

Each direction is a rank program (``python -m dora_megatron.trainer.checkpoint_convert hf-to-megatron ...``)
started with ``torch.distributed.run`` (gloo on CPU) when it needs more than one rank;
:func:`hf_to_megatron` / :func:`megatron_to_hf` launch it and wait.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dora_megatron.ports import free_port

log = logging.getLogger(__name__)

META_FILE = "dora_convert.json"
HF_META_DIR = "hf"  # config.json and tokenizer files of the source model, kept next to the checkpoint
HF_SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass(frozen=True)
class PipelineSplitArgs:
    """An uneven pipeline split of a conversion: Megatron's ``num_layers_in_first_pipeline_stage`` and
    ``num_layers_in_last_pipeline_stage`` (None: the even split), as ``trainer.megatron`` takes them."""

    first: int | None = None
    last: int | None = None

    def megatron(self) -> dict[str, int]:
        """The ``trainer.megatron`` fields of this split."""
        fields = {"num_layers_in_first_pipeline_stage": self.first, "num_layers_in_last_pipeline_stage": self.last}
        return {k: v for k, v in fields.items() if v is not None}

    def argv(self) -> list[str]:
        """The rank program's options for this split."""
        return [*(["--first-stage-layers", str(self.first)] if self.first is not None else []),
                *(["--last-stage-layers", str(self.last)] if self.last is not None else [])]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PipelineSplitArgs":
        return cls(args.first_stage_layers, args.last_stage_layers)


def add_split_arguments(parser: argparse.ArgumentParser) -> None:
    """``--first-stage-layers`` / ``--last-stage-layers`` (:class:`PipelineSplitArgs`) on ``parser``."""
    parser.add_argument("--first-stage-layers", type=int, default=None,
                        help="layers of the first pipeline stage (Megatron's num_layers_in_first_pipeline_stage); "
                             "the other stages split the rest evenly")
    parser.add_argument("--last-stage-layers", type=int, default=None,
                        help="layers of the last pipeline stage (Megatron's num_layers_in_last_pipeline_stage)")


# --------------------------------------------------------------------------- launcher


def _launch(argv: Sequence[str], nproc: int, timeout_s: float | None) -> None:
    if nproc == 1:
        cmd = [sys.executable, "-m", "dora_megatron.trainer.checkpoint_convert", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "--master_addr=127.0.0.1", "-m", "dora_megatron.trainer.checkpoint_convert",
               *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        from dora_megatron.processes import last_error_line

        error = last_error_line(proc.stdout + "\n" + proc.stderr)
        raise RuntimeError(f"conversion failed (exit {proc.returncode})" + (f": {error}" if error else "")
                           + f"\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1, ep: int = 1,
                   timeout_s: float | None = None, split: PipelineSplitArgs | None = None) -> Path:
    """Write a ``dist_checkpointing`` checkpoint of the HF model at ``hf_dir`` in layout TP/PP/EP
    (``tp * pp * ep`` gloo ranks on CPU); returns ``out_dir``. ``split``: an uneven pipeline split
    (default Megatron's even one)."""
    for k, v in (("tp", tp), ("pp", pp), ("ep", ep)):
        if v < 1:
            raise ValueError(f"{k} must be >= 1, got {v}")
    if not (Path(hf_dir) / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    if Path(out_dir).exists() and any(Path(out_dir).iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    from dora_megatron.models.hf_config import read_spec
    from dora_megatron.trainer.hf_weights import read_hf_names, warn_skipped_mtp

    warn_skipped_mtp(read_hf_names(str(hf_dir)), read_spec(hf_dir))  # here: the ranks' output shows on failure only
    _launch(["hf-to-megatron", "--hf", str(hf_dir), "--out", str(out_dir), "--tp", str(tp), "--pp", str(pp),
             "--ep", str(ep), *(split or PipelineSplitArgs()).argv()], tp * pp * ep, timeout_s)
    return Path(out_dir)


def megatron_to_hf(ckpt_dir: str | Path, out_dir: str | Path, hf_config_dir: str | Path | None = None,
                   tp: int = 1, pp: int = 1, ep: int = 1, dtype: str | None = None,
                   timeout_s: float | None = None, split: PipelineSplitArgs | None = None) -> Path:
    """Read a checkpoint (written by :func:`hf_to_megatron` or the trainer, any layout) in layout
    TP/PP/EP (default one rank) and write an HF directory; returns ``out_dir``.

    ``hf_config_dir``: where ``config.json`` (+ tokenizer) come from; default the copy kept in the
    checkpoint by :func:`hf_to_megatron`. ``dtype``: of the written tensors; default the config's.
    ``split``: the pipeline split to read in (any split reads any checkpoint)."""
    return megatron_to_hf_many([(ckpt_dir, out_dir)], hf_config_dir, tp, pp, ep, dtype, timeout_s, split)[0]


def megatron_to_hf_many(pairs: Sequence[tuple[str | Path, str | Path]], hf_config_dir: str | Path | None = None,
                        tp: int = 1, pp: int = 1, ep: int = 1, dtype: str | None = None,
                        timeout_s: float | None = None, split: PipelineSplitArgs | None = None) -> list[Path]:
    """:func:`megatron_to_hf` for several ``(ckpt_dir, out_dir)`` pairs of the same model in one
    launch (the model is built once; saves the start-up cost in tests and benchmarks)."""
    if not pairs:
        return []
    for ckpt_dir, _ in pairs:
        if not Path(ckpt_dir).is_dir():
            raise FileNotFoundError(f"no checkpoint directory {ckpt_dir}")
    config_dir = Path(hf_config_dir) if hf_config_dir is not None else Path(pairs[0][0]) / HF_META_DIR
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {config_dir}; pass the model's HF directory as hf_config_dir "
                                "(--hf-config)")
    argv = ["megatron-to-hf", "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), *(split or PipelineSplitArgs()).argv()]
    for ckpt_dir, out_dir in pairs:
        argv += ["--ckpt", str(ckpt_dir), "--out", str(out_dir)]
    if hf_config_dir is not None:
        argv += ["--hf-config", str(hf_config_dir)]
    if dtype is not None:
        argv += ["--dtype", dtype]
    _launch(argv, tp * pp * ep, timeout_s)
    return [Path(o) for _, o in pairs]


# --------------------------------------------------------------------------- rank programs


def _setup(tp: int, pp: int, ep: int, hf_config_dir: str, split: PipelineSplitArgs):
    """Process groups, CPU layer, and this rank's GPTModel chunk (fp32 parameters); ``info.layout``
    carries the chunk's layers as Megatron builds them."""
    from dataclasses import replace

    from dora_megatron.config.trainer import TrainerConfig
    from dora_megatron.trainer import cpu_compat, model as model_mod, parallel, pipeline_split

    cfg = TrainerConfig(tp=tp, pp=pp, ep=ep, device="cpu", megatron=split.megatron())
    compat = cpu_compat.activate("cpu")
    info = parallel.init_distributed(cfg)
    arch = model_mod.load_arch(hf_config_dir)
    spec = "local"  # conversion runs on CPU (gloo): trainer.spec auto resolves to local there
    config = model_mod.build_transformer_config(arch, cfg, spec)
    info = replace(info, layout=pipeline_split.staged_layout(info.layout, config))
    gpt = model_mod.build_gpt_model(arch, config, spec, tp=tp, pre_process=info.layout.first_stage,
                                    post_process=info.layout.last_stage)
    return compat, info, arch, spec, gpt


def _teardown(compat) -> None:
    from dora_megatron.trainer import parallel

    parallel.destroy_distributed()
    compat.deactivate()


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def run_hf_to_megatron(hf: str, out: str, tp: int, pp: int, ep: int, split: PipelineSplitArgs) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from dora_megatron.trainer import hf_weights

    compat, info, arch, spec, gpt = _setup(tp, pp, ep, hf, split)
    try:
        hf_weights.load_hf_into_model(gpt, hf_weights.read_hf_safetensors(hf), arch, info.layout)
        out_path = Path(out)
        if info.rank == 0:
            out_path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save({"model": gpt.sharded_state_dict()}, str(out_path))
        dist.barrier()
        if info.rank == 0:
            _copy_side_files(Path(hf), out_path / HF_META_DIR)
            meta = {"format": "megatron-core dist_checkpointing", "key": "model", "tp": tp, "pp": pp, "ep": ep,
                    **split.megatron(), "spec": spec, "source": str(Path(hf).resolve())}
            (out_path / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    finally:
        _teardown(compat)


def _output_dtype(checkpoint_dtype: str | None, requested: str | None):
    """``requested``, else the dtype the config gives the checkpoint (``dtype`` / ``torch_dtype``), else fp32."""
    import torch

    name = requested or checkpoint_dtype or "float32"
    if name not in _DTYPES:
        raise ValueError(f"unsupported output dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return getattr(torch, _DTYPES[name])


def run_megatron_to_hf(ckpts: Sequence[str], outs: Sequence[str], hf_config: str | None, tp: int, pp: int, ep: int,
                       dtype: str | None, split: PipelineSplitArgs) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from dora_megatron.models.hf_config import keeps_fp32
    from dora_megatron.trainer import hf_weights
    from dora_megatron.weights.snapshots import write_snapshot

    config_dir = Path(hf_config) if hf_config else Path(ckpts[0]) / HF_META_DIR
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {config_dir}; pass --hf-config DIR (the model's HF directory)")
    compat, info, arch, _, gpt = _setup(tp, pp, ep, str(config_dir), split)
    try:
        out_dtype = _output_dtype(arch.dtype, dtype)
        for ckpt, out in zip(ckpts, outs):
            state = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, ckpt)
            gpt.load_state_dict(state["model"])
            # what transformers keeps in fp32 (GLM-4.5's router weight and correction bias) stays fp32
            tensors = {n: t.to(torch.float32 if keeps_fp32(arch.model_type, n) else out_dtype)
                       for n, t in hf_weights.export_hf(gpt, arch, info.layout)}
            if info.rank == 0:
                write_snapshot(out, tensors, config_dir)
            dist.barrier()
    finally:
        _teardown(compat)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dora_megatron.trainer.checkpoint_convert")
    parser.add_argument("direction", choices=("hf-to-megatron", "megatron-to-hf"))
    parser.add_argument("--hf", help="hf-to-megatron: HF model directory")
    parser.add_argument("--ckpt", action="append", help="megatron-to-hf: dist_checkpointing directory (repeatable, "
                        "one --out each)")
    parser.add_argument("--hf-config", default=None, help="megatron-to-hf: HF dir with config.json (default: copy in the checkpoint)")
    parser.add_argument("--out", action="append", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dtype", default=None, choices=sorted(_DTYPES))
    add_split_arguments(parser)
    args = parser.parse_args(argv)
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    if args.direction == "hf-to-megatron":
        if not args.hf:
            parser.error("--hf is required")
        run_hf_to_megatron(args.hf, args.out[-1], args.tp, args.pp, args.ep, PipelineSplitArgs.from_args(args))
    else:
        if not args.ckpt or len(args.ckpt) != len(args.out):
            parser.error("--ckpt is required, with one --out per --ckpt")
        run_megatron_to_hf(args.ckpt, args.out, args.hf_config, args.tp, args.pp, args.ep, args.dtype,
                           PipelineSplitArgs.from_args(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
