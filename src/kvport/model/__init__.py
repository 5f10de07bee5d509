"""Model package: config, RoPE, the Llama-family decoder, tokenizer, loader and builtin models."""
