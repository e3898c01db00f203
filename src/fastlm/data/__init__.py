"""Token data for training: `prepare` tokenizes text into memory-mapped shards (`fastlm data
prepare`), `tokens` reads them as windows in a seeded order, `tokenizer` turns text into ids."""
