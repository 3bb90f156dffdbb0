"""KV memory: the paged pool and its storage formats, the block manager with prefix caching, eviction policies
and memory sizing."""
