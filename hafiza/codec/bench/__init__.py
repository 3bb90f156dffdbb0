"""`hafiza codec bench`: real KV of the default model through every coder and its peers, with timings."""
