#!/usr/bin/env bash
# Prints the path of a working Python 3.12 interpreter, or explains on stderr and exits 1.
# pyenv machines carry 3.12.1 without selecting it, so `python3.12` alone can fail there.
for cand in "${PYTHON312:-}" python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
  [ -n "$cand" ] || continue
  p=$(command -v "$cand" 2>/dev/null) || continue
  if out=$("$p" -c 'import sys; print(sys.executable) if sys.version_info[:2] == (3, 12) else sys.exit(1)' 2>/dev/null); then
    echo "$out"; exit 0
  fi
done
root=${PYENV_ROOT:-$HOME/.pyenv}
for p in "$root"/versions/3.12*/bin/python3.12; do
  [ -x "$p" ] && "$p" -c 'pass' 2>/dev/null && { echo "$p"; exit 0; }
done
echo "error: no working Python 3.12 found (jax 0.11.2 needs it). Install it (e.g. 'pyenv install 3.12.1')" \
     "or point PYTHON312=/path/to/python3.12 at one." >&2
exit 1
