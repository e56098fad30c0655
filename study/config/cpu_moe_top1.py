# Ablation, CPU scale: top-1 routing with Switch load balancing.
from config.cpu_moe import *

top_k = 1
