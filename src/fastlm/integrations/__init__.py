"""fastlm's kernels inside other libraries' models: `huggingface` patches a built transformers model;
`trl` gives TRL's DPO trainer fastlm's loss."""
