# tinymoe: `make test` runs the tests, `make cpu` the CPU-scale comparison, `make paper` the GPU one,
# `make study` the whole CPU study (README "Results"), `make bench` the cost of the MoE.
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

.PHONY: setup test cpu paper bench study noise
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

# what the MoE costs per training step here (bench.py), at the CPU recipe's width: eager with the MoE built up in
# stages, compiled, eager again with the profile of where the time goes, both on one thread (as
# `OMP_NUM_THREADS=1 make -j2 study` trains, two runs side by side); then wider
BENCH = $(PYTHON) bench.py config/cpu_moe.py
bench: setup
	mkdir -p results/bench
	$(BENCH) --stages=True > results/bench/cpu_moe_eager.txt && cat results/bench/cpu_moe_eager.txt
	$(BENCH) --compile=True > results/bench/cpu_moe_compiled.txt && cat results/bench/cpu_moe_compiled.txt
	$(BENCH) --profile=True > results/bench/cpu_moe_eager_profile.txt && cat results/bench/cpu_moe_eager_profile.txt
	OMP_NUM_THREADS=1 $(BENCH) > results/bench/cpu_moe_eager_1thread.txt && cat results/bench/cpu_moe_eager_1thread.txt
	OMP_NUM_THREADS=1 $(BENCH) --compile=True > results/bench/cpu_moe_compiled_1thread.txt \
		&& cat results/bench/cpu_moe_compiled_1thread.txt
	$(BENCH) --d_model=96 --n_head=3 --moe_hidden=192 > results/bench/cpu_moe_d96_eager.txt && cat results/bench/cpu_moe_d96_eager.txt
	$(BENCH) --d_model=160 --n_head=5 --moe_hidden=1632 --ffn_multiple_of=32 --steps=4 --rounds=2 \
		> results/bench/cpu_moe_paper_width_eager.txt && cat results/bench/cpu_moe_paper_width_eager.txt

# The CPU study (README "Results"): the three configs x 5 seeds, the ablations x 3 seeds, and a scan of
# tokens per parameter (the same recipe and token budget at d_model 28, 64 and 96, experts 2 x d_model wide,
# and d_model 96 on a quarter of the budget),
# the seed-noise runs (`make noise`), then the reports, the logs and two sample stories per config (seed 1)
# into results/cpu. `OMP_NUM_THREADS=1 make -j2 study` runs two trainings at a time (about 1.8x the
# throughput of one on 2 cores).
STUDY_SEEDS ?= 1 2 3 4 5
ABLATION_SEEDS ?= 1 2 3
SCAN_SEEDS ?= 1 2 3
# a run at d_model 96 costs ~4x one at the preset's 44: one seed there
SCAN_SEEDS_d96 ?= 1
SCAN_WIDTHS ?= 28 64 96
scan_seeds = $(or $(SCAN_SEEDS_d$1),$(SCAN_SEEDS))
MAIN_RUNS := $(foreach c,cpu_moe cpu_dense_active cpu_dense_total,$(foreach s,$(STUDY_SEEDS),out/$(c)-s$(s)/done.json))
ABLATION_RUNS := $(foreach c,cpu_moe_top1 cpu_moe_top1_nolb cpu_moe_noz,$(foreach s,$(ABLATION_SEEDS),out/$(c)-s$(s)/done.json))
SCAN_RUNS := $(foreach d,$(SCAN_WIDTHS),$(foreach c,cpu_moe cpu_dense_active cpu_dense_total,\
	$(foreach s,$(call scan_seeds,$(d)),out/scan_d$(d)_$(c)-s$(s)/done.json)))
# and a point near 1 token per total parameter: d_model 96 on a quarter of the token budget (280 steps, not
# 1,120: the budget is what is smaller here, so the schedule is shorter too)
SHORT_RUNS := $(foreach c,cpu_moe cpu_dense_active cpu_dense_total,out/short_d96_$(c)-s1/done.json)
NOISE_RUNS := $(foreach c,cpu_moe cpu_dense_active,$(foreach v,i2-d1 i3-d1 i1-d2 i1-d3,out/noise_$(c)-$(v)/done.json))
study: setup $(MAIN_RUNS) $(ABLATION_RUNS) $(SCAN_RUNS) $(SHORT_RUNS) noise
	$(PYTHON) report.py $(dir $(MAIN_RUNS)) --out results/cpu
	$(PYTHON) report.py $(dir $(MAIN_RUNS) $(ABLATION_RUNS)) --out results/cpu/ablations
	$(PYTHON) report.py $(dir $(MAIN_RUNS) $(SCAN_RUNS) $(SHORT_RUNS)) --out results/cpu/scan
	for run in $(dir $(MAIN_RUNS) $(ABLATION_RUNS) $(SCAN_RUNS) $(SHORT_RUNS) $(NOISE_RUNS)); do mkdir -p results/cpu/runs/$$(basename $$run) && \
		cp $$run/log.jsonl $$run/config.json results/cpu/runs/$$(basename $$run)/; done
	for c in cpu_moe cpu_dense_active cpu_dense_total; do $(PYTHON) sample.py --out_dir out/$$c-s1 --num_samples 2 \
		--max_new_tokens 800 > results/cpu/runs/$$c-s1/samples.txt; done
$(sort $(CPU_RUNS) $(MAIN_RUNS) $(ABLATION_RUNS)): out/%/done.json: | data/tinystories_bytes/meta.json
	$(TRAIN)
# out/scan_d64_cpu_moe-s1/done.json -> the cpu_moe config at d_model 64, experts 128 wide, named scan_d64_cpu_moe
scan_width = $(word 1,$(subst _, ,$1))
scan_config = $(word 1,$(subst -s, ,$(patsubst $(call scan_width,$1)_%,%,$1)))
$(SCAN_RUNS): out/scan_d%/done.json: | data/tinystories_bytes/meta.json
	$(PYTHON) train.py config/$(call scan_config,$*).py --seed=$(word 2,$(subst -s, ,$*)) --d_model=$(call scan_width,$*) \
		--moe_hidden=$$((2 * $(call scan_width,$*))) --config_name=scan_d$(call scan_width,$*)_$(call scan_config,$*) \
		$(if $(wildcard out/scan_d$*/log.jsonl),--resume=True)
$(SHORT_RUNS): out/short_d96_%/done.json: | data/tinystories_bytes/meta.json
	$(PYTHON) train.py config/$(word 1,$(subst -s, ,$*)).py --seed=$(word 2,$(subst -s, ,$*)) --d_model=96 \
		--moe_hidden=192 --max_tokens=1146880 --config_name=short_d96_$(word 1,$(subst -s, ,$*)) \
		$(if $(wildcard out/short_d96_$*/log.jsonl),--resume=True)
# where the seed noise comes from: runs that hold seed 1's init or data order (scripts/seed_noise.py)
noise: setup $(MAIN_RUNS) $(NOISE_RUNS)
	$(PYTHON) scripts/seed_noise.py --out results/cpu/noise
# out/noise_cpu_moe-i2-d1/done.json -> config/cpu_moe.py with init seed 2 and the data order of seed 1
noise_part = $(word $2,$(subst -, ,$1))
$(NOISE_RUNS): out/noise_%/done.json: | data/tinystories_bytes/meta.json
	$(PYTHON) train.py config/$(call noise_part,$*,1).py --seed=$(patsubst i%,%,$(call noise_part,$*,2)) \
		--data_seed=$(patsubst d%,%,$(call noise_part,$*,3)) --config_name=noise_$(call noise_part,$*,1) \
		--out_dir=out/noise_$* $(if $(wildcard out/noise_$*/log.jsonl),--resume=True)

data/tinystories_bytes/meta.json:
	$(PYTHON) prepare.py --input $(TINYSTORIES) --tokenizer bytes --out_dir data/tinystories_bytes
data/tinystories/meta.json:
	$(PYTHON) prepare.py --out_dir data/tinystories

$(PAPER_RUNS): out/%/done.json: | data/tinystories/meta.json
	$(TRAIN)
