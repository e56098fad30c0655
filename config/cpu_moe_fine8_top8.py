# Activation rate, CPU scale: 8 experts x 44 (cpu_moe's total FFN size, as cpu_moe_fine8), top-8:
# every expert runs on every token, the control with no sparsity.
from config.cpu_moe_fine8 import *

top_k = 8
