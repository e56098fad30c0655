# Activation rate, CPU scale: 8 experts x 44 (cpu_moe's total FFN size, as cpu_moe_fine8), top-1.
from config.cpu_moe import *

n_experts = 8
moe_hidden = 44
top_k = 1
