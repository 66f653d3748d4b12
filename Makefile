# Two entry points for a fresh machine: `make run` (install + the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "installing the pinned toolchain into $(VENV) (torch, iree-turbine, iree-base-compiler: 1-2 min) ..."
	$(BIN)/pip install -q -e '.[export,test,serve,bench]'
	touch $(STAMP)

install: $(STAMP)

# The main job on the embedded default model (model/assets/small): export it once for llvm-cpu (run
# here) and gfx942 (MI300X), then stream a greedy continuation of the fixed prompt from the compiled
# llvm-cpu module. The export is redone only when the model, the exporter or the weights change. It
# has the default batch sizes (1,4: 4 slots), so `dsv4 serve out/default` runs 4 requests at once.
EXPORT_DIR ?= out/default
TARGETS ?= --target llvm-cpu --target gfx942
PROMPT ?= The list data type has some more methods.
MAX_NEW_TOKENS ?= 48
EXPORT_DEPS := $(wildcard cli/export.py contract/*.py model/*.py model/*/*.py model/kernels/*.jinja export/*.py model/assets/small/*.json model/assets/small/*.safetensors)

$(EXPORT_DIR)/config.json: $(STAMP) $(EXPORT_DEPS)
	$(BIN)/dsv4 export $(TARGETS) --no-score -o $(EXPORT_DIR)

run: $(EXPORT_DIR)/config.json
	$(BIN)/dsv4 generate $(EXPORT_DIR) --prompt "$(PROMPT)" --max-new-tokens $(MAX_NEW_TOKENS) --echo

# The whole suite on up to 4 workers (pytest-xdist; tests/conftest.py's scheduler runs the modules that
# share an export on one worker, the export units first). TEST_WORKERS=0: one process.
TEST_WORKERS ?= auto --maxprocesses 4
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache $(EXPORT_DIR)
