# Ablation, CPU scale: top-2 without the router z-loss.
from config.cpu_moe import *

z_loss_coef = 0.0
