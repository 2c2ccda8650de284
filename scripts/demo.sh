#!/usr/bin/env bash
# Fresh machine → packed demo data: set up .venv, build a synthetic SFT dataset, pack it,
# inspect it, verify it against its source, and load one THD batch.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" torch
PACKER="$ROOT/.venv/bin/packer"
set -x
"$VPY" scripts/make_demo_data.py --out demo/data --samples 20000
"$PACKER" pack demo/data/sft_demo.parquet -o demo/packed --pack-size 4096 --cp 2 --tp 2 --sp --overwrite
"$PACKER" inspect demo/packed
"$PACKER" verify demo/packed --source demo/data/sft_demo.parquet
"$VPY" - <<'PY'
import warnings

from packer_cli.torch import PackedDataset

# megatron-core, imported for its PackedSeqParams, warns on import that this CPU machine has no
# Transformer Engine or Apex: true, and beside the point here
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

ds = PackedDataset("demo/packed")
b = ds[0]
print(f"{len(ds)} packs; pack 0: T={b.num_tokens}, {b.num_seqs} sequences, max_seqlen={b.max_seqlen}")
print("tokens      ", tuple(b.tokens.shape), b.tokens.dtype, b.tokens[0, :8].tolist())
print("labels      ", tuple(b.labels.shape), b.labels.dtype, b.labels[0, :8].tolist())
print("position_ids", b.position_ids[0, :8].tolist())
print("cu_seqlens        ", b.cu_seqlens[:6].tolist(), "...", b.cu_seqlens.dtype)
print("cu_seqlens_padded ", b.cu_seqlens_padded[:6].tolist(), "...")
print(f"host stats: num_real_tokens={b.num_real_tokens} seqlen_sq_sum={b.seqlen_sq_sum} "
      f"num_loss_tokens={b.num_loss_tokens}")
r0 = b.for_cp_rank(2, 0)
print(f"CP rank 0 of 2: tokens {tuple(r0.tokens.shape)} (boundaries stay global: {len(r0.cu_seqlens_padded)} entries)")
print("PackedSeqParams:", type(b.packed_seq_params()).__name__, "qkv_format =", b.packed_seq_params().qkv_format)
PY
