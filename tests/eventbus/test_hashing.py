"""Block identity: deterministic, chained, salted, LoRA-separated; the documented byte layout."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

from eventbus.hashing import ROOT, block_digest, block_hash, chain_digests, pack_tokens, prompt_block_hashes


def test_digest_follows_the_documented_layout():
    tokens = list(range(32))
    expected = hashlib.blake2b(
        ROOT + struct.pack("<BQII", 0, 0, 32, 0) + struct.pack("<32I", *tokens),
        digest_size=32, person=b"kvflow-block-v1",
    ).digest()
    assert block_digest(None, tokens) == expected
    assert block_hash(expected) == int.from_bytes(expected[:8], "big")
    salted = hashlib.blake2b(
        ROOT + struct.pack("<BQII", 3, 7, 32, 2) + b"t1" + struct.pack("<32I", *tokens),
        digest_size=32, person=b"kvflow-block-v1",
    ).digest()
    assert block_digest(None, tokens, lora_id=7, cache_salt="t1") == salted


def test_known_vectors_are_stable_across_processes_and_releases():
    # Changing these values changes block identity on the wire and in SQL: a contract change.
    assert _in_fresh_interpreter() == "9e00ff98b939f136"
    assert block_digest(None, list(range(32)), lora_id=7, cache_salt="t1").hex() == (
        "a99c8a882228a205de96d3b891314240e8e053439912dd3ae70b5ed1caaf922e")


def _in_fresh_interpreter() -> str:
    code = ("from eventbus.hashing import block_digest, block_hash;"
            "print(f'{block_hash(block_digest(None, list(range(32)))):016x}')")
    # A separate interpreter with a different hash seed: nothing depends on Python's hash().
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""})
    return out.stdout.strip()


def test_chain_equals_block_by_block_and_only_full_blocks_count():
    tokens = list(range(100))
    chain = chain_digests(tokens, 32, lora_id=3, cache_salt="s")
    assert len(chain) == 3
    parent = None
    for i, d in enumerate(chain):
        parent = block_digest(parent, tokens[i * 32:(i + 1) * 32], lora_id=3, cache_salt="s")
        assert d == parent


def test_prefixes_share_digests_and_divergence_changes_every_later_block():
    a = chain_digests(list(range(96)), 32)
    b = chain_digests(list(range(64)) + [0] * 32, 32)
    c = chain_digests([1] + list(range(1, 96)), 32)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c, strict=True))


def test_salt_enters_only_the_first_block_and_separates_tenants():
    t = list(range(64))
    plain, s1, s2 = chain_digests(t, 32), chain_digests(t, 32, cache_salt="a"), chain_digests(t, 32, cache_salt="b")
    assert len({plain[0], s1[0], s2[0]}) == 3
    # A continued chain does not re-apply the salt.
    cont = chain_digests(t[32:], 32, cache_salt="a", parent=s1[0])
    assert cont == s1[1:]


def test_lora_none_differs_from_lora_zero():
    t = list(range(32))
    assert block_digest(None, t) != block_digest(None, t, lora_id=0)


def test_tokens_pack_little_endian_u32():
    assert pack_tokens([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"
    assert prompt_block_hashes(list(range(31)), 32) == []


def _heads(packed: bytes, signed: bool) -> list[int]:
    return [int.from_bytes(packed[i:i + 8], "big", signed=signed) for i in range(0, len(packed), 8)]


def test_packed_heads_are_the_wire_hashes_and_read_signed_the_sql_hashes():
    from eventbus.hashing import prompt_hash_heads
    from eventbus.protocol import to_sql

    tokens = list(range(500))
    wire = prompt_block_hashes(tokens, 32, cache_salt="x")
    heads = prompt_hash_heads(tokens, 32, cache_salt="x")
    assert _heads(heads, signed=False) == wire
    assert _heads(heads, signed=True) == [to_sql(h) for h in wire]


def test_bytes_are_byte_tokens_everywhere():
    """``bytes`` is a sequence of token ids 0–255 (the byte tokenizer): the strided fast path of
    pack_tokens, chain_digests and prompt_hash_heads give what the list of ints gives."""
    from eventbus.hashing import prompt_hash_heads
    from eventbus.protocol import to_sql

    data = bytes(range(256)) * 3 + b"tail"
    ints = list(data)
    assert pack_tokens(data) == pack_tokens(ints) == pack_tokens(bytearray(data))
    assert block_digest(None, data[:32]) == block_digest(None, ints[:32])
    assert chain_digests(data, 32, cache_salt="s") == chain_digests(ints, 32, cache_salt="s")
    heads = prompt_hash_heads(data, 32, lora_id=2)
    assert len(heads) == 8 * (len(data) // 32)
    assert _heads(heads, signed=True) == [to_sql(h) for h in prompt_block_hashes(ints, 32, lora_id=2)]
