#!/usr/bin/env bash
# Train the demo model and its drafter (tools/demo/make_demo.py, qwen-jax's own training on the repo's venv), then
# make its MLX 8-bit form with mlx-lm's converter (the captures' Python 3.11 venv), the form the kernels run:
#   models/demo            bf16, Qwen3_5ForConditionalGeneration layout without a vision tower, tied head
#   models/demo-mlx-8bit   mlx_lm.convert -q --q-bits 8 --q-group-size 64 of it
#   models/demo-dflash     the DFlash drafter (bf16, blocks of 8)
# Usage: bash tools/demo/make_demo.sh [make_demo.py's flags]     (~2-3 min on a GPU, ~30 min on this CPU box)
#        bash tools/demo/make_demo.sh --convert-only                (only the 8-bit conversion of models/demo)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
if [ "${1:-}" != "--convert-only" ]; then
    "$repo/.venv/bin/python" "$here/make_demo.py" "$repo/models" "$@"
fi
# shellcheck source=../captures/venv.sh
source "$repo/tools/captures/venv.sh"
ensure_venv
out="$repo/models/demo-mlx-8bit"
rm -rf "$out"
HF_HUB_OFFLINE=1 "$captures_venv/bin/mlx_lm.convert" --hf-path "$repo/models/demo" --mlx-path "$out" -q \
    --q-bits 8 --q-group-size 64
rm -f "$out/README.md"  # mlx-lm's model card template, which names a hub repo this model is not in
