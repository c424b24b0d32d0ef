# Quick start:  make demo  (train a FLUX DreamBooth LoRA on a tiny offline model)   make test  (run the tests)
# make lint: ruff over the code and tests (as .ci/run does).
# Both create .venv with the CPU build of torch; set TORCH to pick another build, e.g. TORCH=torch.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
DEMO := demo_out

.PHONY: install demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	@test -f $(DEMO)/tiny-flux-dev/model_index.json || \
		$(PY) -m dreamstep tiny-model flux $(DEMO)/tiny-flux-dev --guidance_embeds --seed 0
	@test -f $(DEMO)/tiny-evaluators/clip/config.json || \
		$(PY) -m dreamstep tiny-model evaluators $(DEMO)/tiny-evaluators --seed 0
	$(PY) -m dreamstep train flux-lora --config configs/demo_flux_lora.toml
	@echo "the dreamstep command is $(VENV)/bin/dreamstep (or: source $(VENV)/bin/activate)"

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist loadfile

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(DEMO)
