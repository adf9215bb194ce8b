"""Datasets, prompt templates, tokenizers."""
