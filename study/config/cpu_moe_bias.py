# Variant, CPU scale: aux-loss-free balancing (DeepSeek-V3) instead of the Switch loss:
# a per-expert bias on the scores used for top-k selection only, moved by 1e-3 after each step
# towards equal load.
from config.cpu_moe import *

aux_loss_coef = 0.0
bias_rate = 1e-3
