"""What every drafter kind's model shares: the Qwen3 blocks (`blocks`: RoPE, RMSNorm, SwiGLU MLP, the dims
copied from a target), attention backends and block masks (`attention`), and weight I/O (`weights`: shared
target modules, one safetensors + config.json per folder, exact loads). Each kind's own model lives in its
folder, `draftflow/drafters/<kind>/model.py`.
"""
