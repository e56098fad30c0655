# CPU scale, MoE whose routers learn at a tenth of the learning rate (cpu_moe otherwise):
# the router start with the steadiest plateau exit on seeds 6-10 of the screen in
# results/cpu/README.md (not on seeds 1-3).
from config.cpu_moe import *

router_lr_mult = 0.1
