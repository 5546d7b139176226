# The course's commands. `make book` and `make test` are the two a fresh clone needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
JOBS   ?= 2

.PHONY: setup book test test-fast lab release release-check grade lint format clean

$(STAMP): requirements.txt requirements-cpu.txt pyproject.toml scripts/install.py
	$(PYTHON) scripts/install.py --venv $(VENV)
	@touch $(STAMP)

setup: $(STAMP)  ## create .venv and install everything

BOOK_STAMP := _build/.book-built

book: $(STAMP)  ## build the HTML book into _build/html (warnings are errors)
	@# Pages are executed once and cached; a change to labsupport must re-execute them all.
	@# So must GPU results committed under results/, which chapter pages read.
	@if [ -f $(BOOK_STAMP) ] && [ -n "$$(find labsupport book/_ext results \( -name '*.py' -o -name '*.json' \) -newer $(BOOK_STAMP) 2>/dev/null)" ]; then \
		echo "labsupport changed since the last build: re-executing every page"; \
		rm -rf _build/.jupyter_cache _build/jupyter_execute _build/html _build/.doctrees; fi
	$(VENV)/bin/jupyter-book build . -W --keep-going
	@touch $(BOOK_STAMP)

test: $(STAMP)  ## lint, release drift, unit tests, every notebook, the built book in Chromium
	$(VENV)/bin/ruff check .
	$(PY) -m labsupport release --check
	$(MAKE) book
	$(PY) -m pytest -n $(JOBS) --durations=15

test-fast: $(STAMP)  ## unit tests only (no notebooks, no book)
	$(PY) -m pytest -m "not notebook and not book"

lab: $(STAMP)  ## JupyterLab on the learner notebooks
	$(VENV)/bin/jupyter lab labs/

release: $(STAMP)  ## regenerate labs/*.ipynb and solutions/*.ipynb from solutions/*.py
	$(PY) -m labsupport release

release-check: $(STAMP)
	$(PY) -m labsupport release --check

grade: $(STAMP)  ## make grade SUBMISSIONS=folder/ [GRADE_ARGS="--jobs 4 --csv out.csv --lab 07_attention"]
	@if [ -z "$(SUBMISSIONS)" ]; then echo "usage: make grade SUBMISSIONS=folder/ (one notebook or folder; for several, python -m labsupport grade A B ...)"; exit 2; fi
	$(PY) -m labsupport grade "$(SUBMISSIONS)" $(GRADE_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format labsupport tests scripts

clean:
	rm -rf _build
