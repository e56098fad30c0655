# Variant, CPU scale: the shared expert 88 wide with finer routed experts, 12 x 22, top-4: cpu_moe's
# active (88 + 4 x 22) and total (88 + 12 x 22) FFN size.
from config.cpu_moe import *

shared_hidden = 88
n_experts = 12
moe_hidden = 22
top_k = 4
