"""Load a causal LM and its tokenizer from a local directory, never from the hub.

The directory is checked with plain file reads before transformers is imported,
so a wrong path or an unsupported model fails at once with a message saying what
was found and what is expected, instead of a deep transformers traceback.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from asyncflow.models.tiny import SPEC_FILE

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelLoadError",
    "SafetensorsWeights",
    "check_tokenizer_fits",
    "eos_token_ids",
    "load_causal_lm",
    "load_reward_model",
    "load_tokenizer",
    "read_causal_lm_config",
    "record_attn_implementation",
]

log = logging.getLogger(__name__)

# Architectures the trainer and rollout engines are written and tested for.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
)
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_OFFLINE_HINT = (
    "AsyncFlow loads local directories only and never downloads: fetch the model first "
    "(e.g. `huggingface-cli download <repo> --local-dir <dir>`) or use "
    "asyncflow.models.ensure_tiny_model() for the built-in tiny model"
)


class ModelLoadError(RuntimeError):
    """A model or tokenizer directory cannot be used; the message says why and how to fix it."""


def _model_dir(path: str | Path, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"{what}: path {p} does not exist. {_OFFLINE_HINT}")
    if not p.is_dir():
        raise ModelLoadError(f"{what}: {p} is a file; expected a model directory holding config.json")
    return p


def _read_config(p: Path, what: str) -> dict[str, Any]:
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(
            f"{what}: no config.json in {p} (found: {sorted(x.name for x in p.iterdir())[:20]}); "
            f"expected a Hugging Face model directory. {_OFFLINE_HINT}"
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{what}: {cfg_path} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{what}: {cfg_path} holds a {type(cfg).__name__}; expected a JSON object")
    return cfg


def _check_architecture(cfg: dict[str, Any], cfg_path: Path) -> None:
    found = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in found):
        raise ModelLoadError(
            f"load_causal_lm: unsupported architecture in {cfg_path}: found {found or 'none'} "
            f"(model_type {cfg.get('model_type')!r}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _check_weights(p: Path) -> None:
    if any((p / name).is_file() for name in _WEIGHT_FILES) or any(p.glob("*.safetensors")):
        return
    raise ModelLoadError(
        f"load_causal_lm: no weights file in {p}; expected one of {', '.join(_WEIGHT_FILES)} "
        f"(or sharded *.safetensors). Was the download or save interrupted?"
    )


# Kernels that run on every device; a device-only one (flash) is left to the loader's default.
_PORTABLE_ATTN = ("eager", "sdpa")


def record_attn_implementation(directory: str | Path, attn_implementation: str | None) -> None:
    """Note in a model directory the attention kernel its weights were trained with, so that
    load_causal_lm picks it again (config.json does not carry it). A kernel that only some
    devices have is not recorded."""
    if attn_implementation in _PORTABLE_ATTN:
        (Path(directory) / SPEC_FILE).write_text(json.dumps({"attn_implementation": attn_implementation}))


def _default_attn_implementation(p: Path) -> str | None:
    """The attention kernel a directory records: our tiny models the one that suits their size,
    an export the one it was trained with."""
    spec_path = p / SPEC_FILE
    if spec_path.is_file():
        try:
            return json.loads(spec_path.read_text()).get("attn_implementation")
        except (json.JSONDecodeError, AttributeError):
            return None
    return None


def load_causal_lm(
    path: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str | None = None,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """A causal LM from a local directory, on `device`.

    attn_implementation None means: what the directory's asyncflow_spec.json says
    (our tiny models: eager), else transformers' default.
    """
    p = _model_dir(path, "load_causal_lm")
    cfg = _read_config(p, "load_causal_lm")
    _check_architecture(cfg, p / "config.json")
    _check_weights(p)
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ModelLoadError(f"load_causal_lm: dtype {dtype!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")
        dtype = resolved
    attn = attn_implementation or _default_attn_implementation(p)

    # heavy: transformers, on first use
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if attn is not None:
        kwargs["attn_implementation"] = attn
    try:
        model = AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
    except Exception as exc:  # re-raised with the directory named
        raise ModelLoadError(f"load_causal_lm: transformers could not load {p}: {type(exc).__name__}: {exc}") from exc
    return model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) reads as unbound


def read_causal_lm_config(path: str | Path, *, attn_implementation: str | None = None) -> Any:
    """The HF config of a local causal-LM directory (checked like load_causal_lm), with the
    attention kernel set (None: the directory's asyncflow_spec.json, else transformers' default).
    What a training engine needs to build the model on the meta device before loading."""
    p = _model_dir(path, "read_causal_lm_config")
    _check_architecture(_read_config(p, "read_causal_lm_config"), p / "config.json")
    _check_weights(p)
    from transformers import AutoConfig  # heavy: transformers, on first use

    try:
        config = AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:  # re-raised with the directory named
        raise ModelLoadError(f"read_causal_lm_config: transformers could not read {p / 'config.json'}: "
                             f"{type(exc).__name__}: {exc}") from exc
    attn = attn_implementation or _default_attn_implementation(p)
    if attn is not None:
        config._attn_implementation = attn  # what from_config(attn_implementation=...) records too
    return config


class SafetensorsWeights:
    """The tensors of a local model directory's safetensors files, read by name and by rows of
    the first dimension, so that a rank reads only the part it keeps (the files are memory-mapped;
    nothing else is read). Use as a context manager: the files stay open inside it."""

    def __init__(self, path: str | Path) -> None:
        self.path = _model_dir(path, "SafetensorsWeights")
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ModelLoadError(f"{index}: not a safetensors index with a weight_map ({exc})") from exc
            self.files = {name: self.path / file for name, file in weight_map.items()}
        else:
            found = sorted(self.path.glob("*.safetensors"))
            if not found:
                raise ModelLoadError(
                    f"{self.path}: no *.safetensors weights; the training engines load safetensors only "
                    f"(convert a pytorch_model.bin with save_pretrained(..., safe_serialization=True))")
            self.files = {}
            for file in found:
                with safe_open(str(file), framework="pt") as handle:
                    self.files.update(dict.fromkeys(handle.keys(), file))
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> SafetensorsWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self._open.clear()  # the handles unmap their file when dropped

    def names(self) -> set[str]:
        return set(self.files)

    def _handle(self, name: str) -> Any:
        file = self.files[name]
        if file not in self._open:
            if not file.is_file():
                raise ModelLoadError(f"{self.path}: the index names {file.name} for {name!r}, which is missing")
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file]

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor ``name``, or only its rows [start, stop) of the first dimension."""
        sliced = self._handle(name).get_slice(name)
        if rows is None:
            return sliced[:]
        return sliced[rows[0]:rows[1]]


def _check_reward_model(p: Path, cfg: dict[str, Any]) -> None:
    found = cfg.get("architectures") or []
    bases = [a.replace("ForSequenceClassification", "ForCausalLM") for a in found
             if a.endswith("ForSequenceClassification")]
    if not any(b in SUPPORTED_ARCHITECTURES for b in bases):
        raise ModelLoadError(
            f"load_reward_model: {p / 'config.json'} names {found or 'no architecture'}; expected a "
            f"<Base>ForSequenceClassification with a base among {', '.join(SUPPORTED_ARCHITECTURES)}")
    if int(cfg.get("num_labels", len(cfg.get("id2label") or {}) or 1)) != 1:
        raise ModelLoadError(f"load_reward_model: {p} has {cfg.get('num_labels')} labels; a reward model has 1")


def check_model_dir(path: str | Path, *, reward_model: bool = False) -> None:
    """What loading would refuse about a local model directory, found from its files alone
    (no transformers import, no weights read): a missing directory, config.json, architecture,
    weights file or, for a policy, tokenizer. Raises ModelLoadError saying which."""
    p = _model_dir(path, "load_reward_model" if reward_model else "load_causal_lm")
    if reward_model:
        _check_reward_model(p, _read_config(p, "load_reward_model"))
    else:
        _check_architecture(_read_config(p, "load_causal_lm"), p / "config.json")
        if not any((p / name).is_file() for name in _TOKENIZER_FILES):
            raise ModelLoadError(
                f"load_tokenizer: no tokenizer files in {p}; expected one of {', '.join(_TOKENIZER_FILES)}")
    _check_weights(p)


def load_reward_model(path: str | Path, *, dtype: torch.dtype = torch.float32,
                      attn_implementation: str | None = None) -> PreTrainedModel:
    """A reward model from a local directory: a sequence-classification checkpoint with one
    label (e.g. ``Qwen2ForSequenceClassification``) whose base architecture is supported."""
    p = _model_dir(path, "load_reward_model")
    _check_reward_model(p, _read_config(p, "load_reward_model"))
    _check_weights(p)
    # heavy: transformers, on first use
    from transformers import AutoModelForSequenceClassification

    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    attn = attn_implementation or _default_attn_implementation(p)
    if attn is not None:
        kwargs["attn_implementation"] = attn
    try:
        return AutoModelForSequenceClassification.from_pretrained(str(p), **kwargs)
    except Exception as exc:  # re-raised with the directory named
        raise ModelLoadError(f"load_reward_model: transformers could not load {p}: "
                             f"{type(exc).__name__}: {exc}") from exc


def check_tokenizer_fits(tokenizer: PreTrainedTokenizerBase, vocab_size: int, where: str = "") -> None:
    """Raise if the tokenizer can produce ids past the model's embedding table."""
    if len(tokenizer) > vocab_size:
        raise ModelLoadError(
            f"tokenizer mismatch{' in ' + where if where else ''}: the tokenizer has {len(tokenizer)} tokens but "
            f"the model's embedding has only {vocab_size} rows, so some ids would index past it. "
            f"Use the tokenizer saved with this model, or resize the model's embeddings."
        )


def eos_token_ids(path: str | Path, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a response: the tokenizer's EOS and those of the directory's
    generation_config.json (an instruct model may end a turn with either), without repeats."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        try:
            value = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise ModelLoadError(f"{gen} is not a JSON object with an eos_token_id: {exc}") from exc
        for t in value if isinstance(value, list) else [] if value is None else [value]:
            if int(t) not in ids:
                ids.append(int(t))
    if not ids:
        raise ModelLoadError(f"{path}: neither the tokenizer nor generation_config.json names an EOS token; "
                             "set the tokenizer's eos_token")
    return ids


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a local directory, with a pad token set.

    When the directory also holds config.json, the tokenizer is checked against the
    model's vocab_size. A missing pad token is set to eos (logged).
    """
    p = _model_dir(path, "load_tokenizer")
    if not any((p / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"load_tokenizer: no tokenizer files in {p}; expected one of {', '.join(_TOKENIZER_FILES)}"
        )

    from transformers import AutoTokenizer  # heavy: transformers, on first use

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:  # re-raised with the directory named
        raise ModelLoadError(f"load_tokenizer: transformers could not load the tokenizer in {p}: {exc}") from exc

    if (p / "config.json").is_file():
        vocab_size = _read_config(p, "load_tokenizer").get("vocab_size")
        if isinstance(vocab_size, int):
            check_tokenizer_fits(tokenizer, vocab_size, str(p))

    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(
                f"load_tokenizer: the tokenizer in {p} has neither a pad nor an eos token; "
                f"set pad_token in its tokenizer_config.json"
            )
        log.info("load_tokenizer: %s has no pad token; using eos %r as pad", p, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
