"""Megatron-Core glue: the tree core-attention module, TreeGPTModel, the spec rewrite, the value
head, the MoE layer with router losses as if unpacked (and routing replay), expert statistics and
the
training step. Its modules import Megatron at the top."""
