# Ablation, paper scale: top-2 without the router z-loss.
from config.moe import *

z_loss_coef = 0.0
