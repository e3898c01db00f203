"""Token data for training: `prepare` tokenizes text into memory-mapped shards (`fastlm data
prepare`), `manifest` describes them and checks them (`verify`: `fastlm data verify`), `tokens`
reads them as windows in a seeded order, `tokenizer` turns text into ids."""
