# Variant, CPU scale: finer still, 16 experts x 22 wide, top-8
# (cpu_moe's active and total FFN size).
from config.cpu_moe import *

n_experts = 16
top_k = 8
moe_hidden = 22
