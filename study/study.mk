# The CPU study (study/README.md, results/cpu/README.md), included by the Makefile. `OMP_NUM_THREADS=1 make -j2
# study` runs two trainings at a time (about 1.8x the throughput of one on 2 cores). Every report is made from the
# logs kept in results/cpu/, so it can be remade from the committed logs alone (study/README.md).
#
# The first protocol: every run of make study, study2, noise and compute warms up over 2% of its own steps (the
# paper's fraction), as those runs were trained before the CPU recipe fixed its warmup at 224 steps (make warmup,
# results/cpu/warmup). Its main runs and seed-noise runs train in out/first/, apart from make cpu's runs of the
# same names, which take the recipe as it is.
FIRST_PROTOCOL := --warmup_iters=0
#
# make study: the three configs x 10 seeds, the ablations x 3 seeds, and a scan of tokens per parameter (the same
# recipe and token budget at d_model 28, 64 and 96, experts 2 x d_model wide, and d_model 96 on a quarter of the
# budget), the seed-noise runs (`make noise`), then the reports, the logs and two sample stories per config (seed 1).
STUDY_SEEDS ?= 1 2 3 4 5 6 7 8 9 10
ABLATION_SEEDS ?= 1 2 3
SCAN_SEEDS ?= 1 2 3
# a run at d_model 96 costs ~4x one at the preset's 44: one seed there
SCAN_SEEDS_d96 ?= 1
SCAN_WIDTHS ?= 28 64 96
scan_seeds = $(or $(SCAN_SEEDS_d$1),$(SCAN_SEEDS))
MAIN_RUNS := $(foreach c,cpu_moe cpu_dense_active cpu_dense_total,$(foreach s,$(STUDY_SEEDS),out/first/$(c)-s$(s)/done.json))
ABLATION_RUNS := $(foreach c,cpu_moe_top1 cpu_moe_top1_nolb cpu_moe_noz,$(foreach s,$(ABLATION_SEEDS),out/$(c)-s$(s)/done.json))
SCAN_RUNS := $(foreach d,$(SCAN_WIDTHS),$(foreach c,cpu_moe cpu_dense_active cpu_dense_total,\
	$(foreach s,$(call scan_seeds,$(d)),out/scan_d$(d)_$(c)-s$(s)/done.json)))
# and a point near 1 token per total parameter: d_model 96 on a quarter of the token budget (280 steps, not
# 1,120: the budget is what is smaller here, so the schedule is shorter too)
SHORT_RUNS := $(foreach c,cpu_moe cpu_dense_active cpu_dense_total,out/short_d96_$(c)-s1/done.json)
NOISE_RUNS := $(foreach c,cpu_moe cpu_dense_active,$(foreach v,i2-d1 i3-d1 i1-d2 i1-d3,out/first/noise_$(c)-$(v)/done.json))
# the MoE variants of make study2 (study/config/cpu_moe_*.py), trained by the generic rule below
VARIANTS ?= cpu_moe_init0 cpu_moe_lr01 cpu_moe_fine8 cpu_moe_fine16 cpu_moe_shared cpu_moe_bias \
	cpu_moe_shared_lr01 cpu_moe_shared_bias cpu_moe_shared_fine
VARIANT_SEEDS ?= 6 7 8 9 10
VARIANT_RUNS := $(foreach c,$(VARIANTS),$(foreach s,$(VARIANT_SEEDS),out/$(c)-s$(s)/done.json))
# the kept copy of a run's log and config: out/first/cpu_moe-s1/done.json -> results/cpu/runs/cpu_moe-s1 (or,
# with a second argument, into that folder)
kept = $(foreach run,$1,$(or $2,results/cpu/runs)/$(notdir $(patsubst %/done.json,%,$(run))))
keep = for run in $(dir $1); do mkdir -p $(or $2,results/cpu/runs)/$$(basename $$run) && \
	cp $$run/log.jsonl $$run/config.json $(or $2,results/cpu/runs)/$$(basename $$run)/; done
study: setup $(MAIN_RUNS) $(ABLATION_RUNS) $(SCAN_RUNS) $(SHORT_RUNS) noise
	$(call keep,$(MAIN_RUNS) $(ABLATION_RUNS) $(SCAN_RUNS) $(SHORT_RUNS) $(NOISE_RUNS))
	$(PYTHON) -m study.report $(call kept,$(MAIN_RUNS)) --out results/cpu
	$(PYTHON) -m study.report $(call kept,$(MAIN_RUNS) $(ABLATION_RUNS)) --out results/cpu/ablations
	$(PYTHON) -m study.report $(call kept,$(MAIN_RUNS) $(SCAN_RUNS) $(SHORT_RUNS)) --out results/cpu/scan
	for c in cpu_moe cpu_dense_active cpu_dense_total; do $(PYTHON) sample.py --out_dir out/first/$$c-s1 --num_samples 2 \
		--max_new_tokens 800 > results/cpu/runs/$$c-s1/samples.txt; done
# every run in out/first/ but the seed-noise ones: make study's, and make compute's whichever STUDY_SEEDS are
out/first/%/done.json: | data/tinystories_bytes/meta.json
	$(TRAIN) $(FIRST_PROTOCOL) --out_dir=$(@D)
$(sort $(ABLATION_RUNS) $(VARIANT_RUNS)): out/%/done.json: | data/tinystories_bytes/meta.json
	$(TRAIN) $(FIRST_PROTOCOL)
# out/scan_d64_cpu_moe-s1/done.json -> the cpu_moe config at d_model 64, experts 128 wide, named scan_d64_cpu_moe
scan_width = $(word 1,$(subst _, ,$1))
scan_config = $(word 1,$(subst -s, ,$(patsubst $(call scan_width,$1)_%,%,$1)))
$(SCAN_RUNS): out/scan_d%/done.json: | data/tinystories_bytes/meta.json
	$(PYTHON) train.py $(call config_file,$(call scan_config,$*)) --seed=$(word 2,$(subst -s, ,$*)) \
		--d_model=$(call scan_width,$*) --moe_hidden=$$((2 * $(call scan_width,$*))) \
		--config_name=scan_d$(call scan_width,$*)_$(call scan_config,$*) \
		$(FIRST_PROTOCOL) $(if $(wildcard out/scan_d$*/log.jsonl),--resume=True)
$(SHORT_RUNS): out/short_d96_%/done.json: | data/tinystories_bytes/meta.json
	$(PYTHON) train.py $(call config_file,$(word 1,$(subst -s, ,$*))) --seed=$(word 2,$(subst -s, ,$*)) --d_model=96 \
		--moe_hidden=192 --max_tokens=1146880 --config_name=short_d96_$(word 1,$(subst -s, ,$*)) \
		$(FIRST_PROTOCOL) $(if $(wildcard out/short_d96_$*/log.jsonl),--resume=True)
# where the seed noise comes from: runs that hold seed 1's init or data order (study/seed_noise.py)
noise: setup $(MAIN_RUNS) $(NOISE_RUNS)
	$(PYTHON) -m study.seed_noise --runs out/first --out results/cpu/noise
# out/first/noise_cpu_moe-i2-d1/done.json -> config/cpu_moe.py with init seed 2 and the data order of seed 1
noise_part = $(word $2,$(subst -, ,$1))
$(NOISE_RUNS): out/first/noise_%/done.json: | data/tinystories_bytes/meta.json
	$(PYTHON) train.py $(call config_file,$(call noise_part,$*,1)) --seed=$(patsubst i%,%,$(call noise_part,$*,2)) \
		--data_seed=$(patsubst d%,%,$(call noise_part,$*,3)) --config_name=noise_$(call noise_part,$*,1) \
		--out_dir=$(@D) $(FIRST_PROTOCOL) $(if $(wildcard $(@D)/log.jsonl),--resume=True)


# make study2: the main protocol at 10 seeds, and the token budget as separate runs at the fixed d_model 44 trio:
# BUDGETS percent of the recipe's 4.59M tokens (25, 50, 200; 100 is the main protocol), each with its own warmup
# and cosine schedule; 200 sees the 4.0M-byte train split 2.3 times. -> results/cpu/budgets (study/report.py's
# scan rows). Then the router start: cpu_moe with one router setting changed (ROUTER_STARTS, named
# cpu_moe_rs_<setting>) on ROUTER_SEEDS (the zero router and a tenth of the router LR are named configs,
# cpu_moe_init0 and cpu_moe_lr01, run with the variants), and the MoE variants at cpu_moe's active and total FFN
# size (VARIANTS, study/config/cpu_moe_*.py) on VARIANT_SEEDS -> results/cpu/variants (study/report.py's
# variants: each against cpu_moe and both dense models of the same seed; results/cpu/README.md says which CPU
# trained which runs).
BUDGETS ?= 25 50 200
BUDGET_SEEDS ?= 1 2 3 4 5
RECIPE_TOKENS := $(shell $(PYTHON) -c "from config.cpu_recipe import max_tokens; print(max_tokens)" 2>/dev/null)
# any config at these budgets, e.g. the shared expert at twice the budget (results/cpu/README.md): TINYSTORIES=FILE
# OMP_NUM_THREADS=1 make -j2 BUDGETS=200 BUDGET_CONFIGS=cpu_moe_shared out/b200_cpu_moe_shared-s{1,2,3,4,5}/done.json
BUDGET_CONFIGS ?= cpu_moe cpu_dense_active cpu_dense_total
BUDGET_RUNS := $(foreach b,$(BUDGETS),$(foreach c,$(BUDGET_CONFIGS),\
	$(foreach s,$(BUDGET_SEEDS),out/b$(b)_$(c)-s$(s)/done.json)))
# the trio the variants are paired with; the committed report used seeds 6-10 of it retrained on the CPU that
# trained the variants: VARIANT_BASE_RUNS='results/cpu/reruns/xeon/cpu_*'
VARIANT_BASE_RUNS ?= $(call kept,$(MAIN_RUNS))
ROUTER_STARTS ?= lr03 nodecay lb01
ROUTER_SEEDS ?= 6 7 8
rs_lr03 = --router_lr_mult=0.3
rs_nodecay = --router_decay=False
# ten times the Switch loss: the routers send every token to the same experts while on the plateau
rs_lb01 = --aux_loss_coef=0.1
ROUTER_RUNS := $(foreach r,$(ROUTER_STARTS),$(foreach s,$(ROUTER_SEEDS),out/cpu_moe_rs_$(r)-s$(s)/done.json))
study2: setup $(MAIN_RUNS) $(BUDGET_RUNS) $(ROUTER_RUNS) $(VARIANT_RUNS)
	$(call keep,$(MAIN_RUNS) $(BUDGET_RUNS) $(ROUTER_RUNS) $(VARIANT_RUNS))
	$(PYTHON) -m study.report $(call kept,$(MAIN_RUNS)) --out results/cpu
	$(PYTHON) -m study.report $(call kept,$(MAIN_RUNS) $(BUDGET_RUNS)) --out results/cpu/budgets
	$(PYTHON) -m study.report $(VARIANT_BASE_RUNS) $(call kept,$(ROUTER_RUNS) $(VARIANT_RUNS)) --out results/cpu/variants
	@# each variant's cost per step against dense models matched to it (the finer experts' wider routers need
	@# match_tol 2.5% at this width), one thread
	mkdir -p results/cpu/variants/bench
	for c in $(foreach v,cpu_moe $(VARIANTS),$(call config_file,$(v))); do OMP_NUM_THREADS=1 $(PYTHON) bench.py \
		$$c --match_tol=0.025 > results/cpu/variants/bench/$$(basename $$c .py).txt || exit 1; done
# out/cpu_moe_rs_lr03-s7/done.json -> config/cpu_moe.py, seed 7, $(rs_lr03), named cpu_moe_rs_lr03
$(ROUTER_RUNS): out/cpu_moe_rs_%/done.json: | data/tinystories_bytes/meta.json
	$(PYTHON) train.py config/cpu_moe.py --seed=$(word 2,$(subst -s, ,$*)) $(rs_$(word 1,$(subst -s, ,$*))) \
		--config_name=cpu_moe_rs_$(word 1,$(subst -s, ,$*)) $(FIRST_PROTOCOL) $(if $(wildcard out/cpu_moe_rs_$*/log.jsonl),--resume=True)
# out/b25_cpu_moe-s3/done.json -> config/cpu_moe.py, seed 3, a quarter of the recipe's tokens, named b25_cpu_moe
$(BUDGET_RUNS): out/b%/done.json: | data/tinystories_bytes/meta.json
	$(PYTHON) train.py $(call config_file,$(call scan_config,$*)) --seed=$(word 2,$(subst -s, ,$*)) \
		--max_tokens=$$(($(RECIPE_TOKENS) * $(call scan_width,$*) / 100)) --config_name=b$(word 1,$(subst -s, ,$*)) \
		$(FIRST_PROTOCOL) $(if $(wildcard out/b$*/log.jsonl),--resume=True)

# make compute: who wins under which budget (results/cpu/compute). Each MoE of COMPUTE_MOES, at cpu_dense_total's
# total params, trained for the recipe's tokens (its main-protocol run), for cpu_dense_total's training FLOPs
# (flops_<config>: more tokens) and for cpu_dense_total's time on this machine (time_<config>, from bench.py's
# step times in results/cpu/compute/bench/<config>.txt, all configs in one process, one thread), each budget
# with its own warmup (the first protocol's) and cosine schedule; paired with cpu_dense_total of the same seeds,
# trained on the same kind of CPU. Each budget's tokens are planned once, into COMPUTE_BUDGETS
# (study/compute_budget.py), so a bench measured again later does not change them. The logs are kept in
# results/cpu/compute/runs/ (not runs/: another kind of CPU trained those).
COMPUTE_MOES ?= cpu_moe cpu_moe_sparse16 cpu_moe_shared
COMPUTE_SEEDS ?= 1 2 3 4 5
# more seeds where a column's answer needs them: cpu_moe in every column, the best MoE of each column
# (equal tokens: cpu_moe_shared, FLOPs: cpu_moe_sparse16, time: cpu_moe and cpu_moe_shared, a tie
# at 5 seeds), in the order they run
COMPUTE_MORE ?= cpu_dense_total time_cpu_moe cpu_moe_shared flops_cpu_moe_sparse16 \
	time_cpu_moe_shared cpu_moe flops_cpu_moe
COMPUTE_MORE_SEEDS ?= 6 7 8 9 10
COMPUTE_BENCH := results/cpu/compute/bench
compute_names := cpu_dense_total $(foreach c,$(COMPUTE_MOES),$(c) flops_$(c) time_$(c))
COMPUTE_BUDGETS := results/cpu/compute/budgets.json
# a run's folder: the main protocol's configs train in out/first/
first_dir = $(if $(filter cpu_moe cpu_dense_active cpu_dense_total,$1),out/first,out)/$1
compute_runs := $(foreach c,$(compute_names),$(foreach s,$(COMPUTE_SEEDS),$(call first_dir,$(c))-s$(s)/done.json)) \
	$(foreach c,$(COMPUTE_MORE),$(foreach s,$(COMPUTE_MORE_SEEDS),$(call first_dir,$(c))-s$(s)/done.json))
FLOPS_RUNS := $(filter out/flops_%,$(compute_runs))
TIME_RUNS := $(filter out/time_%,$(compute_runs))
COMPUTE_BASE_RUNS := $(filter-out $(FLOPS_RUNS) $(TIME_RUNS),$(compute_runs))
# the base runs no rule above trains (an MoE that is not a study config, e.g. cpu_moe_sparse16)
COMPUTE_OTHER_RUNS := $(filter-out out/first/% $(ABLATION_RUNS) $(VARIANT_RUNS),$(COMPUTE_BASE_RUNS))
$(COMPUTE_OTHER_RUNS): out/%/done.json: | data/tinystories_bytes/meta.json
	$(TRAIN) $(FIRST_PROTOCOL)
# the report; with make ratio's step-time ratios once they are measured
COMPUTE_REPORT = $(PYTHON) -m study.report $(call kept,$(compute_runs),results/cpu/compute/runs) \
	--out results/cpu/compute --bench $(COMPUTE_BENCH)
RATIO_REPORT = $(if $(wildcard $(RATIO)/*/*.txt),--ratio $(RATIO))
compute: setup $(compute_runs)
	$(call keep,$(compute_runs),results/cpu/compute/runs)
	$(COMPUTE_REPORT) $(RATIO_REPORT)
# bench.py's step times on this machine, one thread (as the study trains), before any time_ run needs them.
# Its dense_total is matched to each MoE; BENCH_ARGS_<config> make that cpu_dense_total (width 352) where the
# MoE's routers put it 1.2% away (cpu_moe_sparse16)
BENCH_ARGS_cpu_moe_sparse16 = --ffn_multiple_of=16 --match_tol=0.025
$(COMPUTE_BENCH)/%.txt:
	mkdir -p $(COMPUTE_BENCH)
	OMP_NUM_THREADS=1 $(PYTHON) bench.py $(call config_file,$*) --steps=20 --rounds=5 $(BENCH_ARGS_$*) \
		> $@.tmp && mv $@.tmp $@
# out/flops_cpu_moe-s2/done.json -> config/cpu_moe.py, seed 2, trained for cpu_dense_total's FLOPs
budget_config = $(word 1,$(subst -s, ,$1))
budget_seed = $(word 2,$(subst -s, ,$1))
$(FLOPS_RUNS): out/flops_%/done.json: | data/tinystories_bytes/meta.json
	$(PYTHON) train.py $(call config_file,$(call budget_config,$*)) --seed=$(call budget_seed,$*) \
		--config_name=flops_$(call budget_config,$*) --max_tokens=$$($(PYTHON) -m study.compute_budget tokens \
		flops_$(call budget_config,$*) $(COMPUTE_BUDGETS) $(COMPUTE_BENCH)) $(FIRST_PROTOCOL) \
		$(if $(wildcard out/flops_$*/log.jsonl),--resume=True)
# order-only: a run needs the step times to exist; a bench measured later does not retrain it
$(TIME_RUNS): out/time_%/done.json: | $(foreach c,$(COMPUTE_MOES),$(COMPUTE_BENCH)/$(c).txt) \
		data/tinystories_bytes/meta.json
	$(PYTHON) train.py $(call config_file,$(call budget_config,$*)) --seed=$(call budget_seed,$*) \
		--config_name=time_$(call budget_config,$*) --max_tokens=$$($(PYTHON) -m study.compute_budget tokens \
		time_$(call budget_config,$*) $(COMPUTE_BUDGETS) $(COMPUTE_BENCH)) $(FIRST_PROTOCOL) \
		$(if $(wildcard out/time_$*/log.jsonl),--resume=True)

# make ratio: what a machine charges for an MoE, r = cpu_dense_total's step time over the MoE's, as a distribution
# (results/cpu/compute/ratio/<setting>/<config>.txt; study/report.py --ratio sets them against k*). bench.py, one
# thread, the models interleaved step by step, RATIO_ROUNDS rounds, each round's ratio of medians: alone, beside a
# second bench of the same config (as make -j2 trains) and cpu_moe at the paper's width (d_model 160:
# cpu_moe_d160, no k* there). And whole runs: cpu_dense_total and the MoE at the recipe's tokens started together
# on PAIR_SEEDS (study/pair_ratio.py)
RATIO_ROUNDS ?= 10
PAIR_SEEDS ?= 1 2 3
RATIO := results/cpu/compute/ratio
RATIO_FILES := $(foreach s,alone side_by_side whole_runs,$(foreach c,$(COMPUTE_MOES),$(RATIO)/$(s)/$(c).txt)) \
	$(RATIO)/paper_width/cpu_moe_d160.txt
RATIO_BENCH = OMP_NUM_THREADS=1 $(PYTHON) bench.py $(call config_file,$*) --steps=10 --rounds=$(RATIO_ROUNDS) \
	$(BENCH_ARGS_$*)
ratio: setup
	@# -j1: two timings at once would be neither alone nor side by side
	$(MAKE) -j1 $(RATIO_FILES)
	$(COMPUTE_REPORT) --ratio $(RATIO)
$(RATIO)/alone/%.txt:
	mkdir -p $(@D)
	$(RATIO_BENCH) > $@.tmp && mv $@.tmp $@
# the second bench is only load: its output is dropped, but it must not have failed
$(RATIO)/side_by_side/%.txt:
	mkdir -p $(@D)
	$(RATIO_BENCH) > /dev/null & load=$$!; $(RATIO_BENCH) > $@.tmp && wait $$load && mv $@.tmp $@
pairs = $(foreach s,$(PAIR_SEEDS),out/pairs/$1-s$(s)/done)
# the pairs of the config in the file's name: its prerequisites are expanded a second time, with % known
.SECONDEXPANSION:
$(RATIO)/whole_runs/%.txt: $$(call pairs,$$*)
	mkdir -p $(@D)
	$(PYTHON) -m study.pair_ratio $(dir $^) > $@.tmp && mv $@.tmp $@
# out/pairs/cpu_moe-s2/done: cpu_dense_total and cpu_moe, seed 2, started together; a wall clock cut short means
# nothing, so an interrupted pair starts again
out/pairs/%/done: | data/tinystories_bytes/meta.json
	rm -rf $(@D) && mkdir -p $(@D)
	OMP_NUM_THREADS=1 $(PYTHON) train.py config/cpu_dense_total.py --seed=$(call budget_seed,$*) \
		--out_dir=$(@D)/dense_total & dense=$$!; \
	OMP_NUM_THREADS=1 $(PYTHON) train.py $(call config_file,$(call budget_config,$*)) --seed=$(call budget_seed,$*) \
		--out_dir=$(@D)/moe; moe=$$?; wait $$dense && [ $$moe -eq 0 ] && touch $@
$(RATIO)/paper_width/%_d160.txt:
	mkdir -p $(@D)
	OMP_NUM_THREADS=1 $(PYTHON) bench.py $(call config_file,$*) --d_model=160 --n_head=5 --moe_hidden=1632 \
		--ffn_multiple_of=32 --steps=1 --rounds=$(RATIO_ROUNDS) > $@.tmp && mv $@.tmp $@

# make warmup: the study under a warmup fixed in steps (results/cpu/warmup), the CPU recipe's since. The first
# protocol's warmup was 2% of the recipe's 1,120 steps, 22 steps, where the paper's 2% of 6,505 is 130. First a
# sweep of the trio at WARMUPS steps on WARMUP_SEEDS (22 steps: the first protocol, results/cpu/runs); then, at the
# warmup the rule in results/cpu/warmup/README.md picks from cpu_dense_total alone (WARMUP), the trio and
# cpu_moe_shared on WARMUP_STUDY_SEEDS and the trio at study2's budgets on WARMUP_SEEDS, the warmup in steps at
# every budget. Each run names its warmup (--warmup_iters), so the recipe's own setting changes none of them.
WARMUPS ?= 56 112 224
WARMUP_SEEDS ?= 1 2 3 4 5
# the rule's pick: cpu_dense_total's best mean over the sweep (results/cpu/warmup/report.md)
WARMUP ?= 224
WARMUP_STUDY_SEEDS ?= 1 2 3 4 5 6 7 8 9 10
# fresh seeds for the shared expert against dense_total, the test results/cpu/warmup/README.md fixed before them
WARMUP_REPLICATION_SEEDS ?= 11 12 13 14 15 16 17 18 19 20
WARMUP_CONFIGS := cpu_dense_total cpu_dense_active cpu_moe
warmup_runs = $(foreach w,$1,$(foreach c,$2,$(foreach s,$3,out/w$(w)_$(c)-s$(s)/done.json)))
WARMUP_SWEEP := $(call warmup_runs,$(WARMUPS),$(WARMUP_CONFIGS),$(WARMUP_SEEDS))
WARMUP_STUDY := $(call warmup_runs,$(WARMUP),$(WARMUP_CONFIGS) cpu_moe_shared,$(WARMUP_STUDY_SEEDS)) \
	$(call warmup_runs,$(WARMUP),cpu_dense_total cpu_moe_shared,$(WARMUP_REPLICATION_SEEDS))
WARMUP_BUDGETS := $(foreach b,$(BUDGETS),$(call warmup_runs,$(WARMUP)_b$(b),$(WARMUP_CONFIGS),$(WARMUP_SEEDS)))
WARMUP_RUNS := $(sort $(WARMUP_SWEEP) $(WARMUP_STUDY))
# beside them, the 2% runs kept by make study and study2, all on one kind of CPU for each seed's trio: seeds 1-5
# of the main protocol, seeds 6-10 retrained on the Xeon that trained the shared expert, and the 2% budgets
WARMUP_FRACTION_RUNS := $(foreach c,$(WARMUP_CONFIGS) cpu_moe_shared,$(foreach s,1 2 3 4 5,results/cpu/runs/$(c)-s$(s))) \
	$(wildcard results/cpu/reruns/xeon/cpu_*) $(foreach s,6 7 8 9 10,results/cpu/runs/cpu_moe_shared-s$(s)) \
	$(foreach b,$(BUDGETS),$(foreach c,$(WARMUP_CONFIGS),$(foreach s,$(BUDGET_SEEDS),results/cpu/runs/b$(b)_$(c)-s$(s))))
warmup: setup $(WARMUP_SWEEP) $(WARMUP_STUDY) $(WARMUP_BUDGETS)
	$(call keep,$(WARMUP_RUNS) $(WARMUP_BUDGETS),results/cpu/warmup/runs)
	$(PYTHON) -m study.warmup_report --chosen $(WARMUP) --out results/cpu/warmup $(WARMUP_FRACTION_RUNS) \
		$(call kept,$(WARMUP_RUNS) $(WARMUP_BUDGETS),results/cpu/warmup/runs)
# out/w112_cpu_moe-s3/done.json -> config/cpu_moe.py, seed 3, a warmup of 112 steps, named w112_cpu_moe
WARMUP_TRAIN = $(PYTHON) train.py $(call config_file,$(call scan_config,$*)) --seed=$(call budget_seed,$*) \
	--warmup_iters=$(call scan_width,$*) --config_name=w$(call budget_config,$*) \
	$(if $(wildcard out/w$*/log.jsonl),--resume=True)
$(WARMUP_RUNS): out/w%/done.json: | data/tinystories_bytes/meta.json
	$(WARMUP_TRAIN)
# out/w112_b25_cpu_moe-s3/done.json -> the same at a quarter of the recipe's tokens, named w112_b25_cpu_moe
$(WARMUP_BUDGETS): out/w$(WARMUP)_b%/done.json: | data/tinystories_bytes/meta.json
	$(PYTHON) train.py $(call config_file,$(call scan_config,$*)) --seed=$(call budget_seed,$*) \
		--warmup_iters=$(WARMUP) --max_tokens=$$(($(RECIPE_TOKENS) * $(call scan_width,$*) / 100)) \
		--config_name=w$(WARMUP)_b$(call budget_config,$*) $(if $(wildcard out/w$(WARMUP)_b$*/log.jsonl),--resume=True)

# make break_even: k*, the token multiplier at which each MoE matches cpu_dense_total (results/cpu/break_even), with
# the warmup fixed at WARMUP steps at every k, so k changes nothing but the tokens and the cosine's length. Each MoE
# of BREAK_EVEN_MOES at the multipliers BREAK_EVEN_KS_<config>, chosen to bracket its crossing from its gap at k = 1
# (make warmup's run; an MoE outside make warmup is trained at k = 1 here), on BREAK_EVEN_SEEDS_<config>, paired
# with make warmup's cpu_dense_total of the same seeds. The report sets k* against make ratio's step-time ratios.
BREAK_EVEN_MOES ?= cpu_moe cpu_moe_shared cpu_moe_sparse16
BREAK_EVEN_KS_cpu_moe ?= 0.9 1.1 1.2 1.35
BREAK_EVEN_KS_cpu_moe_shared ?= 0.8 0.9 1.1 1.2
BREAK_EVEN_KS_cpu_moe_sparse16 ?= 1.1 1.2 1.35 1.5
BREAK_EVEN_SEEDS_cpu_moe ?= $(WARMUP_STUDY_SEEDS)
BREAK_EVEN_SEEDS_cpu_moe_shared ?= $(WARMUP_STUDY_SEEDS)
BREAK_EVEN_SEEDS_cpu_moe_sparse16 ?= 1 2 3 4 5
k_runs = $(foreach k,$(BREAK_EVEN_KS_$1),$(foreach s,$(BREAK_EVEN_SEEDS_$1),out/k$(k)_w$(WARMUP)_$1-s$(s)/done.json))
BREAK_EVEN_RUNS := $(foreach c,$(BREAK_EVEN_MOES),$(call k_runs,$(c)))
# k = 1 and the dense_total of every seed
BREAK_EVEN_BASE := $(foreach c,$(BREAK_EVEN_MOES),$(call warmup_runs,$(WARMUP),$(c),$(BREAK_EVEN_SEEDS_$(c)))) \
	$(call warmup_runs,$(WARMUP),cpu_dense_total,$(sort $(foreach c,$(BREAK_EVEN_MOES),$(BREAK_EVEN_SEEDS_$(c)))))
BREAK_EVEN_OTHER_BASE := $(filter-out $(WARMUP_RUNS),$(BREAK_EVEN_BASE))
break_even: setup $(BREAK_EVEN_RUNS) $(BREAK_EVEN_BASE)
	$(call keep,$(BREAK_EVEN_RUNS) $(BREAK_EVEN_OTHER_BASE),results/cpu/break_even/runs)
	$(PYTHON) -m study.report $(call kept,$(filter $(WARMUP_RUNS),$(BREAK_EVEN_BASE)),results/cpu/warmup/runs) \
		$(call kept,$(BREAK_EVEN_RUNS) $(BREAK_EVEN_OTHER_BASE),results/cpu/break_even/runs) \
		--out results/cpu/break_even $(RATIO_REPORT)
$(BREAK_EVEN_OTHER_BASE): out/w%/done.json: | data/tinystories_bytes/meta.json
	$(WARMUP_TRAIN)
# out/k1.2_w224_cpu_moe-s3/done.json -> config/cpu_moe.py, seed 3, 1.2 x the recipe's tokens, a warmup of 224 steps
k_of = $(word 1,$(subst _, ,$1))
k_config = $(patsubst $(call k_of,$1)_w$(WARMUP)_%,%,$(call budget_config,$1))
$(BREAK_EVEN_RUNS): out/k%/done.json: | data/tinystories_bytes/meta.json
	$(PYTHON) train.py $(call config_file,$(call k_config,$*)) --seed=$(call budget_seed,$*) --warmup_iters=$(WARMUP) \
		--max_tokens=$$($(PYTHON) -c 'print(round($(RECIPE_TOKENS) * $(call k_of,$*)))') \
		--config_name=k$(call budget_config,$*) $(if $(wildcard out/k$*/log.jsonl),--resume=True)

# make claims: the paper's ablations and the activation rate under the CPU recipe (224 warmup steps, the
# recipe's tokens), on CLAIM_SEEDS, each paired with make warmup's trio of the same seeds (one kind of CPU, one
# thread a run). The ablations at cpu_moe's layout (4 x 88): top-1 with and without balancing, top-2 without the
# z-loss, top-2 without balancing. The activation rate at cpu_moe's total FFN size: 8 experts x 44 at top-k 1,
# 2, 4 and 8 (k = 8 runs every expert on every token: no sparsity). -> results/cpu/claims
CLAIM_SEEDS ?= 1 2 3 4 5 6 7 8 9 10
CLAIM_ABLATIONS := cpu_moe_top1 cpu_moe_top1_nolb cpu_moe_noz cpu_moe_nolb
CLAIM_ACTIVATION := cpu_moe_fine8_top1 cpu_moe_fine8_top2 cpu_moe_fine8 cpu_moe_fine8_top8
CLAIM_RUNS := $(call warmup_runs,$(WARMUP),$(CLAIM_ABLATIONS) $(CLAIM_ACTIVATION),$(CLAIM_SEEDS))
# the shared expert against dense_total on fresh seeds, under the criterion fixed before their runs in
# results/cpu/shared_preregistration.md -> results/cpu/claims (its own section)
SHARED_SEEDS ?= $(shell seq 21 50)
SHARED_RUNS := $(call warmup_runs,$(WARMUP),cpu_dense_total cpu_moe_shared,$(SHARED_SEEDS))
$(CLAIM_RUNS) $(SHARED_RUNS): out/w%/done.json: | data/tinystories_bytes/meta.json
	$(WARMUP_TRAIN)
claims_runs: $(CLAIM_RUNS)
shared_runs: $(SHARED_RUNS)
# the runs kept beside make warmup's, then the report: python -m study.claims rebuilds it from them
CLAIMS_REPORT = $(PYTHON) -m study.claims results/cpu/warmup/runs results/cpu/claims/runs \
	--out results/cpu/claims
claims: setup $(CLAIM_RUNS) $(SHARED_RUNS)
	$(call keep,$(CLAIM_RUNS) $(SHARED_RUNS),results/cpu/claims/runs)
	$(CLAIMS_REPORT)

# make route_runs: what the routers do and when their routing settles (route.py), under the CPU recipe on fresh
# seeds: cpu_moe, cpu_moe_shared, top-1 with balancing and 8 x 44 top-2, each keeping a checkpoint every 50 steps
# (out/route_<config>-s<seed>/ckpt_<step>.pt). Seed by seed, so that a stopped batch leaves whole seeds. The
# shared expert's question was fixed before these runs in results/cpu/route/prereg.md
ROUTE_SEEDS ?= $(shell seq 51 60)
ROUTE_CONFIGS := cpu_moe cpu_moe_shared cpu_moe_top1 cpu_moe_fine8_top2
ROUTE_RUNS := $(foreach s,$(ROUTE_SEEDS),$(foreach c,$(ROUTE_CONFIGS),out/route_$(c)-s$(s)/done.json))
.PHONY: route route_runs
route_runs: $(ROUTE_RUNS)
# out/route_cpu_moe-s51/done.json -> config/cpu_moe.py, seed 51, named route_cpu_moe
$(ROUTE_RUNS): out/route_%/done.json: | data/tinystories_bytes/meta.json
	$(PYTHON) train.py $(call config_file,$(word 1,$(subst -s, ,$*))) --seed=$(word 2,$(subst -s, ,$*)) \
		--config_name=route_$(word 1,$(subst -s, ,$*)) --keep_checkpoints=True --ckpt_interval=50 \
		$(if $(wildcard out/route_$*/log.jsonl),--resume=True)
# make route: route.py's statistics (--stats, the validation split) and settling curve (--settle) of each run,
# the files kept in results/cpu/route/runs, then the report with the pre-registered test -> results/cpu/route
ROUTE_DONE := $(ROUTE_RUNS:done.json=route/settle.json)
$(ROUTE_DONE): out/route_%/route/settle.json: out/route_%/done.json
	$(PYTHON) route.py --out_dir out/route_$* --stats --settle --device cpu
route: setup $(ROUTE_DONE)
	for run in $(dir $(ROUTE_RUNS)); do mkdir -p results/cpu/route/runs/$$(basename $$run) && \
		cp $$run/log.jsonl $$run/config.json $$run/route/stats.json $$run/route/settle.json \
		results/cpu/route/runs/$$(basename $$run)/; done
	$(PYTHON) -m study.route_report results/cpu/route/runs --out results/cpu/route
