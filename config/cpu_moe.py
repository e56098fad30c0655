# CPU scale, MoE: 4 experts, top-2, Switch load balancing + router z-loss.
from config.cpu_recipe import *

ffn = 'moe'
