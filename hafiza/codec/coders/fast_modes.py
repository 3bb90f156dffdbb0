"""The `fast` coder's sign modes: what the top bit of a symbol holds. Shared by the coder (fast.py) and its
compiled decode kernel (fast_kernel.py), so neither imports the other's module at load."""

from __future__ import annotations

SIGN_AS_IS, SIGN_CHANGE, SIGN_MAJORITY = 0, 1, 2  # the sign XOR nothing / the previous token's sign / the chunk's
# majority sign of the channel
