"""Tokenizers: tiktoken files (Llama 3, cl100k_base), the chat template, and BPE training."""
