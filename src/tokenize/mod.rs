//! Chat template and tokenizer to token ids, assistant masks and packed micro-batches.
