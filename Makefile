# The two set-up commands of the README:
#   make demo   - the main job: the offline SFT -> RM -> PPO, GRPO, DPO demo pipeline (report in runs/demo/),
#                 then the tool world: SFT -> GRPO with and without a calculator (report in runs/demo/tool/;
#                 TOOL_SEEDS=3 runs the 3-seed comparison of the README)
#   make test   - ruff + the default test suite (not the slow end-to-end fits, not the multi-process tests),
#                 then the vLLM engine's tests against the real vLLM in .venv-vllm (built beside the main
#                 suite, in the background: vLLM pins an older transformers than the main environment's)
# CI (.ci/run) runs make test, then make test-distributed: the multi-process tests (marker `distributed`:
# 2 ranks over gloo, simulated nodes, SIGTERM across ranks, a vLLM engine per rank), about 6 more minutes.
# Both create .venv on first use. TORCH_SPEC picks the torch build installed before the project:
# the default is the CPU wheel this project's machines carry; a GPU user sets e.g.
#   make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
TEST_MARKERS ?= not slow and not vllm and not distributed
VLLM_MARKERS ?= vllm and not distributed
TOOL_SEEDS ?= 1
# make test runs the main suite's test files in PYTEST_WORKERS processes (pytest-xdist; a file's tests stay
# in one process, so its module fixtures run once): the suite is mostly one-core subprocess start-ups.
# PYTEST_WORKERS=0 runs them all in pytest's own process. The vLLM tests run in VLLM_WORKERS processes, test
# by test (--dist loadgroup: the engine file's tests, which share one engine, stay together in one process).
PYTEST_WORKERS ?= 2
VLLM_VENV ?= .venv-vllm
VLLM_TESTS := tests/test_vllm_engine.py tests/test_vllm_fits.py
VLLM_WORKERS ?= $(PYTEST_WORKERS)

.PHONY: venv test test-distributed test-all test-vllm lint demo clean suite vllm-tests

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff check lit_rlhf tests scripts

# pytest exits 5 when it collects no test: that is a failure here too, with a clear message.
# --durations=15 prints the suite's 15 slowest tests and fixtures: where its time goes (make test stays < 15 min).
# The vLLM environment builds while the main suite runs; scripts/vllm_env.sh exits 3 where vLLM cannot
# run (the one line printed then says why, and the rest of the run decides the result). Under make test the
# vLLM tests start as soon as their environment is ready, in one process beside the main suite (which
# leaves a core partly idle between its files' subprocess start-ups), and their output is printed after it.
test: venv lint
	@$(MAKE) --no-print-directory suite MARKERS="$(TEST_MARKERS)" VLLM_MARKERS="$(VLLM_MARKERS)" VLLM_BESIDE=1

# The multi-process tests, in both environments (CI runs them after make test); the vLLM ones after the
# main ones and one at a time (each test starts two ranks, each with its engine).
test-distributed: venv
	@$(MAKE) --no-print-directory suite MARKERS="distributed and not slow and not vllm" \
	  VLLM_MARKERS="vllm and distributed" VLLM_BESIDE=0 VLLM_WORKERS=0

VLLM_BESIDE ?= 0
suite:
	@if [ "$(VLLM_BESIDE)" = 1 ]; then \
	  ( scripts/vllm_env.sh $(VLLM_VENV) > $(VLLM_VENV).log 2>&1; \
	    $(MAKE) --no-print-directory vllm-tests ENV_RC=$$? VLLM_WORKERS=0 ) > $(VLLM_VENV).tests.log 2>&1 & \
	else \
	  scripts/vllm_env.sh $(VLLM_VENV) > $(VLLM_VENV).log 2>&1 & \
	fi; bg_pid=$$!; \
	$(PY) -m pytest -m "$(MARKERS)" -n $(PYTEST_WORKERS) --dist loadfile -q --durations=15 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests"; fi; \
	wait $$bg_pid; bg_rc=$$?; \
	if [ "$(VLLM_BESIDE)" = 1 ]; then \
	  cat $(VLLM_VENV).tests.log; if [ $$rc -ne 0 ]; then exit $$rc; fi; exit $$bg_rc; \
	fi; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; \
	$(MAKE) --no-print-directory vllm-tests ENV_RC=$$bg_rc

test-vllm: venv
	@scripts/vllm_env.sh $(VLLM_VENV) > $(VLLM_VENV).log 2>&1; \
	$(MAKE) --no-print-directory vllm-tests ENV_RC=$$? VLLM_MARKERS=vllm

vllm-tests:
	@if [ "$(ENV_RC)" = 0 ]; then \
	  echo "vLLM engine tests ($$(tail -n 1 $(VLLM_VENV).log)):"; \
	  $(VLLM_VENV)/bin/python -m pytest -m "$(VLLM_MARKERS)" -q -p no:cacheprovider \
	    -n $(VLLM_WORKERS) --dist loadgroup $(VLLM_TESTS); \
	elif [ "$(ENV_RC)" = 3 ]; then \
	  echo "make test: the vLLM engine's tests did not run: $$(tail -n 1 $(VLLM_VENV).log)"; \
	else \
	  echo "make test: building the vLLM environment failed (exit $(ENV_RC)); its log, $(VLLM_VENV).log, ends:"; \
	  tail -n 20 $(VLLM_VENV).log; exit 1; \
	fi

test-all: venv lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: venv
	$(PY) -m lit_rlhf.demo.pipeline --out runs/demo
	$(PY) -m lit_rlhf.demo.tool_pipeline --out runs/demo/tool --seeds $(TOOL_SEEDS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_VENV).log $(VLLM_VENV).tests.log runs .pytest_cache .ruff_cache
