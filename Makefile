PY ?= python3.11
# Where the CPU build of torch comes from. Empty: pip's configured index (this project's
# machines serve the CPU wheel locally). Elsewhere: make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint server clean

$(STAMP): pyproject.toml constraints-cpu.txt
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH (or make PY=python3)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -c constraints-cpu.txt -e ".[dev,s3,ray]" moto[server]
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/draftflow run configs/tiny.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check draftflow flows tasks tests benchmarks

server: $(STAMP)
	$(BIN)/draftflow server

clean:
	rm -rf runs
