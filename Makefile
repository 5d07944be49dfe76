# Set-up and the two everyday jobs. Everything installs into .venv on first use.
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= out

.PHONY: demo test test-fast bench clean

# the demo needs torch and the project alone
$(BIN)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $@

# the tests add every extra of pyproject.toml (scripts/extras.py lists them)
# (llama-cpp-python builds from its sdist: about 4 minutes on 2 idle cores the first time; pip caches the wheel)
$(BIN)/.installed-extras: $(BIN)/.installed
	$(BIN)/pip install -q -e ".[$$($(BIN)/python scripts/extras.py)]"
	touch $@

# record HF on the embedded tiny model, replay the static runtime, diff the two
demo: $(BIN)/.installed
	mkdir -p $(OUT)
	$(BIN)/trace record --force -o $(OUT)/ref.h5
	$(BIN)/trace replay --force $(OUT)/ref.h5 -o $(OUT)/run.h5
	$(BIN)/trace diff $(OUT)/ref.h5 $(OUT)/run.h5 --force --report $(OUT)/report.html

# lint and format checks (ruff, configured in pyproject.toml) on the whole tree, then the suite (its 25
# slowest tests listed at the end: where the suite's time goes, docs/benchmarks.md)
test: $(BIN)/.installed-extras
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n auto --durations=25

# the inner loop: every test but those marked slow (the adapters that export or lower, docs, sweeps, fuzzing)
test-fast: $(BIN)/.installed-extras
	$(BIN)/python -m pytest -q -n auto -m "not slow"

clean:
	rm -rf $(OUT)
