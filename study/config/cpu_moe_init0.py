# CPU scale, MoE with a zero router: every expert equally likely at the start (cpu_moe otherwise),
# one of the router starts screened in results/cpu/README.md
# (it leaves the training-CE plateau no sooner than cpu_moe).
from config.cpu_moe import *

router_init_std = 0.0
