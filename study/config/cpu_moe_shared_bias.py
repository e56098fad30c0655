# Variant, CPU scale: the shared expert (cpu_moe_shared)
# with aux-loss-free bias balancing (cpu_moe_bias).
from config.cpu_moe import *

shared_hidden = 88
n_experts = 6
moe_hidden = 44
aux_loss_coef = 0.0
bias_rate = 1e-3
