"""qwen2: llama's block with biases on the q, k and v projections.

Config: HF ``Qwen2Config`` (``attention_bias`` absent means biases, which every
Qwen2 checkpoint carries; embeddings often tied). GGUF: llama.cpp's llama
names plus ``blk.N.attn_{q,k,v}.bias``; its converter leaves qwen2's q/k rows
in HF order (no permutation to undo).
"""

from engine.models.llama import Llama

QWEN2 = Llama("qwen2", ("qwen2",), ("qwen2",), qkv_bias_default=True, gguf_permuted_qk=False)
