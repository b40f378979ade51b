"""Data pipeline benchmark: what a real corpus costs at start, in memory and in throughput.

    python benchmarks/bench_data.py                       # shards of 1, 4 and 16 GB (needs ~22 GB of disk)
    python benchmarks/bench_data.py --sizes-gb 1 4 --parquet-mb 64 --work-dir /tmp/bench_data
    python benchmarks/bench_data.py --cases stdlib loose one-row-group --work-dir /tmp/bench_data   # issue 30

For each corpus, a tiny training run (``edit-jax train --config configs/tiny.py steps=4``) in a
child process: its wall time, its peak RSS (``os.wait4``'s ``ru_maxrss`` of that child) and the time
from the child's start to its first training batch (a second child that only builds the corpus and
the stream and takes one batch). Corpora: the stdlib corpus (the reference), generated token
shards of each ``--sizes-gb`` (an index.json per directory, as ``edit-jax tokenize`` writes), the
tokenized parquet files and the parquet files streamed (data.source=parquet) with the reader in
the training process (``data.workers=0``: the peak RSS includes the tokenizing) and in a reader
process (``data.workers=1``: the training process's own peak). Two inputs as users make them
(``--cases loose one-row-group``): nanoGPT-style loose ``.bin`` shards of 100 M uint16 tokens
(``--loose-gb``, default 1, 4, 16 GB: one set of files, the smaller sets hard links to its first
files) read with ``data.source=tokens``, and parquet files of ``--big-docs`` documents each written
with pyarrow's defaults (``write_table``: one row group per file, as pandas' ``to_parquet`` writes
them) streamed with ``data.workers`` 0 and 1.

Then the token-shard stream's own tokens/s in one process (no model: ``TrainStream.next()`` on
batches of the 1B preset's per-host shape), and the streamed parquet source's (row groups read and
tokenized by 0, 1 or 2 reader processes, byte tokenizer and tokenizer.json), beside the tokens/s
one host of the paper's 1B preset consumes on 8 GPUs (ASSUMPTION: 40% MFU of a 989 TFLOP/s bf16
H100, model.flops_per_token), and ``edit-jax tokenize``'s tokens/s per worker with the byte
tokenizer and with a tokenizer.json (a byte-level BPE of ``--bpe-vocab`` ids trained here on the
generated text with the ``tokenizers`` package, when installed; on the first parquet file only). Tokenize times include
the process start (about half a second). Prints tables; writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import REPO, child_env, env_info, loadavg, print_table, write_json

H100_BF16_FLOPS = 989e12  # dense bf16, SXM
ASSUMED_MFU = 0.40
GPUS_PER_HOST = 8
SHARD_TOKENS = 1 << 28  # 512 MiB of uint16, the tokenize default
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no will more can its out up "
         "learning energy students cells water history model data system theory process").split()



def _write_rolled(f, block, size: int, k: int) -> None:
    """``size`` tokens of ``block`` rotated by a shift that differs per file ``k`` and per piece,
    so files and pieces differ (the bytes of a token corpus without generating one)."""
    left, shift = size, k * 7919
    while left:
        piece = np.roll(block, shift)[:min(left, block.size)]
        f.write(piece.tobytes())
        left -= piece.size
        shift += 104729

def _python() -> str:
    return sys.executable


def write_synthetic_shards(directory: str, gigabytes: float, seed: int = 0) -> dict:
    """Byte-tokenizer ids in shards of SHARD_TOKENS with an index.json, without a tokenize run:
    a random block of 16 M tokens, rolled differently per shard (generation would otherwise
    dominate). Idempotent: an existing directory with an index is kept."""
    from edit_jax.data.shards import INDEX_FORMAT, INDEX_VERSION, shard_name, tokenizer_identity
    from edit_jax.data.tokenizers import ByteTokenizer

    ipath = os.path.join(directory, "index.json")
    if os.path.isfile(ipath):
        return json.load(open(ipath))
    os.makedirs(directory, exist_ok=True)
    total = int(gigabytes * 2**30) // 2
    block = np.random.default_rng(seed).integers(0, 257, 1 << 24, dtype=np.uint16)
    splits = {"train": [], "val": []}
    val_tokens = max(1 << 20, total // 200)
    for split, n in (("train", total - val_tokens), ("val", val_tokens)):
        k = 0
        while n > 0:
            size = min(n, SHARD_TOKENS)
            with open(os.path.join(directory, shard_name(split, k)), "wb") as f:
                _write_rolled(f, block, size, k)
            splits[split].append({"file": shard_name(split, k), "tokens": size})
            n -= size
            k += 1
    tok = ByteTokenizer()
    index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "dtype": "uint16", "vocab_size": tok.vocab_size,
             "eos_id": tok.eos_id, "tokenizer": tokenizer_identity(tok), "inputs_sha256": f"synthetic-{gigabytes}",
             "splits": splits, "documents": {"train": 0, "val": 0}}
    with open(ipath, "w") as f:
        json.dump(index, f)
    return index


def write_parquet_set(directory: str, total_mb: float, files: int = 4, seed: int = 0) -> list[str]:
    """``files`` parquet files of word-salad documents, ``total_mb`` MB of text in all, row groups
    of 2000 documents (FineWeb-Edu's files use about 1000 rows a group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"part-{i:03d}.parquet") for i in range(files)]
    if all(os.path.isfile(p) for p in paths):
        return paths
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    per_file = int(total_mb * 1e6 / files)
    for p in paths:
        docs, size = [], 0
        while size < per_file:
            n = int(rng.integers(100, 1500))
            text = " ".join(words[rng.integers(0, len(words), n)]) + "."
            docs.append(text)
            size += len(text)
        pq.write_table(pa.table({"text": docs, "id": np.arange(len(docs))}), p, row_group_size=2000)
    return paths


LOOSE_SHARD_TOKENS = 100_000_000  # nanoGPT's fineweb / openwebtext shards


def write_loose_bins(directory: str, sizes_gb: list[float], seed: int = 0) -> dict[float, str]:
    """nanoGPT-style loose shards: raw uint16 files of LOOSE_SHARD_TOKENS byte-tokenizer ids, no
    index, enough for the largest size; for each size a directory of hard links to the first
    files (``{size: glob}``). Idempotent."""
    total = int(max(sizes_gb) * 2**30) // 2
    count = -(-total // LOOSE_SHARD_TOKENS)
    src = os.path.join(directory, "all")
    os.makedirs(src, exist_ok=True)
    block = np.random.default_rng(seed).integers(0, 257, 1 << 24, dtype=np.uint16)
    for k in range(count):
        path = os.path.join(src, f"shard_{k:06d}.bin")
        size = min(LOOSE_SHARD_TOKENS, total - k * LOOSE_SHARD_TOKENS)
        if os.path.isfile(path) and os.path.getsize(path) == 2 * size:
            continue
        with open(path + ".tmp", "wb") as f:
            _write_rolled(f, block, size, k)
        os.replace(path + ".tmp", path)
    out = {}
    for gb in sizes_gb:
        d = os.path.join(directory, f"{gb:g}gb")
        os.makedirs(d, exist_ok=True)
        want = -(-(int(gb * 2**30) // 2) // LOOSE_SHARD_TOKENS)
        for k in range(want):
            name = f"shard_{k:06d}.bin"
            if not os.path.exists(os.path.join(d, name)):
                os.link(os.path.join(src, name), os.path.join(d, name))
        out[gb] = os.path.join(d, "*.bin")
    return out


def write_parquet_defaults(directory: str, files: int, docs: int, seed: int = 0) -> list[str]:
    """``files`` parquet files of ``docs`` word-salad documents each (100 to 1500 words), written
    with pyarrow's defaults: one row group per file (pandas' to_parquet writes the same)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"defaults-{i:03d}.parquet") for i in range(files)]
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    for p in paths:
        if os.path.isfile(p):
            continue
        texts = [" ".join(words[rng.integers(0, len(words), int(rng.integers(100, 1500)))]) + "." for _ in range(docs)]
        pq.write_table(pa.table({"text": texts, "id": np.arange(docs)}), p + ".tmp")
        os.replace(p + ".tmp", p)
    return paths


def child_run(args: list[str], env: dict | None = None) -> dict:
    """Runs a child to completion: wall seconds, its peak RSS, exit code, last stderr line."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**child_env(), **(env or {})})  # (this process's device count left out)
    out, err = proc.communicate()
    seconds = time.perf_counter() - start
    # communicate() reaped it; resource.getrusage(RUSAGE_CHILDREN) would be a max over all children
    # so far: ask the kernel per child via wait4 instead, through a tiny wrapper below.
    return {"seconds": round(seconds, 2), "rc": proc.returncode, "stdout": out, "stderr": err.strip()[-2000:]}


_WRAP = ("import os,sys,json,time\n"
         "t=time.perf_counter();pid=os.fork()\n"
         "if pid==0:\n os.execvp(sys.argv[1],sys.argv[1:])\n"
         "_,status,ru=os.wait4(pid,0)\n"
         "print(json.dumps({'maxrss_kb':ru.ru_maxrss,'status':status,'seconds':time.perf_counter()-t}),"
         "file=sys.stderr)\n")


def measured(args: list[str]) -> dict:
    """``args`` under a wrapper that reports the child's own peak RSS (wait4) on its last stderr line."""
    r = child_run([_python(), "-c", _WRAP, *args])
    try:
        meta = json.loads(r["stderr"].splitlines()[-1])
    except (ValueError, IndexError):
        return {"ok": False, "error": r["stderr"][-500:]}
    ok = os.waitstatus_to_exitcode(meta["status"]) == 0
    return {"ok": ok, "peak_rss_gb": round(meta["maxrss_kb"] / 2**20, 3), "seconds": round(meta["seconds"], 2),
            "stdout": r["stdout"][-400:], "error": "" if ok else r["stderr"][-800:]}


_FIRST_BATCH = ("import time,sys;t=time.perf_counter()\n"
                "from edit_jax.validate import load_config\n"
                "from edit_jax.data import load_corpus, make_train_stream\n"
                "cfg=load_config('configs/tiny.py', sys.argv[1:])\n"
                "c=load_corpus(cfg.data);s=make_train_stream(c,cfg.data.seq_len,cfg.batch_size,cfg.mesh.replica,0)\n"
                "s.next();print('FIRST', time.perf_counter()-t)\n")


def first_batch_seconds(overrides: list[str]) -> float | None:
    r = child_run([_python(), "-c", _FIRST_BATCH, *overrides], env={"PYTHONPATH": REPO})
    for line in r["stdout"].splitlines():
        if line.startswith("FIRST"):
            return round(float(line.split()[1]), 2)
    print(f"  first batch failed: {r['stderr'][-500:]}", file=sys.stderr)
    return None


def tiny_run(name: str, overrides: list[str], work: str) -> dict:
    run_dir = os.path.join(work, "runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)
    r = measured([_python(), "-m", "edit_jax.cli", "train", "--config", "configs/tiny.py", "--run-dir", run_dir,
                  "--no-progress", "steps=4", *overrides])
    r["first_batch_s"] = first_batch_seconds(overrides)
    r["corpus"] = name
    if not r["ok"]:
        print(f"  {name}: FAILED {r['error']}", file=sys.stderr)
    print(f"  {name}: {r.get('seconds')} s, peak RSS {r.get('peak_rss_gb')} GB, first batch {r['first_batch_s']} s",
          file=sys.stderr, flush=True)
    return r


def stream_tokens_per_s(shard_dir: str, seq_len: int, rows: int, seconds: float = 10.0) -> dict:
    """TrainStream.next() throughput over a shard directory (one process, no model)."""
    from edit_jax.config import DataConfig
    from edit_jax.data import load_corpus, make_train_stream

    corpus = load_corpus(DataConfig(source="tokens", paths=(shard_dir,), seq_len=seq_len))
    n, dt = timed_batches(make_train_stream(corpus, seq_len, rows, 1, seed=0), seconds)
    return {"batches": n, "rows": rows, "seq_len": seq_len, "tokens_per_s": n * rows * seq_len / dt}


def timed_batches(stream, seconds: float) -> tuple[int, float]:
    """Batches taken in about ``seconds`` after the first (not timed), and the seconds."""
    stream.next()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        stream.next()
        n += 1
    return n, time.perf_counter() - start


def parquet_stream_tokens_per_s(parquet: list[str], tokenizer: str, workers: int, seq_len: int, rows: int,
                                seconds: float = 10.0) -> dict:
    """The streamed parquet source's own throughput (one process, one replica, no model): row
    groups read, split and tokenized by ``workers`` reader processes (0: a thread) while batches
    are taken. The first batch (reader start, first row group) is not timed."""
    from edit_jax.config import DataConfig
    from edit_jax.data import load_corpus, make_train_stream

    corpus = load_corpus(DataConfig(source="parquet", paths=tuple(parquet), seq_len=seq_len, tokenizer=tokenizer,
                                    workers=workers))
    stream = make_train_stream(corpus, seq_len, rows, 1, seed=0)
    n, dt = timed_batches(stream, seconds)
    stream.close()
    name = "byte" if tokenizer == "byte" else os.path.basename(tokenizer)
    return {"corpus": f"parquet streamed, {name}, data.workers={workers}", "batches": n, "rows": rows,
            "seq_len": seq_len, "tokens_per_s": n * rows * seq_len / dt}


def paper_host_tokens_per_s() -> dict:
    from edit_jax.models.llama import flops_per_token
    from edit_jax.presets import paper

    cfg = paper("1b", "edit")
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    per_gpu = ASSUMED_MFU * H100_BF16_FLOPS / fpt
    rows_per_host = cfg.batch_size * GPUS_PER_HOST // (cfg.mesh.replica * cfg.mesh.shard)
    return {"flops_per_token": fpt, "tokens_per_s_per_gpu": per_gpu, "tokens_per_s_per_host": per_gpu * GPUS_PER_HOST,
            "seq_len": cfg.data.seq_len, "rows_per_host_step": rows_per_host,
            "assumption": f"{ASSUMED_MFU:.0%} MFU of a {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s H100, "
                          f"{GPUS_PER_HOST} GPUs a host, paper('1b') seq_len {cfg.data.seq_len}"}


def train_bpe(parquet: list[str], path: str, vocab: int) -> str | None:
    try:
        import pyarrow.parquet as pq
        import tokenizers
    except ImportError:
        return None
    if os.path.isfile(path):
        return path
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    texts = pq.ParquetFile(parquet[0]).read_row_group(0, columns=["text"]).column("text").to_pylist()
    tok.train_from_iterator(texts, trainer)
    tok.save(path)
    return path


def tokenize_rate(inputs: list[str], out: str, tokenizer: str, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    args = [_python(), "-m", "edit_jax.cli", "tokenize", *inputs, "--out", out, "--tokenizer", tokenizer,
            "--workers", str(workers), "--no-progress", "--shard-tokens", str(1 << 26)]
    r = measured(args)
    if not r["ok"]:
        print(f"  tokenize failed: {r['error']}", file=sys.stderr)
        return r
    index = json.load(open(os.path.join(out, "index.json")))
    tokens = index["tokens"]["train"] + index["tokens"]["val"]
    r.update(tokens=tokens, tokenizer=os.path.basename(tokenizer), workers=workers,
             tokens_per_s_per_worker=tokens / r["seconds"] / workers)
    print(f"  tokenize {os.path.basename(tokenizer)} x{workers}: {tokens} tokens in {r['seconds']} s, "
          f"peak RSS {r['peak_rss_gb']} GB", file=sys.stderr, flush=True)
    return r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 4, 16], help="generated shard sets")
    ap.add_argument("--parquet-mb", type=float, default=64, help="MB of text in the generated parquet files")
    ap.add_argument("--parquet-files", type=int, default=4)
    ap.add_argument("--bpe-vocab", type=int, default=8192)
    ap.add_argument("--work-dir", default=os.path.join(REPO, "runs", "bench_data"))
    ap.add_argument("--keep", action="store_true", help="keep the generated data (default: remove the shards)")
    ap.add_argument("--json", default=os.path.join(REPO, "runs", "bench", "bench_data.json"))
    ap.add_argument("--cases", nargs="+", default=["all"],
                    choices=["all", "stdlib", "parquet", "shards", "loose", "one-row-group", "streams", "tokenize"],
                    help="what to run (all: every case; stdlib is the reference of the RSS column)")
    ap.add_argument("--loose-gb", type=float, nargs="+", default=[1, 4, 16], help="loose .bin sets (GB)")
    ap.add_argument("--big-files", type=int, default=2, help="parquet files with one row group each")
    ap.add_argument("--big-docs", type=int, default=100_000, help="documents per one-row-group file")
    ap.add_argument("--smoke", action="store_true", help="the stdlib reference run only, smaller still (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.cases = ["stdlib"]
    work = os.path.abspath(args.work_dir)
    os.makedirs(work, exist_ok=True)
    result = {"command": " ".join(["python", "benchmarks/bench_data.py", *sys.argv[1:]]), "loadavg_at_start": loadavg(),
              "host_cpus": os.cpu_count(), "runs": [], "stream": [], "tokenize": [], "env": env_info()}

    def want(case: str) -> bool:
        return "all" in args.cases or case in args.cases

    print("tiny runs (steps=4) ...", file=sys.stderr, flush=True)
    # (--smoke: the tiny config made smaller still, one layer on 2 x 1 devices: its compile is most of the run)
    smoke = ["model.n_layers=1", "mesh.shard=1", "batch_size=4", "data.seq_len=32", "eval_batches=1"]
    result["runs"].append(tiny_run("stdlib", smoke if args.smoke else [], work))
    if args.smoke and not result["runs"][0]["ok"]:
        raise SystemExit(f"bench_data: the tiny run failed: {result['runs'][0]['error']}")
    parquet, tok_dir, bpe = [], os.path.join(work, "parquet_tokens"), None
    if want("parquet") or want("streams") or want("tokenize"):
        parquet = write_parquet_set(os.path.join(work, "parquet"), args.parquet_mb, args.parquet_files)
    if want("parquet"):
        result["tokenize"].append(tokenize_rate(parquet, tok_dir, "byte", 1))
        result["runs"].append(tiny_run(f"tokenized parquet ({args.parquet_mb:g} MB text)",
                                       ["data.source=tokens", f"data.paths={tok_dir}"], work))
        # Streamed parquet: with data.workers=0 the reading and tokenizing thread is inside the
        # measured process (its RSS is everything); with 1 reader process the training process's own.
        for workers in (0, 1):
            result["runs"].append(tiny_run(f"parquet streamed ({args.parquet_files} files), data.workers={workers}",
                                           ["data.source=parquet", "data.paths=" + ",".join(parquet),
                                            f"data.workers={workers}"], work))
    if want("one-row-group"):
        print(f"writing {args.big_files} parquet files of {args.big_docs} documents (pyarrow defaults) ...",
              file=sys.stderr, flush=True)
        big = write_parquet_defaults(os.path.join(work, "parquet_defaults"), args.big_files, args.big_docs)
        mb = sum(os.path.getsize(p) for p in big) / 1e6
        for workers in (0, 1):
            result["runs"].append(tiny_run(f"parquet, 1 row group x {args.big_docs // 1000}k docs per file "
                                           f"({args.big_files} files, {mb:.0f} MB), data.workers={workers}",
                                           ["data.source=parquet", "data.paths=" + ",".join(big),
                                            f"data.workers={workers}"], work))
    if want("loose"):
        print(f"writing loose .bin shards ({max(args.loose_gb):g} GB) ...", file=sys.stderr, flush=True)
        loose_dir = os.path.join(work, "loose")
        sets = write_loose_bins(loose_dir, args.loose_gb)
        for gb in args.loose_gb:
            result["runs"].append(tiny_run(f"loose .bin {gb:g} GB ({len(glob.glob(sets[gb]))} files of 100M tokens)",
                                           ["data.source=tokens", f"data.paths={sets[gb]}"], work))
        if not args.keep:
            shutil.rmtree(loose_dir)
    host = paper_host_tokens_per_s()
    result["paper_1b_host"] = host
    if want("shards"):
        for gb in args.sizes_gb:
            d = os.path.join(work, f"shards_{gb:g}gb")
            print(f"writing {gb:g} GB of shards ...", file=sys.stderr, flush=True)
            write_synthetic_shards(d, gb)
            result["runs"].append(tiny_run(f"token shards {gb:g} GB", ["data.source=tokens", f"data.paths={d}"], work))
            if want("streams"):
                s = stream_tokens_per_s(d, host["seq_len"], host["rows_per_host_step"])
                s["corpus"] = f"token shards {gb:g} GB"
                result["stream"].append(s)
            if not args.keep:
                shutil.rmtree(d)
    if want("tokenize"):
        result["tokenize"].append(tokenize_rate(parquet, tok_dir + "_w2", "byte", 2))
        bpe = train_bpe(parquet, os.path.join(work, "bpe_tokenizer.json"), args.bpe_vocab)
        if bpe:
            result["tokenize"].append(tokenize_rate(parquet[:1], tok_dir + "_bpe", bpe, 1))  # slower: one file

    ref = next(r for r in result["runs"] if r["corpus"] == "stdlib")
    rows = [[r["corpus"], r.get("seconds"), r.get("first_batch_s"), r.get("peak_rss_gb"),
             f"{r['peak_rss_gb'] / ref['peak_rss_gb']:.2f}x" if r.get("peak_rss_gb") else "-"] for r in result["runs"]]
    print_table("tiny training run (configs/tiny.py steps=4), one process",
                ["corpus", "wall s", "first batch s", "peak RSS GB", "RSS vs stdlib"], rows)
    for tokenizer, workers in ([("byte", 0), ("byte", 1)] + ([(bpe, 1), (bpe, 2)] if bpe else [])
                               if want("streams") else []):
        result["stream"].append(parquet_stream_tokens_per_s(parquet, tokenizer, workers, host["seq_len"],
                                                            host["rows_per_host_step"]))
    rows = [[s["corpus"], f"{s['rows']} x {s['seq_len']}", f"{s['tokens_per_s'] / 1e6:.2f} M",
             f"{s['tokens_per_s'] / host['tokens_per_s_per_host']:.1f}x"] for s in result["stream"]]
    if rows:
        print_table("token-shard and streamed-parquet streams, one process, no model",
                    ["corpus", "batch", "tokens/s", "vs 1B preset host"], rows,
                    note=f"1B preset host: {host['tokens_per_s_per_host'] / 1e3:.0f} K tokens/s "
                         f"(ASSUMPTION: {host['assumption']})")
    rows = [[t.get("tokenizer"), t.get("workers"), t.get("tokens"), t.get("seconds"),
             f"{t['tokens_per_s_per_worker'] / 1e6:.2f} M" if t.get("tokens_per_s_per_worker") else "-",
             t.get("peak_rss_gb")] for t in result["tokenize"]]
    if rows:
        print_table(f"edit-jax tokenize ({args.parquet_files} parquet files, {args.parquet_mb:g} MB text)",
                    ["tokenizer", "workers", "tokens", "wall s", "tokens/s/worker", "peak RSS GB (parent)"], rows)
    for r in result["runs"] + result["tokenize"]:
        r.pop("stdout", None)
    write_json(args.json, result)
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
