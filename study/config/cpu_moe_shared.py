# Variant, CPU scale: one always-on shared expert 88 wide plus 6 routed experts x 44, top-2
# (DeepSeekMoE): cpu_moe's active (88 + 2 x 44) and total (88 + 6 x 44) FFN size.
from config.cpu_moe import *

shared_hidden = 88
n_experts = 6
moe_hidden = 44
