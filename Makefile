# make demo: install, start both servers, replay the scenario, stop.   make test: install, run the tests.
PYTHON ?= python3
# GPU images bring their own torch; elsewhere this build (CPU where no CUDA wheel is wanted).
TORCH_SPEC ?= torch==2.13.0
# CPU torch brings no Triton; with it, the kernels' FP8 paths are tested in Triton's interpreter on the CPU.
TRITON_SPEC ?= triton==3.9.0
RUN_DIR ?= run
HOST ?= 127.0.0.1
PREFILL_PORT ?= 50052
DECODE_PORT ?= 50051
PREFILL_METRICS_PORT ?= 8002
DECODE_METRICS_PORT ?= 8001
HTTP_PORT ?= 8000
PREFILL_ARGS ?=
DECODE_ARGS ?=
B_LEN ?= 4096
SCENARIO_ARGS ?= --b-len $(B_LEN) --json $(RUN_DIR)/scenario.json --plot $(RUN_DIR)/scenario.png

.PHONY: install proto serve-prefill serve-decode stop demo test test-fast soak lint results

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PYTHON) -m pip install -q "$(TRITON_SPEC)"
	@$(PYTHON) -m pip install -q -e '.[dev]'

proto:
	$(PYTHON) proto/generate.py

serve-prefill:
	@$(PYTHON) -m launcher start prefill prefill_server --address $(HOST):$(PREFILL_PORT) --run-dir $(RUN_DIR) \
		-- --host $(HOST) --port $(PREFILL_PORT) --metrics-port $(PREFILL_METRICS_PORT) $(PREFILL_ARGS)

serve-decode:
	@$(PYTHON) -m launcher start decode decode_server --address $(HOST):$(DECODE_PORT) --run-dir $(RUN_DIR) \
		-- --host $(HOST) --port $(DECODE_PORT) --metrics-port $(DECODE_METRICS_PORT) --http-port $(HTTP_PORT) \
		--prefill-addr $(HOST):$(PREFILL_PORT) $(DECODE_ARGS)

stop:
	@$(PYTHON) -m launcher stop decode prefill --run-dir $(RUN_DIR)

demo: install
	@$(MAKE) --no-print-directory serve-prefill serve-decode
	@$(PYTHON) -m client.scenario --target $(HOST):$(DECODE_PORT) $(SCENARIO_ARGS); \
		status=$$?; $(MAKE) --no-print-directory stop; exit $$status

test: install
	$(PYTHON) -m pytest -q

# Everything but the tests that start server processes: a minute or two on a laptop's CPU.
test-fast: install
	$(PYTHON) -m pytest -q -m "not e2e and not soak"

soak: install
	$(PYTHON) -m pytest -q -m soak -p no:cacheprovider tests/test_soak.py tests/test_chaos.py

# Re-measure every README table on the GPUs present and render the tables anew (bench/results).
results: install
	$(PYTHON) -m bench.headline

lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy engine serving prefill_server decode_server client launcher bench planner tests
	$(PYTHON) -c "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_logo=True))"
