"""`hafiza codec bench`: real KV of the default model through every lossless coder and its peers, with timings."""
