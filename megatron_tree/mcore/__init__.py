"""Megatron-Core glue: the tree core-attention module, TreeGPTModel, the spec rewrite, the value head
and the training step. Its modules import Megatron at the top."""
