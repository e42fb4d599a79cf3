#!/usr/bin/env bash
# CI step: make sure the peer tools still reproduce the committed captures (creates the 3.11 venv if missing).
# Usage: bash tools/captures/check.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=venv.sh
source "$here/venv.sh"
ensure_venv
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$here"
exec "$captures_venv/bin/python" check.py "$here/../../captures"
