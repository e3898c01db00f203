"""fastlm's kernels inside other libraries' models: `huggingface` patches a built transformers model."""
