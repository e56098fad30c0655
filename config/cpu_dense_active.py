# CPU scale, dense SwiGLU whose total params match the cpu_moe's *active* params.
from config.cpu_recipe import *

ffn = 'dense'
match = 'active'
