#!/usr/bin/env bash
# Fresh machine → packed demo data: set up .venv, build a synthetic SFT dataset, pack it,
# inspect it, verify it against its source, and load one THD batch.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" torch
PACKER="$ROOT/.venv/bin/packer"
set -x
"$VPY" scripts/make_demo_data.py --out demo/data --samples 20000
"$PACKER" pack demo/data/sft_demo.parquet -o demo/packed --pack-size 4096 --cp 2 --tp 2 --sp --overwrite
