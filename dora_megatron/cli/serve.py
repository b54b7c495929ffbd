"""``dora serve``: run one embedded rollout engine (SGLang HTTP protocol) on loopback."""

from __future__ import annotations

import errno
import argparse
import sys

from dora_megatron.config.rollout import SPEC_MODES

HELP = "serve a Hugging Face Qwen3 / Qwen3-MoE directory with the embedded engine (SGLang HTTP protocol)"


def _at_least(lo: int, hi: int | None = None):
    """An ``int`` argument type with bounds: argparse then refuses a bad value by the flag's name
    (``argument --max-running: must be >= 1, got 0``), before the model loads, instead of the
    engine failing later with an internal name (``total_blocks must be > 0``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be >= {lo}" + (f" and <= {hi}" if hi is not None else "")
                                             + f", got {value}")
        return value
    return parse


def _float_above(lo: float, inclusive: bool):
    """A ``float`` argument type bounded below (``must be > 0, got 0``), refused by the flag's name."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not (value >= lo if inclusive else value > lo):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {lo:g}, got {text}")
        return value

    return parse


_positive_float = _float_above(0.0, inclusive=False)
_non_negative_float = _float_above(0.0, inclusive=True)


def _fraction(text: str) -> float:
    """A ``float`` argument in [0, 1], refused by the flag's name."""
    value = _non_negative_float(text)
    if value > 1.0:
        raise argparse.ArgumentTypeError(f"must be <= 1, got {text}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    parser.add_argument("--port", type=_at_least(0, 65535), required=True,
                        help="TCP port (0 picks a free one and prints it)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--max-running", type=_at_least(1), default=32, help="cap on concurrently running requests")
    parser.add_argument("--weight-version", default="0", help="version label of the loaded weights")
    parser.add_argument("--num-threads", type=_at_least(1), default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--block-size", type=_at_least(1), default=16, help="KV cache block size in tokens")
    parser.add_argument("--kv-blocks", type=_at_least(1), default=None,
                        help="KV budget in blocks (default: max-running full contexts)")
    parser.add_argument("--context-length", type=_at_least(1), default=None,
                        help="max tokens per request (default: model's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="dtype of weights and KV cache (checkpoints are cast on load)")
    parser.add_argument("--max-waiting", type=_at_least(0), default=4096,
                        help="cap on queued (not yet running) requests; /generate answers 429 beyond it")
    parser.add_argument("--group-connect-timeout", type=_positive_float, default=30.0,
                        help="seconds to reach the trainer's store in /init_weights_update_group before a 400")
    parser.add_argument("--speculative", choices=SPEC_MODES, default="off",
                        help="speculative decoding: off, ngram (drafts from the request's own text) or group (also "
                             "from the finished siblings the controller sends)")
    parser.add_argument("--spec-tokens", type=_at_least(1), default=4, help="draft length k per verify step")
    parser.add_argument("--spec-max-batch", type=_at_least(1), default=8,
                        help="speculate only while at most this many requests run")
    parser.add_argument("--spec-token-cost", type=_non_negative_float, default=0.25,
                        help="a draft token's cost in a verify step, relative to a decode step (the per-request "
                             "draft-length decision)")
    parser.add_argument("--spec-probe-interval", type=_at_least(1), default=64,
                        help="decode steps after which a request whose drafts do not pay drafts once more")
    parser.add_argument("--spec-sibling-top-k", type=_at_least(0, 1024), default=32,
                        help="group drafts at temperature > 0: likeliest tokens kept per position of the siblings' "
                             "computed distributions (0: draw from the tokens they drew, no forward)")
    parser.add_argument("--kept-kv-s", type=_positive_float, default=60.0,
                        help="how long a finished turn's KV (dora_keep_kv) waits for its trajectory's next turn")
    parser.add_argument("--kept-kv-fraction", type=_fraction, default=0.25,
                        help="share of the KV blocks the kept turns may hold together (0: none is kept)")
    parser.add_argument("--api-key", default=None,
                        help="every route but /health needs 'Authorization: Bearer KEY' (as SGLang's --api-key). "
                             "Default: the job's secret from $DORA_JOB_SECRET (a job never puts it on a command "
                             "line); neither: no check")
    parser.add_argument("--admin-api-key", default=None,
                        help="the admin routes (weight updates, pause/continue, flush, abort, "
                             "request export/import) need this key instead (as SGLang's --admin-api-key)")
    parser.add_argument("--weights-root", action="append", default=None,
                        help="a directory /update_weights_from_disk may load from besides --model (repeatable; "
                             "default: $DORA_WEIGHTS_ROOT, the job's snapshots)")
    parser.add_argument("--log-level", default="INFO")


def _listen(host: str, port: int):
    """The listening socket, bound before the model loads: a port in use is reported at once, not
    after the weights are in memory (and nothing else can take the port meanwhile)."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)  # listening, not only bound: another SO_REUSEADDR socket can bind a bound-only port
    except OSError:
        sock.close()
        raise
    return sock


def run(args: argparse.Namespace) -> int:
    from dora_megatron.models.hf_model_dir import check_model_dir

    problems = check_model_dir(args.model, need_tokenizer=False, engine_only=True)  # the engine takes token ids
    if problems:
        sys.stderr.write(f"dora serve: --model {args.model} is not a usable model directory: {'; '.join(problems)}\n")
        return 2
    try:
        sock = _listen(args.host, args.port)
    except OSError as err:
        from dora_megatron.ports import describe_holders

        held = f"; port {args.port} {describe_holders(args.port)}" if err.errno == errno.EADDRINUSE else ""
        sys.stderr.write(f"dora serve: cannot listen on {args.host}:{args.port}: {err.strerror or err}{held} "
                         "(choose another --port, or 0 for a free one)\n")
        return 2
    with sock:
        return _serve(args, sock)


def _serve(args: argparse.Namespace, sock) -> int:
    import gc
    import logging
    import os

    import torch
    from aiohttp import web

    from dora_megatron.comm import auth
    from dora_megatron.rollout.engine.server import build_app

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per request is noise
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("dora serve: --device cuda but CUDA is not available\n")
        return 2
    try:
        app = build_app(
            args.model,
            device=args.device,
            max_running=args.max_running,
            weight_version=str(args.weight_version),
            block_size=args.block_size,
            kv_blocks=args.kv_blocks,
            max_context=args.context_length,
            dtype=getattr(torch, args.dtype),
            max_waiting=args.max_waiting,
            group_connect_timeout_s=args.group_connect_timeout,
            speculative=args.speculative,
            spec_tokens=args.spec_tokens,
            spec_max_batch=args.spec_max_batch,
            spec_token_cost=args.spec_token_cost,
            spec_probe_interval=args.spec_probe_interval,
            spec_sibling_top_k=args.spec_sibling_top_k,
            kept_kv_s=args.kept_kv_s,
            kept_kv_fraction=args.kept_kv_fraction,
            keys=auth.Keys.of_job(args.api_key, args.admin_api_key),
            weights_roots=tuple(args.weights_root or filter(None, [os.environ.get(auth.WEIGHTS_ROOT_ENV)])),
        )
    except (OSError, ValueError, KeyError) as err:  # unreadable or inconsistent weights/config
        sys.stderr.write(f"dora serve: --model {args.model}: cannot load the model: {err}\n")
        return 2
    # the model, its modules and the imports live as long as the process: out of the collector's
    # reach, a full collection no longer walks them all (a drafting step allocates enough small
    # containers to trigger those; measured in docs/results/speculation.md)
    gc.collect()  # nothing cyclic left over from loading is made permanent
    gc.freeze()
    port = sock.getsockname()[1]
    print(f"dora serve: listening on http://{args.host}:{port} model={args.model}", flush=True)
    # handler_cancellation: a client that disconnects cancels its /generate, which aborts the request
    # backlog: a burst of connections (the controller opens one per in-flight request) must not
    # overflow the accept queue (dropped SYNs cost the client a 1 s retransmit each)
    web.run_app(app, sock=sock, print=None, handle_signals=True, handler_cancellation=True, backlog=4096)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dora serve", description=HELP)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
