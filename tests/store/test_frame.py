"""The integrity frame and the block key format."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafiza.store.frame import HEADER, FrameError, pack, unpack
from hafiza.store.keys import block_key

keys = st.text(min_size=1, max_size=40)
payloads = st.binary(max_size=2048)


@given(keys, payloads)
def test_roundtrip(key: str, payload: bytes) -> None:
    frame = pack(key, payload)
    assert len(frame) == HEADER.size + len(key.encode()) + len(payload)
    assert unpack(key, frame) == payload


@given(keys, payloads, st.data())
def test_any_changed_byte_is_detected(key: str, payload: bytes, data: st.DataObject) -> None:
    frame = bytearray(pack(key, payload))
    i = data.draw(st.integers(0, len(frame) - 1))
    frame[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(FrameError):
        unpack(key, bytes(frame))


@given(keys, payloads, st.data())
def test_any_truncation_or_extension_is_detected(key: str, payload: bytes, data: st.DataObject) -> None:
    frame = pack(key, payload)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(FrameError):
        unpack(key, frame[:cut])
    with pytest.raises(FrameError):
        unpack(key, frame + data.draw(st.binary(min_size=1, max_size=8)))


def test_value_under_another_key_is_rejected() -> None:
    with pytest.raises(FrameError, match="holds key"):
        unpack("b", pack("a", b"payload"))


def test_block_key_separates_everything_that_changes_the_bytes() -> None:
    base = ("0123abcd" * 4, "smollm2-135m-q8", "bf16", 16, "zstd1")
    key = block_key(*base)
    assert key == "hz1:smollm2-135m-q8:bf16:16:zstd1:" + "0123abcd" * 4
    variants = {
        block_key("ffffffff" * 4, *base[1:]),
        block_key(base[0], "other-model", *base[2:]),
        block_key(*base[:2], "fp32", *base[3:]),
        block_key(*base[:3], 32, base[4]),
        block_key(*base[:4], "raw"),
    }
    assert key not in variants and len(variants) == 5
    assert block_key("0123ABCD" * 4, *base[1:]) == key  # hex case does not matter


@pytest.mark.parametrize(
    "args",
    [
        ("xyz", "m", "bf16", 16, "raw"),  # not hex
        ("0123abcd", "m:x", "bf16", 16, "raw"),  # separator inside a component
        ("0123abcd", "m", "", 16, "raw"),
        ("0123abcd", "m", "bf16", 0, "raw"),
        ("0123abcd", "m", "bf16", 16, "a/b"),
    ],
)
def test_block_key_rejects_ambiguous_components(args: tuple) -> None:
    with pytest.raises(ValueError):
        block_key(*args)
