"""Model families: our ModelConfig -> Megatron TransformerConfig + layer spec; HF name maps."""
