"""Checkpoint formats: native folders, Hugging Face (Llama, Mistral, Qwen2), Meta and GGUF, and the tokenizer files
each carries."""
