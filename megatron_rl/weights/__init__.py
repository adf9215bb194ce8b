"""Weights between layouts: Megatron shards ↔ full tensors ↔ Hugging Face names, and transports."""
