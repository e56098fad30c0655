# Paper scale, dense SwiGLU sized so its total params match the MoE's *active* params (~14.77M).
ffn = 'dense'
match = 'active'
