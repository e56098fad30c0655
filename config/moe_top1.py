# Ablation, paper scale: top-1 routing with Switch load balancing.
from config.moe import *

top_k = 1
