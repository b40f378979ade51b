"""Exchange-mode A-EDiT end to end against a real S3 endpoint (moto's server, started here).

    python tools/check_elastic_s3.py        # needs the test extra (boto3, moto)

Two workers (threads of this process, each its own programs) of ``configs/tiny.py`` meet through
``s3://runs/elastic?endpoint=http://127.0.0.1:PORT`` until the token budget is spent; prints the
rounds (members, how each closed), each worker's exit code and the θ̄ hash every worker ended on
(one hash: the same θ̄ everywhere). tests/test_exchange.py tests the backend itself in CI.
"""

import json
import os
import sys
import tempfile
import threading

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    import boto3
    from moto.server import ThreadedMotoServer

    from edit_jax.elastic.worker import ElasticWorker
    from edit_jax.validate import load_config

    server = ThreadedMotoServer(port=0)
    server.start()
    host, port = server.get_host_and_port()
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "test")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="runs")
    run = tempfile.mkdtemp(prefix="elastic_s3_")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(repo, "configs", "tiny.py"), [
        "sync.method=a_edit", f"sync.exchange.url=s3://runs/elastic?endpoint={endpoint}", "sync.warmup_steps=0",
        "mesh.replica=2", "mesh.shard=1", "mesh.processes=2", "sync.time.tau=0.5", "sync.exchange.grace=2", "steps=24",
        "batch_size=8", "eval_batches=1"])
    codes = {}
    workers = [ElasticWorker(cfg, w, run, say=print) for w in (0, 1)]
    threads = [threading.Thread(target=lambda w=w: codes.__setitem__(w.me, w.run())) for w in workers]
    [t.start() for t in threads]
    [t.join() for t in threads]
    server.stop()
    with open(os.path.join(run, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    print("rounds (round, members, closed by):",
          [(r["round"], r["members"], r["closed_by"]) for r in recs if r.get("sync")])
    hashes = {r["theta_hash"] for r in recs if "finished_round" in r}
    print("exit codes:", codes, "| θ̄ hashes the workers ended on:", hashes)
    return 0 if set(codes.values()) == {0} and len(hashes) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
