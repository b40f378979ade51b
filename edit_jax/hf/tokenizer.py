"""The tokenizer files of a Hugging Face export, so that ``AutoTokenizer.from_pretrained(out)`` and
``model.generate`` work on the directory as it is.

- ``tokenizer.json``: the run's own file; for the byte tokenizer, one written here whose ids equal
  ours: a BPE without merges over the 256 byte symbols of the byte-level pre-tokenizer (byte b
  is id b, every byte sequence encodes), and ``<|endoftext|>`` = 256 as a special token. A
  ``tokenizer.json`` without an end-of-text token (edit-jax then uses one id past its vocabulary)
  gets that id added as ``<|endoftext|>``.
- ``tokenizer_config.json``: the fast tokenizer class, EOS (also BOS: a document starts after an
  EOS in the packed training stream, and ``sample`` prompts that way) and the training context.
- ``generation_config.json``: EOS / BOS ids and the context as ``max_length``.
"""

from __future__ import annotations

import json

EOS_TOKEN = "<|endoftext|>"


def byte_symbols() -> dict[int, str]:
    """Byte value -> the character the byte-level pre-tokenizer writes for it (GPT-2's table):
    printable Latin-1 characters stand for themselves, the other 68 bytes for chr(256 + n) in
    byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | \
        set(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _special(token_id: int, content: str) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def byte_tokenizer_json(eos_id: int = 256) -> dict:
    """A ``tokenizer.json`` equal to edit-jax's byte tokenizer (ids 0..255 = bytes, EOS = ``eos_id``)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_special(eos_id, EOS_TOKEN)],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {symbol: b for b, symbol in byte_symbols().items()}, "merges": []},
    }


def token_of(tokenizer: dict, token_id: int) -> str | None:
    """The string of ``token_id`` in a ``tokenizer.json`` (its added tokens, then its vocabulary)."""
    for added in tokenizer.get("added_tokens", []):
        if added.get("id") == token_id:
            return added["content"]
    vocab = tokenizer.get("model", {}).get("vocab", {})
    if isinstance(vocab, dict):
        return next((tok for tok, i in vocab.items() if i == token_id), None)
    return None


def with_eos(tokenizer: dict, eos_id: int) -> tuple[dict, str]:
    """(``tokenizer`` with ``eos_id`` defined, the EOS string): unchanged when it has the id."""
    name = token_of(tokenizer, eos_id)
    if name is not None:
        return tokenizer, name
    out = json.loads(json.dumps(tokenizer))
    out.setdefault("added_tokens", []).append(_special(eos_id, EOS_TOKEN))
    return out, EOS_TOKEN


def tokenizer_config(eos_token: str, context: int) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "bos_token": eos_token,
            "model_max_length": context, "clean_up_tokenization_spaces": False}


def generation_config(eos_id: int, context: int) -> dict:
    return {"bos_token_id": eos_id, "eos_token_id": eos_id, "max_length": context}


__all__ = ["byte_tokenizer_json", "byte_symbols", "token_of", "with_eos", "tokenizer_config", "generation_config",
           "EOS_TOKEN"]
