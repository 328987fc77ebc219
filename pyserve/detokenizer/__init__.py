"""The detokenizer subprocess: incremental, batched, UTF-8 safe decoding and stop strings."""
