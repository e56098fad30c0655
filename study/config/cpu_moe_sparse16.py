# Low activation, CPU scale: cpu_moe's total FFN size in 16 experts x 22 wide, top-2: 30% of the
# params active (cpu_moe: 59%), a token costs 0.63x cpu_moe's FLOPs. Its routers (16 x 44 a
# layer) make it 1.2% larger than cpu_dense_total, which has none.
from config.cpu_moe import *

n_experts = 16
top_k = 2
moe_hidden = 22
