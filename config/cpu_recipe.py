# The CPU-scale recipe shared by every cpu_* config: bytes tokenizer, 5,510 TinyStories stories
# (make cpu: prepare.py --hf_stories 5510, or --input FILE for a local file), sized so one run takes
# a few minutes on 2 CPU cores. config/cpu_moe.py adds the expert layout, and the dense configs
# import cpu_moe.py: the MoE a dense config imports is the one it is matched to.
data_dir = 'data/tinystories_bytes'
vocab_size = 257          # 256 byte values + EOT
block_size = 256          # ~1/3 of a story in bytes
n_layer = 4               # the paper's depth
n_head = 2                # head_dim 22
d_model = 44
# fine-grained matched widths; GPU-friendly multiples do not matter on a CPU
ffn_multiple_of = 8
# 20 training tokens per total MoE param, as in the paper: 4.59M tokens (1.15 epochs of the
# 4.0M-byte train split) in 1,120 steps of 4,096 tokens. Small batches: the MoE needs many optimizer
# steps. d_model 44 is what lets a run take under 5 minutes and all nine about 40 on two cores at
# this ratio.
batch_size = 16
max_tokens = 4_585_000
learning_rate = 3e-3
min_lr = 3e-4
# the warmup in steps, whatever the run's length: 2% of 1,120 steps (22, the paper's fraction) left
# the MoE's routers on a plateau for 100-250 steps and its seeds far apart. 224 is what a sweep of
# 22, 56, 112 and 224 steps picked for cpu_dense_total alone (results/cpu/warmup/README.md)
warmup_iters = 224
eval_interval = 200       # 8 evaluations of the whole validation split
eval_tokens = 2**20       # more than the ~190K-byte validation split: evaluate on all of it
log_interval = 25
