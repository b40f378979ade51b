"""One-off check: an `edit-jax export` loaded by Hugging Face `transformers` gives our logits.

`transformers` (and torch) are not dependencies of edit-jax: they live in a throwaway venv whose
python is passed as --hf-python. This script runs in edit-jax's venv: it exports the run (θ̄ of
the latest or given checkpoint) in float32, computes our logits on a few sequences, then runs
itself under --hf-python to load the export with `LlamaForCausalLM.from_pretrained` on CPU and
compare; it prints the max |logit difference| and exits 1 if it exceeds --tol.

    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
    PYTHONPATH=$PWD python tools/check_hf_export.py --run-dir runs/demo --hf-python /tmp/hfvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def ours(args) -> int:
    import numpy as np

    from edit_jax.models import llama as model_lib
    from edit_jax.hf.export import export_run
    from edit_jax.rundir.trained import load_trained

    work = args.work or tempfile.mkdtemp(prefix="check_hf_export_")
    out = os.path.join(work, "export")
    export_run(args.run_dir, out, step=args.step, dtype="float32", force=True)
    model = load_trained(args.run_dir, args.step)
    rng = np.random.default_rng(0)
    n = model.cfg.data.seq_len
    vocab = min(model.cfg.model.vocab_size, 257) if model.cfg.data.tokenizer == "byte" else model.cfg.model.vocab_size
    text = b"def main(argv):\n    import sys\n    for line in sys.stdin:\n        print(line.strip())\n"
    seqs = np.stack([rng.integers(0, vocab, n), rng.integers(0, vocab, n),
                     np.resize(np.frombuffer(text, np.uint8), n)]).astype(np.int32)
    logits, _ = model_lib.forward(model.cfg.model, model.params, seqs)
    np.savez(os.path.join(work, "ours.npz"), tokens=seqs, logits=np.asarray(logits, np.float32))
    print(f"exported {args.run_dir} step {model.step} ({model.source} params) to {out}; "
          f"our logits on {len(seqs)} sequences of {n} tokens", file=sys.stderr)
    proc = subprocess.run([args.hf_python, os.path.abspath(__file__), "--hf-side", work], capture_output=True,
                          text=True)
    sys.stderr.write(proc.stderr[-4000:])
    if proc.returncode != 0:
        print(f"transformers side failed (rc {proc.returncode})", file=sys.stderr)
        return proc.returncode
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(run_dir=args.run_dir, step=model.step, params=model.source)
    print(json.dumps(result))
    return 0 if result["max_abs_diff"] <= args.tol else 1


def hf_side(work: str) -> int:
    import numpy as np
    import torch
    import transformers
    from transformers import LlamaForCausalLM

    data = np.load(os.path.join(work, "ours.npz"))
    model = LlamaForCausalLM.from_pretrained(os.path.join(work, "export"), torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(data["tokens"].astype(np.int64))).logits.numpy()
    diff = np.abs(theirs - data["logits"])
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                      "sequences": int(theirs.shape[0]), "tokens": int(theirs.shape[1]),
                      "max_abs_diff": float(diff.max()), "max_abs_logit": float(np.abs(theirs).max()),
                      "argmax_agree": float((theirs.argmax(-1) == data["logits"].argmax(-1)).mean())}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--hf-python", default="/tmp/hfvenv/bin/python", help="python of a venv with transformers")
    parser.add_argument("--work", default=None, help="where to put the export and our logits (default: a temp dir)")
    parser.add_argument("--tol", type=float, default=1e-3, help="max |logit difference| accepted")
    parser.add_argument("--hf-side", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_side:
        return hf_side(args.hf_side)
    if not args.run_dir:
        parser.error("--run-dir is required")
    return ours(args)


if __name__ == "__main__":
    raise SystemExit(main())
