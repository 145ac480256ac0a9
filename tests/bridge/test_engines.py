"""The test engines themselves: real vLLM 0.33.0 and SGLang 0.5.23 KV event code, read with nothing
but pyzmq and msgspec (what any subscriber sees). ``make test`` installs the engines (``make
engines``) and sets KVFLOW_REQUIRE_ENGINES=1, so there a missing engine fails instead of skipping."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import subprocess
import sys
import sysconfig
from array import array
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from eventbus.hashing import prompt_block_hashes
from tests.bridge.engines import (
    EngineProcess,
    SglangEngine,
    VllmEngine,
    engine_hashes,
    expected_kvflow_hashes,
    receive,
    replay,
    require,
    subscribe,
)

pytestmark = pytest.mark.unit

BS = 16
PROMPT = list(range(1000, 1040))  # 2 full blocks and 8 tokens
LORA = {"name": "adapterA", "id": 7}
FILLS = [list(range(5000 + 100 * i, 5000 + 100 * i + 4 * BS + 3)) for i in range(4)]  # 4 full blocks each
LAST_FILL = FILLS[-1]


@pytest.fixture(scope="module", params=[True, False], ids=["int-hashes", "bytes-hashes"])
def vllm(request: pytest.FixtureRequest) -> Iterator[VllmEngine]:
    require("vllm")
    with VllmEngine(block_size=BS, num_blocks=16, int_hashes=request.param) as eng:
        yield eng


@pytest.fixture(scope="module")
def sglang() -> Iterator[SglangEngine]:
    require("sglang")
    with SglangEngine(block_size=BS, num_blocks=16) as eng:
        yield eng


def decode_all(messages: list[list[bytes]]) -> list[tuple[int, Any]]:
    out = []
    for frames in messages:
        assert len(frames) == 3, frames
        topic, seq, payload = frames
        assert topic == b"" and len(seq) == 8
        out.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    return out


def live_hashes(events: list[dict[str, Any]]) -> set[Any]:
    """What the stream says is cached: stores minus removals, per hash (counted: vLLM stores a
    hash again when it recomputes a block, and removes each copy)."""
    count: Counter[Any] = Counter()
    for ev in events:
        if ev["type"] == "AllBlocksCleared":
            count.clear()
        for h in ev.get("block_hashes", []):  # state() gives 32-byte hashes in hex
            count[h.hex() if isinstance(h, bytes) else h] += 1 if ev["type"] == "BlockStored" else -1
    return {h for h, n in count.items() if n > 0}


def run_every_kind(eng: EngineProcess) -> dict[str, Any]:
    """A fresh engine through stores, a reuse, a LoRA request, evictions, a reset and one more
    request; the batches a plain SUB received, the replies and the states along the way."""
    eng.restart()
    events_url, _ = eng.endpoints
    sub = subscribe(events_url)
    try:
        first = eng.request("r1", PROMPT, decode=10)
        assert first["num_computed_tokens"] == 0 and first["published"] is not None
        assert eng.request("r2", PROMPT, decode=1)["num_computed_tokens"] == 2 * BS  # reuse
        eng.request("lora", PROMPT, lora=LORA)
        for i, tokens in enumerate(FILLS):  # 16 more blocks into a pool of 16: evictions
            eng.request(f"fill{i}", tokens)
        before = eng.state()
        reset = eng.reset()
        assert eng.state()["blocks"] == []
        after = eng.request("after", PROMPT)
        batches = decode_all(receive(sub, count=after["published"] + 1))
        assert receive(sub, idle=0.3) == []
    finally:
        sub.close()
    return {"batches": batches, "before": before, "reset": reset, "after": after, "state": eng.state()}


def check_stream(eng: EngineProcess, run: dict[str, Any]) -> list[dict[str, Any]]:
    batches = run["batches"]
    seqs = [seq for seq, _ in batches]
    assert seqs == list(range(len(batches)))
    assert all(isinstance(b[1][0], float) and b[1][2] == 0 for b in batches)  # [ts, events, rank]
    events = [ev for _seq, (_ts, evs, _rank) in batches for ev in evs]
    kinds = Counter(ev["type"] for ev in events)
    assert kinds["BlockStored"] and kinds["BlockRemoved"] and kinds["AllBlocksCleared"] == 1, kinds
    lora_stores = [ev for ev in events if ev["type"] == "BlockStored" and ev.get("lora_name") == "adapterA"]
    assert lora_stores and lora_stores[0]["token_ids"] == PROMPT[: 2 * BS]
    # The harness's ground truth is what the stream says, before the reset and after it.
    clear = events.index({"type": "AllBlocksCleared"})
    assert engine_hashes(run["before"]) == live_hashes(events[:clear])
    assert engine_hashes(run["state"]) == live_hashes(events[clear:]) and run["state"]["blocks"]
    assert run["state"]["next_seq"] == len(batches)
    kvflow = expected_kvflow_hashes(run["before"], BS)
    assert len(kvflow) == len(run["before"]["blocks"])
    # The last request before the reset has all its blocks cached: their kvflow hashes are its prompt's.
    assert set(prompt_block_hashes(LAST_FILL, BS)) <= kvflow
    assert expected_kvflow_hashes(run["state"], BS) == set(prompt_block_hashes(PROMPT, BS))
    # Replay: every batch again, then the end marker; from past the end, only the marker.
    _, replay_url = eng.endpoints
    again = decode_all(replay(replay_url, 0))
    assert [s for s, _ in again] == seqs and again == batches
    assert decode_all(replay(replay_url, 3)) == batches[3:]
    assert replay(replay_url, len(batches)) == []
    return events


def test_vllm_publishes_every_event_kind(vllm: VllmEngine) -> None:
    run = run_every_kind(vllm)
    events = check_stream(vllm, run)
    int_hashes = vllm.info["int_hashes"]
    for ev in events:
        for h in ev.get("block_hashes", []):
            assert (isinstance(h, int) and 0 <= h < 2**64) if int_hashes else (isinstance(h, bytes) and len(h) == 32)
    stored = events[0]
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
    assert stored["token_ids"] == PROMPT[: 2 * BS] and stored["block_size"] == BS
    assert stored["kv_cache_spec_kind"] == "full_attention" and stored["medium"] == "GPU"

    # vLLM's sha256 block hash: NONE_HASH = sha256(pickle(seed)), then sha256(pickle((parent, tokens, extra))).
    def sha(obj: Any) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    first = sha((sha(os.environ.get("PYTHONHASHSEED", "vllm-none-hash")), tuple(PROMPT[:BS]), None))
    assert stored["block_hashes"][0] == (int.from_bytes(first[-8:], "big") if int_hashes else first)
    lora = next(ev for ev in events if ev.get("lora_name") == "adapterA")
    assert lora["lora_id"] == 7 and lora["extra_keys"] == [["adapterA"], ["adapterA"]]
    # The reset published nothing: its AllBlocksCleared opened the next request's batch.
    assert run["reset"]["published"] is None and run["reset"]["pending"] is True
    _, (_, last_events, _) = run["batches"][-1]
    assert [ev["type"] for ev in last_events] == ["AllBlocksCleared", "BlockStored"]


def test_vllm_duplicate_store_of_a_recomputed_block(vllm: VllmEngine) -> None:
    """A block-aligned prompt that is fully cached recomputes its last block (the hit stops at
    len - 1): vLLM stores the same hash a second time, in another block, and removes each copy."""
    vllm.restart()
    tokens = list(range(7000, 7000 + 2 * BS))
    h = vllm.request("a", tokens)["block_hashes"]
    again = vllm.request("b", tokens)
    assert again["num_computed_tokens"] == BS and again["published"] is not None
    copies = {b["engine_hash"]: b["copies"] for b in vllm.state()["blocks"]}
    assert copies == {h[0]: 1, h[1]: 2}


def test_vllm_reset_is_refused_while_a_request_holds_blocks(vllm: VllmEngine) -> None:
    vllm.restart()
    vllm.request("held", PROMPT, free=False)
    refused = vllm.reset(check=False)
    assert refused["ok"] is False and refused["published"] is None and refused["pending"] is False
    assert vllm.state()["live"] == ["held"]
    vllm.free("held")
    assert vllm.reset(publish_now=True)["published"] is not None
    vllm.request("held", PROMPT, free=False)
    forced = vllm.reset(running=True, publish_now=True)  # reset_running_requests: preempted first
    assert forced["ok"] and forced["published"] is not None
    assert vllm.state()["blocks"] == [] and vllm.state()["live"] == []


def check_restart_and_garbage(eng: EngineProcess) -> None:
    """After a restart seq starts at 0 again and the cache is empty; junk comes as it was asked."""
    eng.request("before", PROMPT)
    eng.restart()
    assert eng.state()["blocks"] == [] and eng.state()["next_seq"] == 0
    events_url, replay_url = eng.endpoints
    sub = subscribe(events_url)
    try:
        assert eng.request("after", PROMPT)["published"] == 0
        assert eng.garbage("frames")["published"] is None
        assert eng.garbage("payload")["published"] == 1
        assert eng.garbage("batch")["published"] == 2
        got = receive(sub, count=4)
    finally:
        sub.close()
    assert int.from_bytes(got[0][1], "big") == 0 and len(got[1]) == 2
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.decode(got[2][2])
    assert msgspec.msgpack.decode(got[3][2])[:2] == ["not-a-timestamp", 42]
    assert [int.from_bytes(f[1], "big") for f in replay(replay_url, 0)] == [0, 1, 2]


def test_vllm_restart_and_garbage(vllm: VllmEngine) -> None:
    check_restart_and_garbage(vllm)


def test_sglang_publishes_every_event_kind(sglang: SglangEngine) -> None:
    run = run_every_kind(sglang)
    events = check_stream(sglang, run)
    _, (_, reset_events, _) = run["batches"][run["reset"]["published"]]
    assert reset_events == [{"type": "AllBlocksCleared"}]  # published at once
    assert any(h < 0 for ev in events for h in ev.get("block_hashes", []))  # signed int64
    stored = events[0]
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
    assert stored["token_ids"] == PROMPT[: 2 * BS] and stored["lora_id"] is None and stored["medium"] == "GPU"
    # SGLang's page hash: the first 8 bytes of SHA-256(token ids as u32 LE), signed.
    first = hashlib.sha256(array("I", PROMPT[:BS]).tobytes()).digest()
    assert stored["block_hashes"][0] == int.from_bytes(first[:8], "big", signed=True)
    second = hashlib.sha256(first + array("I", PROMPT[BS : 2 * BS]).tobytes()).digest()
    assert stored["block_hashes"][1] == int.from_bytes(second[:8], "big", signed=True)
    lora = next(ev for ev in events if ev.get("lora_name") == "adapterA")
    assert lora["lora_id"] is None and lora["block_hashes"][0] != stored["block_hashes"][0]  # namespaced


def test_sglang_restart_and_garbage(sglang: SglangEngine) -> None:
    check_restart_and_garbage(sglang)


def test_sglang_page_hash_port_matches_its_cpp(tmp_path: Path) -> None:
    """sglang_engine's Python port of SGLang's page hash against SGLang's own C++ (hash_binding.cpp),
    built here with g++ (OpenSSL's libcrypto, pybind11 from torch's headers)."""
    require("sglang")
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    cpp = Path(next(iter(spec.submodule_search_locations))) / "srt/mem_cache/cpp_utils/hash_binding.cpp"
    torch_spec = importlib.util.find_spec("torch")
    assert torch_spec is not None and torch_spec.origin is not None
    torch_include = Path(torch_spec.origin).parent / "include"
    py_include = sysconfig.get_paths()["include"]
    if not shutil.which("g++") or not Path("/usr/include/openssl/sha.h").exists() or not Path(py_include).exists():
        pytest.skip("no g++, OpenSSL headers or Python headers to build SGLang's hash extension")
    ext = tmp_path / f"hicache_hash_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-std=c++17", "-w", str(cpp), f"-I{torch_include}",
                    f"-I{py_include}", "-DTORCH_EXTENSION_NAME=hicache_hash_cpp", "-lcrypto", "-o", str(ext)],
                   check=True, timeout=300)
    code = (
        "import random, sys\n"
        f"sys.path[:0] = [{str(tmp_path)!r}, {str(Path(__file__).parents[2])!r}]\n"
        "import hicache_hash_cpp as cpp\n"
        "from array import array\n"
        "from tests.bridge.sglang_engine import get_native_hash\n"
        "rng = random.Random(5)\n"
        "for trial in range(200):\n"
        "    toks = [rng.randrange(2**33 if trial % 9 == 0 else 200_000) for _ in range(rng.randrange(70))]\n"
        "    prior = None if trial % 2 else rng.randbytes(32)\n"
        "    size = rng.choice([None, 1, 5, 16])\n"
        "    assert cpp.get_hash(array('q', toks), len(toks), 1, False, prior, size) == "
        "get_native_hash(toks, prior, size), (toks, prior, size)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
