# Variant, CPU scale: finer experts at cpu_moe's active and total FFN size, 8 experts x 44 wide,
# top-4 (DeepSeekMoE, OLMoE: finer experts at equal active and total params).
from config.cpu_moe import *

n_experts = 8
top_k = 4
moe_hidden = 44
