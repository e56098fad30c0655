# The CPU-scale recipe shared by every cpu_* config: bytes tokenizer, data prepared from a local TinyStories
# file (prepare.py --input ../shared/data/tinystories_train_head.txt --tokenizer bytes), sized so one run
# takes a few minutes on 2 CPU cores. The cpu_* configs import it and change only the feed-forward block.
data_dir = 'data/tinystories_bytes'
vocab_size = 257          # 256 byte values + EOT
block_size = 256          # ~1/3 of a story in bytes
n_layer = 4               # the paper's depth
n_head = 2                # head_dim 24
d_model = 48
n_experts = 4
top_k = 2
moe_hidden = 96           # 0.27M total / 0.16M active params for the MoE
# 18 training tokens per total MoE param (the paper: ~20; 18 keeps all nine runs within 45 minutes on two
# cores): 4.9M tokens, 1.22 epochs of the 4.0M-byte train split, in 1,197 steps of 4,096 tokens.
# Small batches: the MoE needs many optimizer steps.
batch_size = 16
max_tokens = 4_900_000
learning_rate = 3e-3
min_lr = 3e-4
warmup_frac = 0.02
eval_interval = 200       # 8 evaluations of the whole validation split
eval_tokens = 2**20       # more than the ~190K-byte validation split: evaluate on all of it
log_interval = 25
