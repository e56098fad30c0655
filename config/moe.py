# Paper scale, MoE: 4 experts, top-2
# (the recipe, including the MoE settings, is train.py's defaults).
ffn = 'moe'
