#!/usr/bin/env python3
"""Write the demo dataset: synthetic tokenized SFT samples (Parquet and JSONL)."""
import argparse
import os

import orjson
import pyarrow.parquet as pq

from packer_cli.demo import demo_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="demo/data", help="output directory")
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    table = demo_table(args.samples, seed=args.seed)
    pq.write_table(table, os.path.join(args.out, "sft_demo.parquet"), row_group_size=4096)
    with open(os.path.join(args.out, "sft_demo_small.jsonl"), "wb") as f:
        for row in table.slice(0, 1000).to_pylist():
            f.write(orjson.dumps(row) + b"\n")
    tokens = sum(len(x) for x in table.column("input_ids").to_pylist())
    print(f"wrote {args.samples} samples ({tokens:,} tokens) to {args.out}/sft_demo.parquet and 1000 to sft_demo_small.jsonl")


if __name__ == "__main__":
    main()
