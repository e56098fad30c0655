# CPU scale, dense SwiGLU whose total params match the *total* params of the MoE it imports:
# cpu_moe. For another MoE, import its config instead (README: "Add an expert layout").
from config.cpu_moe import *

ffn = 'dense'
match = 'total'
