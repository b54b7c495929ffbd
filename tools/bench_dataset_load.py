"""Seconds to read and check a DAPO-sized prompt dataset at load (every row parsed and rendered).

Usage: python tools/bench_dataset_load.py [--rows 17398] [--out DIR]

Writes a DAPO-shaped Parquet file of ``--rows`` rows (the example model's tokenizer and chat
template; prompts of DAPO-Math-17k's typical length, ~400 characters) and times
``DatasetPromptSource.load`` twice (the second read hits the datasets cache, as the controller's
does after the launcher's input check). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=17398, help="rows (DAPO-Math-17k has 17,398)")
    parser.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    args = parser.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dora_megatron.data.codec import load_codec
    from dora_megatron.data.dataset import DatasetPromptSource
    from dora_megatron.models.example import arithmetic_rows, write_example

    out = Path(args.out or tempfile.mkdtemp(prefix="dora-bench-data-"))
    paths = write_example(out, rows=8)
    filler = " Explain each step of the computation carefully before you give the final answer." * 5
    rows = arithmetic_rows(args.rows)
    for r in rows:
        r["prompt"][1]["content"] += filler
    data = out / "big.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(data))
    codec = load_codec(paths.model_dir)
    times = []
    for _ in range(2):
        t = time.perf_counter()
        source = DatasetPromptSource.load(str(data), codec, max_prompt_tokens=4096)
        times.append(time.perf_counter() - t)
    print(json.dumps({"rows": len(source), "first_load_s": round(times[0], 2), "cached_load_s": round(times[1], 2),
                      "chars_per_prompt": len(rows[0]["prompt"][1]["content"]) + len(rows[0]["prompt"][0]["content"])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
