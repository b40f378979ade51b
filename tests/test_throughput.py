"""The speed figures of training records: ``lr``, ``tokens_per_s_per_device``, ``mfu`` and ``mfu_causal``."""

import math

import jax
import pytest

from edit_jax.config import LogConfig
from edit_jax.training.throughput import peak_tflops
from edit_jax.training.train import train
from tests.helpers import tiny_config


def _lr(step, lr, warmup, decay, min_ratio):
    """The schedule by hand: linear warmup from 0, then cosine down to lr x min_ratio at ``decay``."""
    if step < warmup:
        return lr * step / warmup
    t = min((step - warmup) / (decay - warmup), 1.0)
    return lr * min_ratio + (lr - lr * min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def _flops_per_token(m, seq_len):
    """6 x the matmul parameters (q, k, v, o, the three FFN matrices, the LM head) + attention."""
    head = m.d_model // m.n_heads
    per_layer = m.d_model * head * m.n_heads * 2 + m.d_model * head * m.n_kv_heads * 2 + 3 * m.d_model * m.ffn_dim
    return 6 * (m.n_layers * per_layer + m.d_model * m.vocab_size) + 12 * m.n_layers * m.d_model * seq_len


def test_records_carry_lr_tokens_per_device_and_mfu():
    cfg = tiny_config(2, 2, steps=6, optim={"warmup_steps": 2, "min_lr_ratio": 0.1})
    cfg.log = LogConfig(peak_tflops=0.5)
    result = train(cfg, None, progress=False, devices=jax.devices()[:4])
    records = [r for r in result.history if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert r["lr"] == pytest.approx(_lr(r["step"] - 1, 3e-3, 2, 6, 0.1), rel=1e-6), r
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 4)
        assert r["mfu"] == pytest.approx(_flops_per_token(cfg.model, 32) * r["tokens_per_s"] / (0.5e12 * 4))
        causal = _flops_per_token(cfg.model, 32) - 6 * cfg.model.n_layers * cfg.model.d_model * 32  # scores halved
        assert r["mfu_causal"] == pytest.approx(causal * r["tokens_per_s"] / (0.5e12 * 4))
    assert records[0]["lr"] == 0.0 and records[2]["lr"] == pytest.approx(3e-3)


def test_peak_from_the_device_kind_or_the_config():
    cfg = tiny_config(2, 2)
    assert peak_tflops(cfg, "NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops(cfg, "NVIDIA H100 PCIe") == 756.0
    assert peak_tflops(cfg, "NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops(cfg, "cpu") is None
    cfg.log = LogConfig(peak_tflops=123.0)
    assert peak_tflops(cfg, "cpu") == 123.0
    result = train(tiny_config(2, 2, steps=1), None, progress=False, devices=jax.devices()[:4])
    assert "mfu" not in result.history[0] and result.history[0]["lr"] == pytest.approx(3e-3)  # CPU: no known peak
