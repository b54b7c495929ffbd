"""Max |logits(Megatron) - logits(HF transformers)| for an HF model directory in a TP/PP/EP layout.

Usage: python tools/check_parity.py --hf DIR [--tp N --pp N --ep N] [--device cpu]
With more than one rank it relaunches itself under ``torch.distributed.run`` (gloo on CPU).
The last line of output is the number (rank 0).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script from anywhere: the parity helpers live in tests/helpers
    sys.path.insert(0, REPO)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--seq-len", type=int, default=16)
    args = parser.parse_args(argv)
    world = args.tp * args.pp * args.ep
    if world > 1 and "RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               f"--master_port={_free_port()}", "--master_addr=127.0.0.1", os.path.abspath(__file__)]
        cmd += argv if argv is not None else sys.argv[1:]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        return subprocess.call(cmd, env=env)

    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(1 if world > 1 else 2)
    from dora_megatron.config.algo import AlgoConfig
    from dora_megatron.config.trainer import TrainerConfig
    from tests.helpers.trainer_parity import fixed_inputs, hf_logits, megatron_logits
    from dora_megatron.trainer.worker import TrainerWorker

    cfg = TrainerConfig(tp=args.tp, pp=args.pp, ep=args.ep, device=args.device, use_distributed_optimizer=False)
    worker = TrainerWorker(cfg, AlgoConfig(), args.hf)
    ids = fixed_inputs(worker.arch.vocab_size, seq_len=args.seq_len)
    ours = megatron_logits(worker, ids)
    worker.close()
    if ours is not None:
        ref = hf_logits(args.hf, ids)
        print((ours - ref).abs().max().item(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
