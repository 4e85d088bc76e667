VENV ?= .venv
PROMPT ?= "The capital of France is"

.PHONY: install run test

$(VENV)/.keel-installed: pyproject.toml scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh
	touch $@

install: $(VENV)/.keel-installed

run: install
	$(VENV)/bin/keel generate --max-tokens 48 $(PROMPT)

test: install
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/python -m pytest -q tests
