# The two commands of README.md: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
HOST ?= 127.0.0.1
PORT ?= 8080
ARGS ?=
PY := $(VENV)/bin/python

.PHONY: serve test install install-test lint format bench clean

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: install
	$(PY) manage.py migrate --noinput -v 0
	$(PY) manage.py serve --host $(HOST) --port $(PORT) $(ARGS)

test: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) manage.py migrate --noinput -v 0
	$(PY) -m pytest $(ARGS)

format: install-test
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) var
