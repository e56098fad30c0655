# Variant, CPU scale: the shared expert (cpu_moe_shared) with the routers at a tenth of the learning rate
# (cpu_moe_lr01): the best variant with the best router start.
from config.cpu_moe_shared import *
router_lr_mult = 0.1
