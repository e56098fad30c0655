# CPU scale, MoE whose routers learn at a tenth of the learning rate (cpu_moe otherwise): the router start with
# the earliest and steadiest plateau exit in the screen of results/cpu/README.md.
from config.cpu_moe import *
router_lr_mult = 0.1
