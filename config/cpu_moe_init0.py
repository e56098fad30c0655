# CPU scale, MoE with a zero router: every expert equally likely at the start (cpu_moe otherwise), the router
# start that left the training-CE plateau earliest in the screen of results/cpu/README.md.
from config.cpu_moe import *
router_init_std = 0.0
