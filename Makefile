# tinymoe. Each target installs what it needs first; finished runs (out/<config>-s<seed>/done.json) are skipped,
# interrupted ones (a latest.pt but no done.json) resume where they stopped.
#   make test            the test suite
#   make cpu             CPU-scale comparison: 3 configs x SEEDS, then out/report-cpu/ (SEEDS=1 for one seed each)
#   make paper           the paper-scale comparison on a GPU, then out/report-paper/
#   make bench           what the MoE costs per training step (results/bench/)
#   make gpu_check       does tinymoe work on this CUDA GPU, how fast: out/gpu_check/report.md
#   make study, study2   the CPU study in results/cpu/ (study/study.mk, study/README.md)
#   make compute         who wins at equal tokens, FLOPs and time (results/cpu/compute, study/study.mk)
# the Python: an active virtual or conda environment's (with, say, its own CUDA torch), else the
# project's own .venv, made on first use (a system Python may refuse pip installs: PEP 668)
VENV_PYTHON := .venv/bin/python
ifeq ($(VIRTUAL_ENV)$(CONDA_PREFIX),)
PYTHON ?= $(VENV_PYTHON)
else
PYTHON ?= python
endif
SEEDS ?= 1 2 3
# the data of make cpu and make gpu_check: TINYSTORIES=FILE, a local TinyStories text in the
# release format, else the first HF_STORIES stories from the Hugging Face hub
TINYSTORIES ?=
HF_STORIES ?= 5510

runs = $(foreach c,$(1),$(foreach s,$(SEEDS),out/$(c)-s$(s)/done.json))
CPU_RUNS := $(call runs,cpu_moe cpu_dense_active cpu_dense_total)
PAPER_RUNS := $(call runs,moe dense_active dense_total)
# a config's file: config/<name>.py, else the study's (study/config/<name>.py)
config_file = $(or $(wildcard config/$1.py),study/config/$1.py)
# out/cpu_dense_total-s2/done.json -> python train.py config/cpu_dense_total.py --seed=2 [--resume=True]
TRAIN = $(PYTHON) train.py $(call config_file,$(word 1,$(subst -s, ,$*))) --seed=$(word 2,$(subst -s, ,$*)) \
	$(if $(wildcard $(@D)/log.jsonl),--resume=True)

.PHONY: setup test cpu paper bench gpu_check cuda study study2 noise compute ratio warmup \
	break_even claims claims_runs shared_runs FORCE
setup: $(filter $(VENV_PYTHON),$(PYTHON))
	@# torch 2.13.0 is the tested release; an installed torch (e.g. your CUDA build) is kept
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	@# what the tests need beside it, pinned (transformers and wandb: the export and W&B tests only)
	$(PYTHON) -m pip install -q -r requirements.txt -r requirements-test.txt
# the project's .venv; a half-made one is removed, so that the next make tries again
$(VENV_PYTHON):
	python3 -m venv .venv || { rm -rf .venv; echo "make: python3 -m venv failed: install your \
	system's venv package (Debian, Ubuntu: apt install python3-venv), or activate an environment"; \
	exit 1; }

# the linter (settings in pyproject.toml: pyflakes, pycodestyle at 100 columns, import order), then the tests
test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q test_smoke.py tests study/tests

cpu: setup $(CPU_RUNS)
	$(PYTHON) report.py $(dir $(CPU_RUNS)) --out out/report-cpu
paper: setup $(PAPER_RUNS)
	$(PYTHON) report.py $(dir $(PAPER_RUNS)) --out out/report-paper

# FORCE: prepare.py runs whenever the data is needed, and redoes it only when its source changed
# (TINYSTORIES set or unset)
data/tinystories_bytes/meta.json: FORCE
	$(PYTHON) prepare.py $(if $(TINYSTORIES),--input $(TINYSTORIES),--hf_stories $(HF_STORIES)) --tokenizer bytes \
		--out_dir data/tinystories_bytes
data/tinystories/meta.json:
	$(PYTHON) prepare.py --out_dir data/tinystories
# GPT-2 tokens of the same stories (make gpu_check)
data/tinystories_sample_gpt2/meta.json: FORCE
	$(PYTHON) prepare.py $(if $(TINYSTORIES),--input $(TINYSTORIES),--hf_stories $(HF_STORIES)) \
		--out_dir data/tinystories_sample_gpt2
# a run's data, order-only (newer data retrains no finished run), named only while one of the runs
# remains to train: make builds order-only prerequisites too, and the FORCE data target would run
# prepare.py (the hub, without TINYSTORIES) before a finished comparison could reprint offline
data_for = $(if $(filter-out $(wildcard $1),$1),$2)
$(PAPER_RUNS): out/%/done.json: | $(call data_for,$(PAPER_RUNS),data/tinystories/meta.json)
	$(TRAIN)
$(CPU_RUNS): out/%/done.json: | $(call data_for,$(CPU_RUNS),data/tinystories_bytes/meta.json)
	$(TRAIN)

# the cost of the MoE per training step at the CPU recipe's width (bench.py): eager; one FFN layer in parts
# (one thread); compiled; eager with the profile of where the time goes; eager, its profile and compiled on
# one thread (as the study trains, two runs side by side); then wider
BENCH = $(PYTHON) bench.py config/cpu_moe.py
bench: setup
	mkdir -p results/bench
	$(BENCH) > results/bench/cpu_moe_eager.txt && cat results/bench/cpu_moe_eager.txt
	OMP_NUM_THREADS=1 $(BENCH) --layer=True > results/bench/cpu_moe_layer_1thread.txt \
		&& cat results/bench/cpu_moe_layer_1thread.txt
	$(BENCH) --compile=True > results/bench/cpu_moe_compiled.txt && cat results/bench/cpu_moe_compiled.txt
	$(BENCH) --profile=True > results/bench/cpu_moe_eager_profile.txt && cat results/bench/cpu_moe_eager_profile.txt
	OMP_NUM_THREADS=1 $(BENCH) > results/bench/cpu_moe_eager_1thread.txt && cat results/bench/cpu_moe_eager_1thread.txt
	OMP_NUM_THREADS=1 $(BENCH) --profile=True > results/bench/cpu_moe_eager_profile_1thread.txt \
		&& cat results/bench/cpu_moe_eager_profile_1thread.txt
	OMP_NUM_THREADS=1 $(BENCH) --compile=True > results/bench/cpu_moe_compiled_1thread.txt \
		&& cat results/bench/cpu_moe_compiled_1thread.txt
	$(BENCH) --d_model=96 --n_head=3 --moe_hidden=192 > results/bench/cpu_moe_d96_eager.txt \
		&& cat results/bench/cpu_moe_d96_eager.txt
	$(BENCH) --d_model=160 --n_head=5 --moe_hidden=1632 --ffn_multiple_of=32 --steps=4 --rounds=2 \
		> results/bench/cpu_moe_paper_width_eager.txt && cat results/bench/cpu_moe_paper_width_eager.txt

# does tinymoe work on this CUDA GPU, and how fast (gpu_check.py, results/bench/README.md)
gpu_check: cuda data/tinystories_bytes/meta.json data/tinystories_sample_gpt2/meta.json
	$(PYTHON) gpu_check.py
# without a CUDA GPU, one line saying so, before any data is prepared (the hub, a minute)
cuda: setup
	@$(PYTHON) -c "import sys, torch; torch.cuda.is_available() or sys.exit('make gpu_check: torch \
	sees no CUDA GPU; on a CPU, check the logic at toy sizes: python gpu_check.py --size=toy')"

include study/study.mk
