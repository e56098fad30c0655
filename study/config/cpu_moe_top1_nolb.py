# Ablation, CPU scale: top-1 routing without load balancing (the naive router; does it collapse?).
from config.cpu_moe import *

top_k = 1
aux_loss_coef = 0.0
