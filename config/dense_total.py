# Paper scale, dense SwiGLU sized so its total params match the MoE's *total* params (~21.06M).
ffn = 'dense'
match = 'total'
