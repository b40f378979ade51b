"""Export a trained model to the Hugging Face Llama layout: ``edit-jax export``.

    edit-jax export --run-dir runs/demo --out exports/demo [--step K] [--dtype bfloat16]

Writes into ``--out``:

- ``config.json``: a ``LlamaForCausalLM`` config (sizes, rope theta, norm eps, tied embeddings,
  vocabulary, context);
- ``model.safetensors``: the params (θ̄, see trained.py) under the standard Llama tensor names;
- ``tokenizer.json`` (the run's; for the byte tokenizer one with the same ids),
  ``tokenizer_config.json`` and ``generation_config.json`` (``hf/tokenizer.py``): the directory
  loads with ``AutoTokenizer`` / ``AutoModelForCausalLM`` as it is;
- ``edit_jax_export.json``: where the weights came from (run dir, step, method, θ̄ or replica).

Every file is written world-readable (0644): an export is meant to be shared.

Layouts. Our Dense kernels are [in, out] and a Hugging Face ``Linear`` weight is [out, in], so
every projection is transposed. No permutation of q/k is needed: our q/k heads are contiguous
[head, head_dim] column blocks (``reshape(b, t, heads, head_dim)``) and our rotary rotates the two
halves of head_dim (rotate-half, frequency i = theta^(-2i/head_dim) on dims i and i + head_dim/2),
which is the convention of ``LlamaForCausalLM`` (the permutation in conversion scripts is only for
checkpoints trained with interleaved pairs). Grouped-query attention: query head h reads key/value
head h // (n_heads / n_kv_heads) in both. tests/test_export.py checks all this with a NumPy Llama
forward written from the exported files alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

import numpy as np

from edit_jax.config import Config, ModelConfig
from edit_jax.data.tokenizers import BYTE_EOS
from edit_jax.hf.tokenizer import EOS_TOKEN, byte_tokenizer_json, generation_config, tokenizer_config, with_eos
from edit_jax.rundir.runlock import first_missing, output_path_problem
from edit_jax.rundir.trained import TrainedModelError, load_tokenizer, load_trained, tokenizer_file
from edit_jax.exit_codes import EXIT_BAD_INPUT

DTYPES = ("float32", "bfloat16", "float16")
WRITTEN = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
           "edit_jax_export.json")


class ExportError(RuntimeError):
    """An export that cannot be written; the message names the path."""


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes  # a dependency of JAX

        return np.ascontiguousarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16))
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(dtype))


def hf_tensors(cfg: ModelConfig, params: Any, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Our params tree -> {Hugging Face Llama tensor name: array} (see the module docstring)."""
    root, layers = params["root"], params["layers"]
    out = {"model.embed_tokens.weight": root["embed"], "model.norm.weight": root["final_norm"]["scale"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.asarray(root["lm_head"]).T  # [d, vocab] -> [vocab, d]
    attn, mlp = layers["attn"], layers["mlp"]
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = layers["attn_norm"]["scale"][i]
        out[p + "post_attention_layernorm.weight"] = layers["mlp_norm"]["scale"][i]
        for ours, theirs in [("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")]:
            out[p + f"self_attn.{theirs}.weight"] = np.asarray(attn[ours][i]).T
        for ours, theirs in [("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")]:
            out[p + f"mlp.{theirs}.weight"] = np.asarray(mlp[ours][i]).T
    return {k: _cast(v, dtype) for k, v in out.items()}


def hf_config(cfg: Config, dtype: str = "float32", eos_id: int | None = None) -> dict:
    """A ``LlamaForCausalLM`` config.json for ``cfg``."""
    m = cfg.model
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.data.seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std,
        "bos_token_id": eos_id,  # a document starts after an EOS (hf/tokenizer.py)
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def check_out(out: str, force: bool) -> None:
    """``--out`` can be written (rundir.runlock.output_path_problem, the check ``plan --json`` makes too)."""
    problem = output_path_problem(out, "--out", directory=True, force=force)
    if problem is not None:
        raise ExportError(problem)


def write_export(out: str, cfg: Config, params: Any, *, dtype: str = "float32", eos_id: int | None = None,
                 tokenizer_path: str | None = None, provenance: dict | None = None, force: bool = False) -> list[str]:
    """Writes the export into ``out``; returns the paths written. Refuses a non-empty ``out``
    unless ``force`` (then the files it writes are replaced; other files are left alone).

    Every file is first written into a staging dir (beside a new ``out``, which it then becomes by
    one rename; inside an existing one, whose files it then replaces one rename each), so a write
    that fails (a full disk, a file size limit, a quota, a read-only file system) leaves nothing:
    no new ``out`` (nor the parents this export would have made) and an existing one unchanged."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    check_out(out, force)
    if tokenizer_path is not None and not os.path.isfile(tokenizer_path):
        raise ExportError(f"tokenizer file {tokenizer_path!r} not found (expected the run's tokenizer.json; "
                          "pass its path with --tokenizer)")
    existed = os.path.isdir(out)
    made = None if existed else first_missing(out)  # the top dir this export makes
    beside = out if existed else os.path.dirname(os.path.abspath(out))
    staging = os.path.join(beside, f".{os.path.basename(os.path.abspath(out))}.export-partial-{os.getpid()}")
    names: list[str] = []
    try:
        shutil.rmtree(staging, ignore_errors=True)  # a stale one of a killed export with this pid
        os.makedirs(staging)
        _write_files(staging, cfg, params, dtype, eos_id, tokenizer_path, provenance, names)
        if existed:
            for name in names:
                os.replace(os.path.join(staging, name), os.path.join(out, name))
            os.rmdir(staging)
        else:
            os.chmod(staging, 0o755)  # an export is meant to be shared (as its files)
            os.rename(staging, out)
    except OSError as e:  # ENOSPC, EFBIG, EDQUOT, EROFS, a vanished dir: no half export that looks whole
        shutil.rmtree(staging, ignore_errors=True)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        left = "nothing left behind" if made is not None else f"{out!r} left as it was"
        raise ExportError(f"--out {out!r}: writing failed ({e.strerror or e}); {left}") from e
    return [os.path.join(out, name) for name in names]


_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """``tensors`` as a safetensors file: an 8-byte little-endian header size, a JSON header (name
    -> dtype, shape, [begin, end) byte offsets into the data; ``__metadata__``) padded with spaces
    to a multiple of 8 bytes, then each tensor's bytes (C order, little-endian) in header order.
    Written here with Python's own file writes (safetensors' writer reports a full disk as its
    own exception type, errno in the text), one tensor at a time (no whole-file copy in memory)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in sorted(tensors):
        x = tensors[name]
        header[name] = {"dtype": _SAFETENSORS_DTYPES[x.dtype.name], "shape": list(x.shape),
                        "data_offsets": [offset, offset + x.nbytes]}
        offset += x.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in sorted(tensors):  # (the host's byte order: little-endian on x86-64 and ARM64)
            f.write(np.ascontiguousarray(tensors[name]).reshape(-1).view(np.uint8))


def _write_files(out: str, cfg: Config, params: Any, dtype: str, eos_id: int | None, tokenizer_path: str | None,
                 provenance: dict | None, names: list[str]) -> None:
    """Writes the export's files into the existing (staging) dir ``out``, appending each file's
    name to ``names``."""

    def path(name):
        names.append(name)
        return os.path.join(out, name)

    def write_json(name, obj):
        with open(path(name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")

    write_safetensors(path("model.safetensors"), hf_tensors(cfg.model, params, dtype), {"format": "pt"})
    eos = BYTE_EOS if eos_id is None else int(eos_id)
    write_json("config.json", hf_config(cfg, dtype, eos))
    if tokenizer_path is None:  # the byte tokenizer, as a file Hugging Face loads
        tokenizer, eos_token = byte_tokenizer_json(eos), EOS_TOKEN
        write_json("tokenizer.json", tokenizer)
    else:
        with open(tokenizer_path, encoding="utf-8") as f:
            original = json.load(f)
        tokenizer, eos_token = with_eos(original, eos)
        if tokenizer is original:
            shutil.copyfile(tokenizer_path, path("tokenizer.json"))  # the run's file, byte for byte
        else:  # edit-jax's EOS is one id past its vocabulary: added, so that generation stops
            write_json("tokenizer.json", tokenizer)
    write_json("tokenizer_config.json", tokenizer_config(eos_token, cfg.data.seq_len))
    write_json("generation_config.json", generation_config(eos, cfg.data.seq_len))
    write_json("edit_jax_export.json", provenance or {})
    for name in names:
        os.chmod(os.path.join(out, name), 0o644)


def export_run(run_dir: str, out: str, *, step: int | None = None, dtype: str = "float32",
               tokenizer: str | None = None, force: bool = False) -> list[str]:
    """Exports checkpoint ``step`` (default: the latest) of ``run_dir`` into ``out``."""
    if dtype not in DTYPES:  # before reading anything
        raise ExportError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    check_out(out, force)
    model = load_trained(run_dir, step)
    tok = load_tokenizer(model.cfg, tokenizer, model.run_dir)
    tok_file = tokenizer_file(model.cfg, tokenizer, model.run_dir)  # the run dir's copy first
    provenance = {"run_dir": os.path.abspath(run_dir), "checkpoint": model.checkpoint, "step": model.step,
                  "method": model.cfg.sync.method,
                  "params": "outer (θ̄)" if model.source == "outer" else "replica (state.params[0])",
                  "tokenizer": "byte (ids 0..255 are byte values, EOS 256)" if tok_file is None
                  else os.path.basename(tok_file),
                  "eos_token_id": int(tok.eos_id), "dtype": dtype}
    return write_export(out, model.cfg, model.params, dtype=dtype, eos_id=int(tok.eos_id),
                        tokenizer_path=tok_file, provenance=provenance, force=force)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="edit-jax export",
                                     description="Export a trained run to the Hugging Face Llama layout.")
    parser.add_argument("--run-dir", required=True, help="the run dir of `edit-jax train`")
    parser.add_argument("--out", required=True, help="output directory (new or empty)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="tensor dtype (default float32)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json to ship instead of the run's data.tokenizer")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --out")
    args = parser.parse_args(argv)

    try:
        written = export_run(args.run_dir, args.out, step=args.step, dtype=args.dtype, tokenizer=args.tokenizer,
                             force=args.force)
    except (TrainedModelError, ExportError) as e:
        print(f"edit-jax: export error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for p in written:
        print(p)
    return 0


__all__ = ["hf_tensors", "hf_config", "write_export", "write_safetensors", "export_run", "ExportError", "main"]
