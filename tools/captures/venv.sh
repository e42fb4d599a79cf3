# Sourced by make_all.sh and check.sh: ensure_venv creates tools/captures/.venv311 (Python 3.11.7, CPU torch from
# /opt/wheels, then requirements.txt, then requirements-nodeps.txt without dependencies) if it is missing or was
# built from different requirement files.

captures_tools_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
captures_venv="$captures_tools_dir/.venv311"

find_python311() {
    local candidates=("${PYTHON311:-}" "$(pyenv root 2>/dev/null)/versions/3.11.7/bin/python3.11"
                      "/root/.pyenv/versions/3.11.7/bin/python3.11" "$(command -v python3.11 || true)")
    local c
    for c in "${candidates[@]}"; do
        if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
            echo "$c"
            return 0
        fi
    done
    echo "no Python 3.11 found (set PYTHON311=/path/to/python3.11)" >&2
    return 1
}

ensure_venv() {
    local stamp="$captures_venv/.requirements.sha256"
    local want
    want="$(cat "$captures_tools_dir/requirements.txt" "$captures_tools_dir/requirements-nodeps.txt" | sha256sum \
        | cut -d' ' -f1)"
    if [ -x "$captures_venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
        return 0
    fi
    local py
    py="$(find_python311)"
    echo "creating $captures_venv with $py" >&2
    rm -rf "$captures_venv"
    "$py" -m venv "$captures_venv"
    local pip=("$captures_venv/bin/pip" install --quiet --disable-pip-version-check)
    [ -d /opt/wheels ] && pip+=(--find-links /opt/wheels)
    # torch first and explicitly: anything that asks for plain `torch` before it is installed would pull a
    # multi-GB CUDA build from PyPI.
    "${pip[@]}" "$(grep -E '^torch==' "$captures_tools_dir/requirements.txt")"
    "${pip[@]}" -r "$captures_tools_dir/requirements.txt"
    # dflash pins tqdm==4.70.0 and wants datasets/requests; its model.py needs none of them (see the file).
    "${pip[@]}" --no-deps -r "$captures_tools_dir/requirements-nodeps.txt"
    echo "$want" > "$stamp"
}
