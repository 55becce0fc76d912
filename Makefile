# SkyLB: `make demo` runs the three-region deployment on this machine; `make test` runs the test suite.
# Both create .venv and install the project into it first (Python 3.11+).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# TRACE=path replays another Mooncake trace; without the default trace the synthetic workload runs.
demo: install
	$(VENV)/bin/skylb local --config configs/local-3region.yaml $(if $(TRACE),--trace $(TRACE))

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .skylb-run .pytest_cache
