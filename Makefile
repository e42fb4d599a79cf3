# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=
# CPU suite workers (pytest-xdist): one a core, at most 4; a test file stays on one worker (its module fixtures,
# a server or a compiled engine, start once). A worker that dies (a segfault in native code) is not replaced: under
# --dist loadfile, pytest-xdist 3.8's replacement worker can wait forever for work (a CI run sat at 94 % until its
# 90-minute limit), so the run stops there, naming the test the worker died in.
JOBS ?= auto

.PHONY: venv test serve gpu-test check-captures clean-venv

$(VENV)/.installed: pyproject.toml
	@set -e; py=$$(tools/find_python312.sh); \
	if [ ! -x "$(PY)" ]; then echo "creating $(VENV) with $$py"; "$$py" -m venv "$(VENV)"; fi; \
	"$(PY)" -m pip install -q --upgrade pip; \
	"$(PY)" -m pip install -q -e '.[test]'; \
	touch "$@"

venv: $(VENV)/.installed

test: venv
	"$(PY)" -m pytest -q -n $(JOBS) --maxprocesses 4 --dist loadfile --max-worker-restart 0 $(PYTEST_ARGS)

serve: venv
	"$(PY)" -m server $(ARGS)

# On a GPU machine (the H200): the kernels' tests compiled for real.
gpu-test: venv
	"$(PY)" -m pytest -q -m gpu $(PYTEST_ARGS)

# Regenerates one reference capture with the peer tools (HF transformers, mlx-lm) and compares.
check-captures:
	bash tools/captures/check.sh

clean-venv:
	rm -rf "$(VENV)"
