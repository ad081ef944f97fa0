"""The transformer: modules, parameter groups, the bf16 weight copy and the KV cache for sampling."""
