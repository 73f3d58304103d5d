# Two commands on a fresh machine (Python 3.11, no GPU): `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; users with GPUs install the package into their own CUDA environment.
TORCH_PIN ?= torch==2.13.0
# The `float8` extra: installed without its dependencies so it cannot replace the CPU torch above,
# and for the tests beside .venv, not in it: transformers imports torchao on every model build when it
# is installed (about 1.5 s of CPU in each of the suite's processes); tests/float8_site.py puts it on
# the path of the float8 tests only.
TORCHAO_PIN ?= torchao==0.18.0
FLOAT8_SITE ?= .float8-site
# torchtitan 0.3 in an environment of its own: it pins huggingface_hub < 2 and datasets < 5, below
# what transformers 5 and TRL need. tests/test_export.py checks the torchtitan export with it.
TITAN_VENV ?= .venv-torchtitan
TITAN_PIN  ?= torchtitan==0.3.0
# LitGPT 0.5.13 in an environment of its own: it needs huggingface-hub < 1.4, transformers 5 needs
# >= 1.31. tests/test_export.py runs the litgpt export through LitGPT's own CLI with it.
LITGPT_VENV ?= .venv-litgpt
LITGPT_PIN  ?= litgpt==0.5.13 'huggingface-hub<1.4' requests

.PHONY: setup run test bench clean

$(BIN)/autotune: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[test,exports,finetune,qlora]'
	@touch $@

$(FLOAT8_SITE)/.installed: $(BIN)/autotune
	$(BIN)/pip install -q --no-deps --target $(FLOAT8_SITE) $(TORCHAO_PIN)
	@touch $@

# A stamp written only once every install succeeded: a half-built environment is rebuilt.
$(TITAN_VENV)/.installed:
	$(PYTHON) -m venv $(TITAN_VENV)
	$(TITAN_VENV)/bin/pip install -q --upgrade pip
	$(TITAN_VENV)/bin/pip install -q $(TORCH_PIN)
	$(TITAN_VENV)/bin/pip install -q $(TITAN_PIN) triton
	@touch $@

$(LITGPT_VENV)/.installed:
	$(PYTHON) -m venv $(LITGPT_VENV)
	$(LITGPT_VENV)/bin/pip install -q --upgrade pip
	$(LITGPT_VENV)/bin/pip install -q $(TORCH_PIN)
	$(LITGPT_VENV)/bin/pip install -q $(LITGPT_PIN)
	@touch $@

setup: $(BIN)/autotune

# The main job on its embedded defaults, with torchao on its path: on the default GPU (an H100) it
# considers eager, compiled and float8 configurations (docs/COMPILE.md).
run: setup $(FLOAT8_SITE)/.installed
	PYTHONPATH=$(FLOAT8_SITE) $(BIN)/autotune --model llama-7b --gpus 8 --global-tokens 4M

# The whole test suite (installs what it needs: Chromium for the report test, PostgreSQL and Slurm for the sweep tests).
# Three pytest-xdist workers on the 2-core VM, each taking whole test modules (module fixtures are made
# once): much of the suite waits (timeouts, a database restart, Slurm, sweep workers), and a third
# worker fills those waits: 19:40 (fa0e51d) against 24:45 with two (docs/BENCHMARKS.md, "The test suite's time").
test: setup $(FLOAT8_SITE)/.installed $(TITAN_VENV)/.installed $(LITGPT_VENV)/.installed
	bash tests/setup_browser.sh
	bash tests/setup_postgres.sh
	bash tests/setup_slurm.sh
	$(BIN)/python -m pytest -q --durations=25 -n 3 --dist loadfile

bench: setup
	for f in benchmarks/bench_*.py; do $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) $(FLOAT8_SITE) $(TITAN_VENV) $(LITGPT_VENV) *.egg-info
