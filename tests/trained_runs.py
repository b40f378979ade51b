"""Small trained run dirs shared by the sample, export and TensorBoard tests (each made once per
test process, a few seconds each)."""

import dataclasses
import os

import jax

from edit_jax.config import LogConfig
from edit_jax.training.train import train
from tests.helpers import tiny_config

_RUNS: dict[str, tuple] = {}

PY_TEXT = "".join(f"def f{i}(x):\n    return x + {i}\n\n\nclass C{i}:\n    pass\n\n" for i in range(300))


def edit_run(tmp_path_factory):
    """EDiT, 2 replicas x 2 shards, θ̄ sharded over replica too and kept in host memory, TensorBoard
    on: W = 2 synchronous steps, then a layer-wise sync every 2 steps; checkpoints at 2, 4, 6."""
    if "edit" not in _RUNS:
        cfg = tiny_config(replica=2, shard=2, method="edit", steps=6, checkpoint_every=2, keep_checkpoints=3,
                          eval_every=0, sync={"warmup_steps": 2, "tau": 2, "outer_sharding": "replica_shard",
                                              "cpu_offload": True},
                          log=LogConfig(tensorboard=True))
        run_dir = str(tmp_path_factory.mktemp("edit_run"))
        train(cfg, run_dir, progress=False, devices=jax.devices()[:4])
        _RUNS["edit"] = (cfg, run_dir)
    return _RUNS["edit"]


def tokenizer_run(tmp_path_factory):
    """Baseline on one device with a BPE tokenizer.json (made here with `tokenizers`) and a text file."""
    if "tok" not in _RUNS:
        import tokenizers
        from tokenizers import models, pre_tokenizers, trainers, decoders

        d = tmp_path_factory.mktemp("tok_run")
        text = os.path.join(d, "code.py")
        with open(text, "w") as f:
            f.write(PY_TEXT)
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok_path = os.path.join(d, "tokenizer.json")
        tok.save(tok_path)
        cfg = tiny_config(replica=1, shard=1, steps=3, seq_len=16, batch_size=4)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="text", paths=(text,),
                                                                tokenizer=tok_path))
        run_dir = os.path.join(d, "run")
        train(cfg, run_dir, progress=False, devices=jax.devices()[:1])
        _RUNS["tok"] = (cfg, run_dir, tok_path)
    return _RUNS["tok"]
