VENV ?= .venv
PROMPT ?= "What is the capital of France?" "Write a haiku about the sea."

.PHONY: install run test lint

$(VENV)/.keel-installed: pyproject.toml scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh
	touch $@

install: $(VENV)/.keel-installed

run: install
	$(VENV)/bin/keel generate --max-tokens 48 $(PROMPT)

lint: install
	$(VENV)/bin/ruff check keel tests benchmarks

# One torch process at a time: the suite starts no second one (see README on threads).
test: install lint
	$(VENV)/bin/python -m pytest -q tests
