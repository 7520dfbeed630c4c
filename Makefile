# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast bench stress install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the pins or the package metadata change.
$(STAMP): $(PY) requirements-dev.txt pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/ddptrain train --config configs/quickstart.toml

# The test files run on JOBS workers: a file's tests stay together (its module fixtures run once), and the
# files that hold a slow test start first (tests/conftest.py).
JOBS ?= 3
test: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile $(PYTEST_ARGS)

# The edit-test loop: every test that starts no process (a test is skipped where it would start one).
test-fast: $(STAMP)
	$(PY) -m pytest -q -rfE --no-processes -p no:xdist $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.run

# N short 2-process runs back to back (loader workers, async saves, ddp and fsdp, a GPT split by vocabulary rows,
# streams, random kills):
# prints every failure and hang.
N ?= 100
stress: $(STAMP)
	$(PY) scripts/stress.py --runs $(N)

clean:
	rm -rf $(VENV) runs build src/*.egg-info
