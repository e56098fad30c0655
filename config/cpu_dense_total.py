# CPU scale, dense SwiGLU whose total params match the cpu_moe's *total* params.
from config.cpu_recipe import *

ffn = 'dense'
match = 'total'
