# CPU scale, MoE: 4 experts, top-2, Switch load balancing + router z-loss. Another layout: a config
# that imports this one and changes n_experts, top_k, moe_hidden (README: "Add an expert layout").
from config.cpu_recipe import *

ffn = 'moe'
n_experts = 4
top_k = 2
moe_hidden = 88           # 0.23M total / 0.14M active params
