# Ablation, CPU scale: top-2 without load balancing (the router z-loss stays).
from config.cpu_moe import *

aux_loss_coef = 0.0
