# Two entry points, each doing its own set-up on a fresh machine: `make run`, `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint clean

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(PY) $(VENV)
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvtier bench

test: $(STAMP)
	bash scripts/redis.sh ensure
	bash scripts/vllm_env.sh .venv-vllm
	bash scripts/vllm_overlay.sh .vllm-0.34.0 0.34.0
	bash scripts/sglang_env.sh .sglang-libs
	$(BIN)/ruff check kvtier tests benchmarks scripts
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site
	$(BIN)/python -m pytest -q -rN --durations=25

clean:
	rm -rf $(VENV) .venv-vllm .vllm-0.34.0 .sglang-libs
