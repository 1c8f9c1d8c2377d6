"""HuggingFace <-> Megatron bridges made to build tree-attention models (mbridge)."""
