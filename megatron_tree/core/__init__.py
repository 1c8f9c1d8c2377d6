"""The pure-torch core of tree training: imports no Megatron, mbridge or transformers."""
