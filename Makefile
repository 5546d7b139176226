# The course's commands. `make book` and `make test` are the two a fresh clone needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
JOBS   ?= 2
PORT   ?= 8000
# The version matrix's second combination: the newest Triton and numpy (requirements-latest.txt).
VENV_LATEST  ?= .venv-latest
STAMP_LATEST := $(VENV_LATEST)/.installed
# nbval runs every notebook: solutions top to bottom, learner notebooks up to their first exercise
# (release writes the tags). A cell past CELL_TIMEOUT seconds fails (labsupport.course.nbval_plugin).
CELL_TIMEOUT ?= 120
NBVAL := --nbval-lax --nbval-current-env --nbval-cell-timeout=$(CELL_TIMEOUT) --ignore-glob='*/tests/*.ipynb'

.PHONY: setup setup-latest book serve test test-fast test-matrix test-latest lab release release-check record-outputs grade slides lint format clean

$(STAMP): requirements.txt requirements-cpu.txt pyproject.toml scripts/install.py
	$(PYTHON) scripts/install.py --venv $(VENV)
	@touch $(STAMP)

setup: $(STAMP)  ## create .venv and install everything

$(STAMP_LATEST): requirements.txt requirements-latest.txt pyproject.toml scripts/install.py
	$(PYTHON) scripts/install.py --venv $(VENV_LATEST) --cpu-requirements requirements-latest.txt
	@touch $(STAMP_LATEST)

setup-latest: $(STAMP_LATEST)  ## create .venv-latest: the newest Triton and numpy (requirements-latest.txt)

BOOK_STAMP := _build/.book-built

book: $(STAMP)  ## build the HTML book into _build/html (warnings are errors)
	@# Pages are executed once and cached; a change to labsupport must re-execute them all.
	@# So must GPU results committed under results/, which chapter pages read.
	@if [ -f $(BOOK_STAMP) ] && [ -n "$$(find labsupport book/_ext results \( -name '*.py' -o -name '*.json' \) -newer $(BOOK_STAMP) 2>/dev/null)" ]; then \
		echo "labsupport changed since the last build: re-executing every page"; \
		rm -rf _build/.jupyter_cache _build/jupyter_execute _build/html _build/.doctrees; fi
	$(VENV)/bin/jupyter-book build . -W --keep-going
	@touch $(BOOK_STAMP)

serve: $(STAMP)  ## serve the built book on http://127.0.0.1:$(PORT) (search needs a server, not file://)
	@test -f _build/html/index.html || $(MAKE) book
	$(PY) scripts/serve_book.py --port $(PORT) _build/html

# `make test` builds the book beside the tests that need no built book: jupyter-book executes its
# pages one after another, so alone it leaves one of two cores idle for the whole build (its page
# kernels get one torch thread each, as the test workers' do, so three processes share two cores
# without spinning). The book's log goes to $(BOOK_LOG), its last lines printed if it fails; then
# the tests of the built book (marked `book`, all under $(BOOK_TESTS): collecting only those folders
# saves collecting the whole suite twice more; tests/notebooks/test_notebooks.py checks no `book` test
# lives elsewhere) run. Any part failing fails `make test`; Ctrl+C stops all of it.
BOOK_LOG ?= _build/book.log
BOOK_TESTS := tests/book tests/scripts
BOOK_TESTS_LOG ?= _build/book_tests.log

test: $(STAMP)  ## lint, release drift, unit tests, every notebook, the built book in Chromium
	$(VENV)/bin/ruff check .
	$(PY) -m labsupport release --check
	mkdir -p _build; rm -f $(BOOK_TESTS_LOG); \
	( OMP_NUM_THREADS=1 $(MAKE) --no-print-directory book > $(BOOK_LOG) 2>&1 || exit 97; \
	  $(PY) -m pytest -p no:cacheprovider --durations=5 -m book $(BOOK_TESTS) > $(BOOK_TESTS_LOG) 2>&1 ) & book=$$!; \
	trap 'kill 0' INT TERM; \
	$(PY) -m pytest -n $(JOBS) --dist loadscope --durations=15 $(NBVAL) -m "not book" tests solutions labs; status=$$?; \
	wait $$book; book_status=$$?; \
	if [ $$book_status = 97 ]; then tail -n 60 $(BOOK_LOG); echo "make book failed (log in $(BOOK_LOG))"; exit 1; fi; \
	echo "make book: built (log in $(BOOK_LOG)); its tests, run as soon as it was built:"; cat $(BOOK_TESTS_LOG); \
	[ $$book_status = 0 ] || status=1; exit $$status

test-fast: $(STAMP)  ## unit tests only (no notebooks, no book)
	$(PY) -m pytest -m "not notebook and not book"

# The version matrix: the checks' tests (test files under a path naming checks or answers) and
# every solution notebook, in Triton's interpreter, under one venv's torch/triton/numpy.
MATRIX_TESTS = $$(find tests -name 'test_*.py' \( -path '*check*' -o -path '*answer*' \) | sort)
define matrix_run
	@echo "== $(1): $$($(1)/bin/python -c 'import torch, triton, numpy; print("torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__)')"
	$(1)/bin/python -m pytest -n $(JOBS) --dist loadscope -q $(NBVAL) $(MATRIX_TESTS) solutions
endef

test-latest: $(STAMP_LATEST)  ## the matrix's second combination only: the newest Triton and numpy (CI runs it)
	$(call matrix_run,$(VENV_LATEST))

test-matrix: $(STAMP) $(STAMP_LATEST)  ## checks' tests + solution notebooks under the pinned and the newest Triton/numpy
	$(call matrix_run,$(VENV))
	$(call matrix_run,$(VENV_LATEST))

lab: $(STAMP)  ## JupyterLab on my-labs/, your own copy of labs/ (made once; never overwritten)
	$(PY) scripts/my_labs.py labs my-labs --open $(VENV)/bin/jupyter

release: $(STAMP)  ## regenerate labs/*.ipynb and solutions/*.ipynb from solutions/*.py
	$(PY) -m labsupport release

release-check: $(STAMP)
	$(PY) -m labsupport release --check

record-outputs: $(STAMP)  ## run the solution notebooks and store the outputs nbval compares, then release
	$(PY) -m labsupport release --record

grade: $(STAMP)  ## make grade SUBMISSIONS=folder/ [GRADE_ARGS="--jobs 4 --csv out.csv --lab 07_attention"]
	@if [ -z "$(SUBMISSIONS)" ]; then echo "usage: make grade SUBMISSIONS=folder/ (one notebook or folder; for several, python -m labsupport grade A B ...)"; exit 2; fi
	$(PY) -m labsupport grade "$(SUBMISSIONS)" $(GRADE_ARGS)

# One reveal.js deck per lab, from the learner notebooks (labsupport/course/slides.py). reveal.js comes
# from a CDN unless REVEAL=path/to/reveal.js (a reveal.js 4 distribution, `npm pack reveal.js@4`,
# unpacked) is given; SLIDES_ARGS=--inline then makes each deck one self-contained file.
slides: $(STAMP)  ## reveal.js slides for every lab into _build/slides [REVEAL=dir SLIDES_ARGS=--inline]
	$(PY) -m labsupport.course.slides --out _build/slides $(if $(REVEAL),--reveal "$(REVEAL)") $(SLIDES_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format labsupport tests scripts

clean:
	rm -rf _build
