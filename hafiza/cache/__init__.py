"""KV memory: the paged pool of K/V tensors, the block manager with prefix caching, and memory accounting."""
