# The two set-up commands of the README:
#   make demo   - the main job: the offline SFT -> RM -> PPO, GRPO, DPO demo pipeline (report in runs/demo/)
#   make test   - ruff + the default test suite (not the slow end-to-end fits nor the multi-process tests)
# Both create .venv on first use. TORCH_SPEC picks the torch build installed before the project:
# the default is the CPU wheel this project's machines carry; a GPU user sets e.g.
#   make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv test test-all lint demo clean

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
test: venv lint
	$(PY) -m pytest -m "not slow and not distributed" -q $(PYTEST_ARGS) || { rc=$$?; \
	  [ $$rc -eq 5 ] && echo "make test: pytest collected no tests"; exit $$rc; }

test-all: venv lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: venv
	$(PY) -m lit_rlhf.demo.pipeline --out runs/demo

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
