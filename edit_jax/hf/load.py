"""Start from Hugging Face Llama weights: ``model.init_from=DIR``.

    edit-jax train --config configs/edit_1b.py model.init_from=hf/llama-1b --run-dir runs/cpt

``DIR`` is a Hugging Face Llama directory (what ``edit-jax export`` writes, or a downloaded
``LlamaForCausalLM``): ``config.json`` plus safetensors weights, one ``model.safetensors`` or several
shard files (with or without ``model.safetensors.index.json``).

- **The architecture comes from DIR** (``adopt_architecture``, run by ``validate.load_config``):
  the model fields below replace the config file's; a command-line override of one of them that
  disagrees is an error naming the field, and so is a config (e.g. a Python-built one) whose
  fields differ from DIR's (``validate``). Features the llama family does not have (rope scaling,
  attention or MLP biases, another activation, a head_dim other than hidden_size / heads) are
  refused naming the config.json field.
- **The weights are loaded sharded** (``load_params``): each device's slice of each parameter is read
  from a memory map of the file (``jax.make_array_from_callback``), so no device, and no host,
  holds a whole copy of the model; with several processes each reads only its own devices'
  slices. The layout is the inverse of export.py's (Linear [out, in] -> our kernels [in, out],
  layers stacked; no q/k permutation, see export.py). Weights of any float dtype become fp32.
- **Every method starts from them**: ``StateLayout.init_state`` builds θ̄ and every worker's params
  from the loaded tree, exactly as from a random init. A resumed run restores its checkpoint and
  does not read DIR again.

The safetensors reader is a few lines over ``np.memmap`` (the format is an 8-byte header length, a
JSON header of dtype / shape / byte offsets, then the raw little-endian data), so that bf16 files
map without a copy and a truncated file is caught from the header alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Any, Callable

import jax
import ml_dtypes
import numpy as np

from edit_jax.config import ALIASES, Config, ConfigError, ModelConfig
from edit_jax.data.tokenizers import BYTE_EOS
from edit_jax.hf.tokenizer import byte_tokenizer_json

# ModelConfig field <- (config.json key, default when the key is absent, as Hugging Face defaults it).
ARCHITECTURE = {
    "vocab_size": ("vocab_size", None),
    "d_model": ("hidden_size", None),
    "n_layers": ("num_hidden_layers", None),
    "n_heads": ("num_attention_heads", None),
    "n_kv_heads": ("num_key_value_heads", "num_attention_heads"),  # absent: multi-head attention
    "ffn_dim": ("intermediate_size", None),
    "rope_theta": ("rope_theta", 10000.0),
    "norm_eps": ("rms_norm_eps", 1e-6),
    "tie_embeddings": ("tie_word_embeddings", False),
}

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


class InitFromError(ConfigError):
    """``model.init_from`` names something that is not a loadable Llama directory."""


def _key(path: str) -> str:
    return f"config key 'model.init_from': {path!r}"


# ----------------------------------------------------------------------------- the architecture


def read_architecture(path: str) -> dict[str, Any]:
    """{ModelConfig field: value} from ``path``/config.json; errors name the file and the field."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise InitFromError(f"{_key(path)} is not a directory (expected a Hugging Face Llama directory: "
                            "config.json and *.safetensors)")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            hf = json.load(f)
    except OSError as e:
        raise InitFromError(f"{_key(path)}: {cfg_file} cannot be read ({e.strerror or e})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InitFromError(f"{_key(path)}: {cfg_file} is not valid JSON ({e})") from e
    if not isinstance(hf, dict):
        raise InitFromError(f"{_key(path)}: {cfg_file} holds a {type(hf).__name__}, expected a mapping")

    def refuse(field: str, what: str):
        raise InitFromError(f"{_key(path)}: {cfg_file} field {field!r} is {hf.get(field)!r}; {what}")

    if hf.get("model_type", "llama") != "llama":
        refuse("model_type", "only 'llama' (LlamaForCausalLM) can be loaded")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "the llama family's MLP is SwiGLU ('silu')")
    if hf.get("rope_scaling") not in (None, {}):
        refuse("rope_scaling", "rotary scaling is not implemented (plain rotary with rope_theta only)")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field, False):
            refuse(field, "the llama family has no biases")
    out = {}
    for name, (field, default) in ARCHITECTURE.items():
        value = hf.get(field, hf.get(default) if isinstance(default, str) else default)
        want = type(getattr(ModelConfig(), name))
        if value is None or isinstance(value, bool) != (want is bool) or not isinstance(value, (int, float)):
            raise InitFromError(f"{_key(path)}: {cfg_file} field {field!r} is {value!r}; expected a {want.__name__}")
        if want is int and (not float(value).is_integer() or value <= 0):
            raise InitFromError(f"{_key(path)}: {cfg_file} field {field!r} is {value!r}; expected a positive int")
        out[name] = want(value)
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != out["d_model"] // out["n_heads"]:
        refuse("head_dim", f"the llama family's head dim is hidden_size / num_attention_heads = "
                           f"{out['d_model'] // out['n_heads']}")
    return out


def _overridden(overrides: list[str]) -> dict[str, str]:
    """{'model.FIELD': text} of the command-line overrides (their last value)."""
    out = {}
    for item in overrides:
        if "=" in item:
            key, text = item.split("=", 1)
            out[ALIASES.get(key.strip(), key.strip())] = text
    return out


def _require_llama(cfg: Config) -> None:
    if cfg.model.family != "llama":  # the reader maps Llama's config.json and tensors onto Llama's params
        raise ConfigError(f"config key 'model.init_from': a Hugging Face Llama directory starts the 'llama' family "
                          f"only, not model.family={cfg.model.family!r}; unset it")


def adopt_architecture(cfg: Config, overrides: list[str] = ()) -> Config:
    """``cfg`` with its architecture fields from ``model.init_from`` (unchanged when that is unset).
    A command-line override of such a field that disagrees with the directory is an error naming it."""
    if not cfg.model.init_from:
        return cfg
    _require_llama(cfg)
    arch = read_architecture(cfg.model.init_from)
    given = _overridden(list(overrides))
    for name, value in arch.items():
        key = f"model.{name}"
        if key in given and getattr(cfg.model, name) != value:
            raise ConfigError(f"config key '{key}': {given[key]!r} on the command line, but model.init_from="
                              f"{cfg.model.init_from!r} has {ARCHITECTURE[name][0]}={value!r} (the architecture "
                              "comes from there; drop the override)")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **arch))


def validate(cfg: Config) -> None:
    """With ``model.init_from``: the directory's architecture is the config's (field by field), and
    a directory with a tokenizer of its own is not trained on the byte tokenizer's ids."""
    path = cfg.model.init_from
    if not path:
        return
    _require_llama(cfg)
    for name, value in read_architecture(path).items():
        if getattr(cfg.model, name) != value:
            raise ConfigError(f"config key 'model.{name}': {getattr(cfg.model, name)!r}, but model.init_from="
                              f"{path!r} has {ARCHITECTURE[name][0]}={value!r} (leave the "
                              "architecture to init_from: edit_jax.validate.load_config adopts it)")
    tokenizer = os.path.join(path, "tokenizer.json")
    if cfg.data.tokenizer == "byte" and os.path.isfile(tokenizer) and not _is_byte_tokenizer(tokenizer):
        # Its embeddings mean its tokenizer's ids: byte ids would index unrelated rows.
        raise ConfigError(f"config key 'data.tokenizer': 'byte', but model.init_from={path!r} was trained with "
                          f"{tokenizer}; set data.tokenizer={tokenizer} (or the same tokenizer elsewhere)")


def _is_byte_tokenizer(file: str) -> bool:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f) == byte_tokenizer_json(BYTE_EOS)
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------------------- safetensors


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file, mapped (not read) on demand."""

    file: str
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file

    def array(self) -> np.ndarray:
        return np.memmap(self.file, dtype=_DTYPES[self.dtype], mode="r", offset=self.offset, shape=self.shape)


def _read_header(file: str) -> dict[str, Tensor]:
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InitFromError(f"safetensors file {file!r} is truncated ({size} bytes; no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise InitFromError(f"safetensors file {file!r} is truncated or not safetensors (header of "
                                    f"{n} bytes in a file of {size})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise InitFromError(f"safetensors file {file!r} cannot be read ({e.strerror or e})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InitFromError(f"safetensors file {file!r}: its header is not valid JSON ({e})") from e
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in _DTYPES:
            raise InitFromError(f"safetensors file {file!r}: tensor {name!r} has dtype {info.get('dtype')!r}; "
                                f"expected one of {', '.join(_DTYPES)}")
        start, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        if end - start != int(np.prod(shape)) * np.dtype(_DTYPES[info["dtype"]]).itemsize or 8 + n + end > size:
            raise InitFromError(f"safetensors file {file!r} is truncated or damaged: tensor {name!r} "
                                f"({info['dtype']} {list(shape)}) needs bytes {8 + n + start}..{8 + n + end} of {size}")
        out[name] = Tensor(file, info["dtype"], shape, 8 + n + start)
    return out


def tensor_index(path: str) -> dict[str, Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path`` (headers only; no data read)."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise InitFromError(f"{_key(path)} has no *.safetensors file (PyTorch .bin weights: convert them "
                            "to safetensors first)")
    out: dict[str, Tensor] = {}
    for name in files:
        for tname, t in _read_header(os.path.join(path, name)).items():
            if tname in out:
                raise InitFromError(f"{_key(path)}: tensor {tname!r} is in both {out[tname].file} and {t.file}")
            out[tname] = t
    return out


# ----------------------------------------------------------------------------- the weights


def _sources(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[str, bool]]:
    """Our param path -> (Hugging Face tensor name, with '{i}' for the layer; transposed?)."""
    layer = "model.layers.{i}."
    out = {("root", "embed"): ("model.embed_tokens.weight", False),
           ("root", "final_norm", "scale"): ("model.norm.weight", False),
           ("layers", "attn_norm", "scale"): (layer + "input_layernorm.weight", False),
           ("layers", "mlp_norm", "scale"): (layer + "post_attention_layernorm.weight", False)}
    if not cfg.tie_embeddings:
        out[("root", "lm_head")] = ("lm_head.weight", True)
    for ours, theirs in [("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")]:
        out[("layers", "attn", ours)] = (layer + f"self_attn.{theirs}.weight", True)
    for ours, theirs in [("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")]:
        out[("layers", "mlp", ours)] = (layer + f"mlp.{theirs}.weight", True)
    return out


def _path(keypath) -> tuple[str, ...]:
    return tuple(k.key for k in keypath)


def _reader(tensors: dict[str, Tensor], path: str, name: str, transposed: bool, stacked: bool,
            shape: tuple[int, ...]) -> Callable[[tuple], np.ndarray]:
    """The callback of ``make_array_from_callback`` for one parameter of global ``shape``: a
    device's index (a tuple of slices) -> that slice, read through the memory map, as fp32."""
    names = [name.format(i=i) for i in range(shape[0])] if stacked else [name]
    want = shape[1:] if stacked else shape
    want = want[::-1] if transposed else want
    for n in names:
        if n not in tensors:
            raise InitFromError(f"{_key(path)}: no tensor {n!r} in its safetensors files")
        if tensors[n].shape != want:
            raise InitFromError(f"{_key(path)}: tensor {n!r} in {tensors[n].file} has shape "
                                f"{list(tensors[n].shape)}; the architecture of its config.json needs {list(want)}")

    def one(n: str, idx: tuple) -> np.ndarray:
        a = tensors[n].array()
        return np.asarray(a[idx[::-1]].T if transposed else a[idx], np.float32)

    def read(idx: tuple) -> np.ndarray:
        idx = tuple(idx) + (slice(None),) * (len(shape) - len(idx))
        if not stacked:
            return one(names[0], idx)
        return np.stack([one(names[i], idx[1:]) for i in range(shape[0])[idx[0]]])

    return read


def load_params(cfg: ModelConfig, abstract: Any, shardings: Any) -> Any:
    """The params tree (``abstract``: shapes of ``init_params``) read from ``cfg.init_from``, each
    leaf a global array with its ``shardings`` leaf, built from per-device slices."""
    path = cfg.init_from
    tensors = tensor_index(path)
    sources = _sources(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    ours = {_path(kp) for kp, _ in flat}
    if ours != set(sources):  # the model's params and this map must name the same leaves
        raise InitFromError(f"{_key(path)}: cannot map params {sorted(ours ^ set(sources))} (family {cfg.family!r})")
    unused = set(tensors) - {n.format(i=i) for n, _ in sources.values() for i in range(cfg.n_layers)}
    unused -= {n for n in unused if n.endswith("rotary_emb.inv_freq")}  # older exports carry the rotary table
    if unused:
        raise InitFromError(f"{_key(path)}: tensors {sorted(unused)[:5]} have no place in a "
                            f"{'tied' if cfg.tie_embeddings else 'untied'} llama model of its config.json")
    leaves = []
    for (kp, x), sh in zip(flat, jax.tree.leaves(shardings), strict=True):
        name, transposed = sources[_path(kp)]
        read = _reader(tensors, path, name, transposed, kp[0].key == "layers", tuple(x.shape))
        leaves.append(jax.make_array_from_callback(tuple(x.shape), sh, read))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def initial_params(cfg: Config, layout) -> Any:
    """``model.init_from``'s weights as the starting params of every method: θ̄-shaped and sharded
    like θ̄ (``layout``: the run's ``localsgd.state.StateLayout``), read per device slice, so no
    device holds a whole copy. The loop hands them to ``init_state``."""
    abstract, shardings = layout.initial_params_shardings()
    return load_params(cfg.model, abstract, shardings)


__all__ = ["initial_params", "ARCHITECTURE", "InitFromError", "read_architecture", "adopt_architecture", "validate",
           "tensor_index", "load_params"]
