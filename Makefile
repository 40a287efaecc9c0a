# Two commands for a fresh machine: `make demo` (install + the main job on a tiny model) and `make test`.
PY ?= python3
# The CPU build of torch where this machine has it on disk (fast); otherwise whatever fits the package range.
TORCH ?= torch==2.13.0

.PHONY: install install-torch install-demo demo test check-wheel bench

install-torch:
	$(PY) -m pip install -q "$(TORCH)" || $(PY) -m pip install -q "torch>=2.5,<3"

# The Triton of the GPU image, for the kernels' resource gate (tests/test_dcmha_triton.py): compiled for sm_90 by it,
# in a folder of its own (the environment keeps its newer Triton for the interpreter tests).
GATE_TRITON ?= triton==3.6.0

# Everything the tests use: the test tools (triton for the kernel tests), lm-eval, the training extra, the research
# code (research/, its own distribution) that examples/compare_small.py and its tests import, and the gate's Triton.
install: install-torch
	$(PY) -m pip install -q -e ".[test,eval,train]"
	$(PY) -m pip install -q -e research
	test -d .cache/triton-3.6.0/triton || $(PY) -m pip install -q --no-deps --target .cache/triton-3.6.0 "$(GATE_TRITON)"

# Only what the demo runs (the `demo` extra: lm-eval and datasets), not the test tools or triton.
install-demo: install-torch
	$(PY) -m pip install -q -e ".[demo]"

demo: install-demo
	$(PY) examples/demo.py

# One pytest worker per core (pytest-xdist), a test file's tests on one worker (module fixtures built once).
test: install
	$(PY) -m pytest -q -n auto --dist loadfile tests

# A wheel of this checkout in a fresh virtual environment (the README's install block), used from a temporary
# directory: console scripts, presets, the quick start, convert -> evaluate -> save -> remote-code reload.
check-wheel: install
	$(PY) -m pytest -q -m wheel tests/test_wheel.py

bench: install
	$(PY) benchmarks/bench_model.py
