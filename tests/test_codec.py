"""The wire's codec (``localsgd/codec.py``): its name is the wire name posts, records and
checkpoints have always carried (literals written by hand below), it reads back, its bits per
parameter are the formats' hand formulas, its encode / decode are the kernels' on hand examples,
a bad name is refused naming the part, and it decides what a checkpoint of another wire resumes as."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edit_jax.config import SyncConfig, WireConfig
from edit_jax.localsgd import quantize as compress, sparse
from edit_jax.localsgd.codec import NONE, Codec

# (the codec, its wire name as edit-jax wrote it before the codec existed: sparse.wire_name)
NAMES = [
    (Codec(), "none"),
    (Codec("bf16"), "bf16"),
    (Codec("int8"), "int8"),
    (Codec("int8", decay=0.9, error_feedback=True), "int8;decay=0.9"),
    (Codec("bf16", decay=0.25, error_feedback=True), "bf16;decay=0.25"),
    (Codec("topk2", error_feedback=True), "topk2"),
    (Codec("topk4", error_feedback=True, ef_dtype="bfloat16"), "topk4"),
    (Codec("topk2", chunk=1024), "topk2;chunk=1024"),
    (Codec("topk4", k=32), "topk4;k=32"),
    (Codec("topk2", decay=0.5), "topk2;decay=0.5"),
    (Codec("topk2", chunk=1024, k=32, decay=0.9), "topk2;chunk=1024;k=32;decay=0.9"),
    (Codec("topk4", chunk=256, k=16), "topk4;chunk=256;k=16"),
]


@pytest.mark.parametrize("codec,name", NAMES, ids=[n for _, n in NAMES])
def test_name_is_the_wire_name_and_reads_back(codec, name):
    assert codec.name == name
    back = Codec.from_name(name, codec.error_feedback, codec.ef_dtype)
    assert back == codec and hash(back) == hash(codec)  # jit-static: equal values, one cache entry


def test_from_sync_builds_the_same_codec_from_the_config_or_a_saved_dict():
    s = SyncConfig(wire=WireConfig(kind="topk2", chunk=256, k=16, error_feedback=True, decay=0.5,
                                   residual_dtype="bfloat16"))
    c = Codec.from_sync(s)
    assert c == Codec("topk2", 256, 16, 0.5, True, "bfloat16") and c.name == "topk2;chunk=256;k=16;decay=0.5"
    assert Codec.from_sync({"wire": {"kind": "topk2", "chunk": 256, "k": 16, "error_feedback": True, "decay": 0.5,
                                     "residual_dtype": "bfloat16"}}) == c
    # A checkpoint written before the sync.wire section: its flat keys, read as the section's.
    assert Codec.from_sync({"compress": "topk2", "sparse_chunk": 256, "sparse_k": 16, "error_feedback": True,
                            "ef_decay": 0.5, "ef_dtype": "bfloat16"}) == c
    # A config written before the compression fields existed: the defaults.
    assert Codec.from_sync({"method": "edit"}) == NONE
    # chunk and k mean nothing to a dense kind: the codec (and its name) ignores them.
    assert Codec.from_sync(SyncConfig(wire=WireConfig(kind="int8", chunk=256, k=16))) == Codec("int8")


def test_layout_and_state():
    """A reader agrees with a poster on the kind, chunk and k, never on β; the residual is there
    with error feedback on a lossy wire, in its dtype."""
    assert Codec.from_name("topk2;decay=0.9").layout == Codec("topk2").layout == ("topk2", 4096, 64)
    assert Codec("topk2").layout != Codec("topk4").layout != Codec("topk4", chunk=256).layout
    assert Codec("int8", decay=0.5).layout == ("int8",)
    assert Codec("int8", error_feedback=True).carries_residual and not Codec("int8").carries_residual
    assert not Codec("none", error_feedback=True).carries_residual
    assert Codec("topk2", error_feedback=True, ef_dtype="bfloat16").residual_dtype == jnp.bfloat16
    assert (Codec("topk4").bits, Codec("topk2").bits, Codec("int8").bits) == (4, 2, 8)
    assert Codec("topk2", chunk=256).block == 256 and Codec("int8").block == compress.BLOCK == 256


def test_bits_per_param_by_the_formulas():
    """sparse.py: (k·(bits + 12) + 32) / chunk, padded to whole chunks with sizes; int8: one float32
    scale per 256 values; bf16 16; none 32."""
    assert Codec("topk2").bits_per_param() == (64 * 14 + 32) / 4096 == 0.2265625
    assert Codec("topk4").bits_per_param() == (64 * 16 + 32) / 4096
    assert Codec("topk2", chunk=256, k=16).bits_per_param() == (16 * 14 + 32) / 256 == 1.0
    assert Codec("topk2", chunk=256, k=16).bits_per_param([1000]) == 4 * 256 / 1000  # 4 chunks for 1000 values
    assert Codec("topk4").bits_per_param([4096, 10]) == 2 * 1056 / 4106
    assert Codec("int8").bits_per_param() == 8 + 32 / 256
    assert Codec("int8").bits_per_param([300]) == 512 * (8 + 32 / 256) / 300  # two blocks
    assert (Codec("bf16").bits_per_param([300]), Codec().bits_per_param()) == (16, 32)
    assert Codec("topk2").row_bytes == 64 * 2 // 8 + 64 * 12 // 8 + 4 == 116


def test_encode_decode_by_hand_and_as_the_kernels():
    x = np.zeros((2, 8), np.float32)
    x[0, :5] = [1.0, -0.76, 0.74, -0.3, 0.2]
    x[1, :5] = [-4.0, 1.1, 0.9, 3.1, 0.05]
    c2, c4 = Codec("topk2", chunk=8, k=4), Codec("topk4", chunk=8, k=4)
    rows = c2.encode(jnp.asarray(x))
    np.testing.assert_array_equal(rows, sparse.encode(jnp.asarray(x), 2, 4))
    assert rows.shape == (2, c2.row_bytes) and rows.dtype == jnp.uint8
    # 2 bits: ±{s/2, s}; 4 bits: ±(j+1)/8·s; the 5th largest (0.2) is not sent.
    np.testing.assert_array_equal(c2.decode(rows), [[1, -1, 0.5, -0.5, 0, 0, 0, 0], [-4, 2, 2, 4, 0, 0, 0, 0]])
    np.testing.assert_array_equal(c4.decode(c4.encode(jnp.asarray(x)))[0], [1, -0.75, 0.75, -0.25, 0, 0, 0, 0])
    blocks = np.zeros((1, 256), np.float32)
    blocks[0, :4] = [127.0, -3.4, 0.5, 2.5]  # scale 1: round half to even
    q, scale = Codec("int8").encode(jnp.asarray(blocks))
    np.testing.assert_array_equal(q[0, :4], [127, -3, 0, 2])
    assert float(scale[0]) == 1.0
    np.testing.assert_array_equal(Codec("int8").decode((q, scale)), compress.dequantize_int8(q, scale))
    b = Codec("bf16").encode(jnp.asarray(np.float32([[1 + 2 ** -10, 3.0, -0.5]])))
    np.testing.assert_array_equal(Codec("bf16").decode(b), [[1.0, 3.0, -0.5]])
    assert NONE.encode(x) is x and NONE.decode(x) is x


@pytest.mark.parametrize("name,message", [
    ("fp8", r"wire 'fp8': unknown kind 'fp8', expected one of none, bf16, int8, topk2, topk4"),
    ("topk2;chunk=abc", r"wire 'topk2;chunk=abc': option chunk='abc' must be an integer"),
    ("topk2;foo=1", r"wire 'topk2;foo=1': unknown option 'foo' for topk2, expected chunk / k / decay"),
    ("int8;chunk=256", r"unknown option 'chunk' for int8, expected decay"),
    ("topk4;decay=half", r"option decay='half' must be a number"),
    ("topk2;k=8;k=16", r"option k must be given once, as k=VALUE"),
    ("topk2;k", r"option k must be given once, as k=VALUE"),
])
def test_a_bad_name_is_refused_naming_the_part(name, message):
    with pytest.raises(ValueError, match=message):
        Codec.from_name(name)


def test_a_post_of_an_unreadable_wire_is_refused_naming_both():
    from edit_jax.elastic.packed import PACKED, check_post

    assert check_post({"format": PACKED, "wire": "topk2;decay=0.5"}, Codec("topk2"), "p") == PACKED
    with pytest.raises(ValueError, match=r"p: wire 'topk2;foo=1': unknown option 'foo'.*this worker reads 'topk2'"):
        check_post({"format": PACKED, "wire": "topk2;foo=1"}, "topk2", "p")


def test_resume_under_another_wire():
    """Error feedback turned on or off changes the state: refused naming the field and both values.
    Any other change (kind, chunk, k, β, the residual's dtype) is said in one line: the residual is
    the part of Δ not sent yet, laid out like the params whatever the wire, so it carries over."""
    topk2 = Codec("topk2", 256, 16, error_feedback=True)
    assert topk2.resume_refusal(Codec("topk2")) == ["sync.wire.error_feedback: checkpoint False, config True"]
    assert Codec("topk2").resume_refusal(topk2) == ["sync.wire.error_feedback: checkpoint True, config False"]
    assert topk2.resume_change(topk2) is None and topk2.resume_refusal(topk2) == []
    topk4 = Codec("topk4", error_feedback=True, ef_dtype="bfloat16")
    assert topk4.resume_refusal(topk2) == []
    assert topk4.resume_change(topk2) == (
        "the wire changed (sync.wire.kind with its options: checkpoint 'topk2;chunk=256;k=16', config 'topk4'; "
        "sync.wire.residual_dtype: checkpoint float32, config bfloat16): the saved error-feedback residual carries "
        "over (stored as bfloat16)")
    assert "starts at zero" in topk4.resume_change(topk2, residual_kept=False)
    assert Codec("bf16").resume_change(Codec("int8")).endswith("no residual is carried")


def test_the_codec_is_jit_static():
    f = jax.jit(lambda x, c: c.decode(c.encode(x)), static_argnums=1)
    x = jnp.asarray(np.float32([[3.0, -1.0, 0.2, 0.1]]))
    np.testing.assert_array_equal(f(x, Codec("topk2", chunk=4, k=4)), [[3.0, -1.5, 1.5, 1.5]])
