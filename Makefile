# tinymoe: `make test` runs the tests, `make cpu` the CPU-scale comparison, `make paper` the GPU one.
# Each installs what it needs first. Finished runs (out/<config>-s<seed>/done.json) are skipped, interrupted
# ones (a latest.pt but no done.json) are resumed where they stopped.
PYTHON ?= python
SEEDS ?= 1 2 3
TINYSTORIES ?= ../shared/data/tinystories_train_head.txt

runs = $(foreach c,$(1),$(foreach s,$(SEEDS),out/$(c)-s$(s)/done.json))
CPU_RUNS := $(call runs,cpu_moe cpu_dense_active cpu_dense_total)
PAPER_RUNS := $(call runs,moe dense_active dense_total)
# out/cpu_dense_total-s2/done.json -> python train.py config/cpu_dense_total.py --seed=2 [--resume=True]
TRAIN = $(PYTHON) train.py config/$(word 1,$(subst -s, ,$*)).py --seed=$(word 2,$(subst -s, ,$*)) \
	$(if $(wildcard out/$*/log.jsonl),--resume=True)

.PHONY: setup test cpu paper bench
setup:
	@# torch 2.13.0 is the tested release; an installed torch (e.g. your CUDA build) is kept
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -q -r requirements.txt pytest transformers  # transformers: export tests only

test: setup
	$(PYTHON) -m pytest -q

# train what is missing, then the report (table, gaps, routing, plots) of all runs of the three configs
cpu: setup $(CPU_RUNS)
	$(PYTHON) report.py $(dir $(CPU_RUNS)) --out out/report-cpu
paper: setup $(PAPER_RUNS)
	$(PYTHON) report.py $(dir $(PAPER_RUNS)) --out out/report-paper

# what the MoE costs per training step here (bench.py), at the CPU recipe's width, eager and compiled, and wider
BENCH = $(PYTHON) bench.py config/cpu_moe.py
bench: setup
	mkdir -p results/bench
	$(BENCH) > results/bench/cpu_moe_eager.txt && cat results/bench/cpu_moe_eager.txt
	$(BENCH) --compile=True > results/bench/cpu_moe_compiled.txt && cat results/bench/cpu_moe_compiled.txt
	$(BENCH) --d_model=96 --n_head=3 --moe_hidden=192 > results/bench/cpu_moe_d96_eager.txt && cat results/bench/cpu_moe_d96_eager.txt
	$(BENCH) --d_model=160 --n_head=5 --moe_hidden=1632 --ffn_multiple_of=32 --steps=4 --rounds=2 \
		> results/bench/cpu_moe_paper_width_eager.txt && cat results/bench/cpu_moe_paper_width_eager.txt

data/tinystories_bytes/meta.json:
	$(PYTHON) prepare.py --input $(TINYSTORIES) --tokenizer bytes --out_dir data/tinystories_bytes
data/tinystories/meta.json:
	$(PYTHON) prepare.py --out_dir data/tinystories

$(CPU_RUNS): out/%/done.json: | data/tinystories_bytes/meta.json
	$(TRAIN)
$(PAPER_RUNS): out/%/done.json: | data/tinystories/meta.json
	$(TRAIN)
