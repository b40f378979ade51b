"""An exchange run through a storage outage of a minute: does it finish by itself, on one θ̄?

    python benchmarks/bench_outages.py [--kinds gone,readonly,full,s3] [--outage 60] [--steps 40]

Real processes: ``edit-jax train`` (the launcher and two one-device workers, ``configs/tiny.py``,
A-EDiT, ``sync.time.tau=0.3``, ``sync.exchange.grace=1``, the default ``sync.exchange.patience``). Once its
round 1 closed, the exchange's storage fails for ``--outage`` seconds, one way per run:

- ``gone``: the exchange directory renamed away (an unmounted share), then back;
- ``readonly``: the directory on a tmpfs of its own, remounted read-only, then read-write (root only);
- ``full``: that tmpfs filled to its last byte by another file, which is then removed (root only);
- ``s3``: moto's S3 server behind a TCP relay that stops listening and drops its connections (the
  endpoint down: connections refused), then listens again.

Reported per outage: the run's exit code and wall time, the rounds recorded when the outage began,
when it ended and in all (consecutive: none discarded; the run must close rounds after the
outage), rounds redone, posts rejected, late posts, whether both workers ended on the same θ̄
(``finished_round`` hashes), the wait lines ("retrying" / "answering again"), worker restarts after
an exit 75, and tracebacks in the output (expected: exit 0, one θ̄, no traceback, no restart).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

if __package__ in (None, ""):  # run as a script: the repo root on the path, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness as common
from edit_jax.rundir.records import read_records

REPO = common.REPO
KINDS = ("gone", "readonly", "full", "s3")
BUCKET = "edit-jax-outage"


class Relay:
    """A TCP relay 127.0.0.1:``port`` -> ``target``: ``down()`` closes its listener and every
    connection through it (a client then gets "connection refused"), ``up()`` listens again."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.conns, self.lock = target, [], threading.Lock()
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.listener = None
        self.up()

    def up(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self.listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def down(self) -> None:
        self.listener.close()
        with self.lock:
            for c in self.conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self.conns.clear()

    def _accept(self, listener) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: down()
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a, b) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _mount_tmpfs(path: str, size: str = "256m") -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True)


def _remount(path: str, mode: str) -> None:
    """``mount -o remount,MODE``; EBUSY while a writer has a file open: tried again for 5 s."""
    end = time.monotonic() + 5
    while True:
        r = subprocess.run(["mount", "-o", f"remount,{mode}", path], capture_output=True, text=True)
        if r.returncode == 0:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"remount,{mode} {path}: {r.stderr.strip()}")
        time.sleep(0.05)


def _fill(path: str) -> str:
    """A file in ``path`` filling its filesystem to the last byte (ENOSPC for everyone else)."""
    filler = os.path.join(path, "filler.bin")
    with open(filler, "wb", buffering=0) as f:  # (unbuffered: no write left over to fail at close)
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    return filler


def _outage(kind: str, ex_dir: str, mnt: str, relay: Relay | None):
    """Start the outage; returns the function that ends it."""
    if kind == "gone":
        os.rename(ex_dir, ex_dir + ".away")
        return lambda: os.rename(ex_dir + ".away", ex_dir)
    if kind == "readonly":
        _remount(mnt, "ro")
        return lambda: _remount(mnt, "rw")
    if kind == "full":
        filler = _fill(mnt)
        return lambda: os.remove(filler)
    relay.down()
    return relay.up


def one_run(kind: str, root: str, seconds: float, steps: int, env: dict, endpoint: str | None) -> dict:
    run = os.path.join(root, kind, "run")
    mnt = os.path.join(root, kind, "mnt")
    os.makedirs(mnt)
    relay = None
    if kind in ("readonly", "full"):
        _mount_tmpfs(mnt)
    if kind == "s3":
        host, port = endpoint.rsplit("//", 1)[1].split(":")
        relay = Relay((host, int(port)))
        exchange = f"s3://{BUCKET}/{kind}?endpoint=http://127.0.0.1:{relay.port}"
    else:
        exchange = os.path.join(mnt, "run.x")
    args = ["--config", os.path.join(REPO, "configs", "tiny.py"), "--run-dir", run, f"sync.exchange.url={exchange}",
            "sync.method=a_edit", "sync.warmup_steps=0", "mesh.replica=2", "mesh.shard=1", "mesh.processes=2",
            "sync.time.tau=0.3", "sync.exchange.grace=1", "batch_size=4", f"steps={steps}", "eval_every=0"]
    log_path = os.path.join(root, kind, "log.txt")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "edit_jax", "train", *args], env=env, stdout=log,
                             stderr=subprocess.STDOUT, cwd=os.path.join(root, kind))
    outage_s, began, at = None, None, {}
    try:
        first = os.path.join(exchange, "rounds", "r00000001.json") if kind != "s3" else None
        while began is None:
            if p.poll() is not None:
                break
            if (first and os.path.exists(first)) or (kind == "s3" and _round_closed(run, 1)):
                at["start"] = _rounds_recorded(run)
                end = _outage(kind, exchange, mnt, relay)
                began = time.monotonic()
                time.sleep(seconds)
                at["end"] = _rounds_recorded(run)
                end()
                outage_s = time.monotonic() - began
            else:
                time.sleep(0.1)
        code = p.wait(timeout=seconds + 600)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if kind in ("readonly", "full"):
            subprocess.run(["umount", "-l", mnt], check=False)
        if relay is not None:
            relay.down()
    wall = time.monotonic() - t0
    with open(log_path) as f:
        out = f.read()
    recs = _records(run)
    rounds = [r["round"] for r in recs if r.get("sync")]
    ends = {r["worker"]: r["theta_hash"] for r in recs if "finished_round" in r}
    return {"kind": kind, "exit": code, "wall_s": round(wall, 1), "outage_s": outage_s and round(outage_s, 1),
            "rounds": len(rounds), "rounds_at_start": at.get("start"), "rounds_at_end": at.get("end"),
            "rounds_consecutive": rounds == list(range(1, len(rounds) + 1)),
            "redone": sum("round_redone" in r for r in recs),
            "rejected": sum(len(r.get("rejected", {})) for r in recs),
            "late_posts": sum("late_post" in r for r in recs),
            "one_theta": len(ends) == 2 and len(set(ends.values())) == 1,
            "waits": out.count("retrying for up to"), "answering_again": out.count("answering again"),
            "restarts_75": out.count("could not use the exchange"), "tracebacks": out.count("Traceback")}


def _records(run: str) -> list[dict]:
    return read_records(os.path.join(run, "metrics.jsonl"))  # (polled while written: a cut line is skipped)


def _round_closed(run: str, r: int) -> bool:
    return any(rec.get("sync") and rec.get("round", 0) >= r for rec in _records(run))


def _rounds_recorded(run: str) -> int:
    return sum(1 for rec in _records(run) if rec.get("sync"))


def _moto():
    """A moto S3 server on a free port with the bucket; (server, endpoint)."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    return server, endpoint


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default=",".join(KINDS), help=f"outages to run, of {', '.join(KINDS)}")
    p.add_argument("--outage", type=float, default=60.0, help="seconds the storage is down")
    p.add_argument("--steps", type=int, default=200,
                   help="the run's token budget, in steps per worker slot (enough to outlast the outage's start)")
    p.add_argument("--run-root", default="", help="where the runs go (default: a temporary directory, removed)")
    common.add_common(p, "bench_outages")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if bad := sorted(set(kinds) - set(KINDS)):
        p.error(f"--kinds: unknown {bad}; expected some of {list(KINDS)}")
    if os.geteuid() != 0 and {"readonly", "full"} & set(kinds):
        print("readonly / full need root (a tmpfs mounted for the exchange): skipped")
        kinds = [k for k in kinds if k not in ("readonly", "full")]
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        os.environ.pop(name, None)
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    server, endpoint = _moto() if "s3" in kinds else (None, None)
    root = args.run_root or tempfile.mkdtemp(prefix="bench_outages-")
    runs = []
    try:
        for kind in kinds:
            runs.append(one_run(kind, root, args.outage, args.steps, env, endpoint))
            print(json.dumps(runs[-1]))
    finally:
        if server is not None:
            server.stop()
        if not args.run_root:
            shutil.rmtree(root, ignore_errors=True)
    cols = ["kind", "exit", "wall_s", "outage_s", "rounds_at_start", "rounds_at_end", "rounds", "rounds_consecutive",
            "redone", "rejected", "late_posts", "one_theta", "waits", "answering_again", "restarts_75", "tracebacks"]
    common.print_table(f"exchange runs through {args.outage:g} s of storage outage", cols,
                       [[r[c] for c in cols] for r in runs])
    common.write_json(args.json, {"env": common.env_info(), "args": vars(args), "runs": runs})
    print(f"JSON: {args.json}")
    # (the run must have outlived the outage: it waited, and closed rounds after it)
    good = lambda r: (r["exit"] == 0 and r["one_theta"] and r["rounds_consecutive"] and not r["tracebacks"]
                      and r["waits"] > 0 and r["rounds"] > (r["rounds_at_end"] or 0))
    return 0 if runs and all(good(r) for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
