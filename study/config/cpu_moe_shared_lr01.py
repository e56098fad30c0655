# Variant, CPU scale: the shared expert (cpu_moe_shared) with the routers at a tenth of the
# learning rate (cpu_moe_lr01): the best variant with the router start that looked best on
# seeds 6-10 (not over 8 seeds).
from config.cpu_moe import *

shared_hidden = 88
n_experts = 6
moe_hidden = 44
router_lr_mult = 0.1
