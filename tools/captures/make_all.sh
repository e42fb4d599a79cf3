#!/usr/bin/env bash
# Regenerate everything under captures/ (except captures/README.md) with the peer tools, from fixed seeds.
# Usage: bash tools/captures/make_all.sh        (creates tools/captures/.venv311 first if needed)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# shellcheck source=venv.sh
source "$here/venv.sh"
ensure_venv

py="$captures_venv/bin/python"
convert="$captures_venv/bin/mlx_lm.convert"
cap="$repo/captures"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0
cd "$here"

echo "== tokenizer"
"$py" make_tokenizer.py "$tmp/tokenizer"

echo "== HF checkpoints (transformers)"
mkdir -p "$cap"
"$py" make_checkpoints.py "$tmp/tokenizer" "$cap"

echo "== MLX conversions (mlx_lm.convert)"
for spec in "4 64" "8 32"; do
    read -r bits group <<< "$spec"
    out="$cap/tiny-mlx-${bits}bit"
    rm -rf "$out"
    "$convert" --hf-path "$cap/tiny" --mlx-path "$out" -q --q-bits "$bits" --q-group-size "$group"
    [ -f "$out/generation_config.json" ] || cp "$cap/tiny/generation_config.json" "$out/"
done

echo "== references"
refs="$cap/refs"
rm -rf "$refs"
mkdir -p "$refs"
"$py" prompts.py "$cap/tiny" "$refs/prompts.json"
"$py" refs_hf.py "$cap/tiny" float32 "$refs/prompts.json" "$refs/hf-tiny-f32.npz"
"$py" refs_hf.py "$cap/tiny" bfloat16 "$refs/prompts.json" "$refs/hf-tiny-bf16.npz"
"$py" refs_hf.py "$cap/tiny-text-tied" float32 "$refs/prompts.json" "$refs/hf-tiny-text-tied-f32.npz"
"$py" refs_penalties.py "$cap/tiny" "$refs/prompts.json" "$refs/hf-tiny-penalties-f32.npz"
"$py" refs_mlx.py "$cap/tiny-mlx-4bit" "$refs/prompts.json" "$refs/mlx-tiny-mlx-4bit-f32.npz"
"$py" refs_mlx.py "$cap/tiny-mlx-8bit" "$refs/prompts.json" "$refs/mlx-tiny-mlx-8bit-f32.npz"

echo "== DFlash drafter and its references (dflash.model on transformers)"
"$py" make_dflash.py "$cap/tiny" "$cap/tiny-dflash" "$refs/prompts.json" "$refs/dflash-tiny-f32.npz"

echo "== images: tiny/preprocessor_config.json and transformers' image references (processor, tower, whole model)"
"$py" make_vision.py "$cap/tiny" "$refs/hf-tiny-vision-f32.npz"

echo "== agreement between references"
"$py" agreement.py "$cap"

du -sh "$cap"
