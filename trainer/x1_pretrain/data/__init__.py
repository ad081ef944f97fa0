"""Text to training windows: the tokenizer, corpus download and tokenizing, the token-file loader."""
