"""What a round accepts (docs/developer/exchange.md): a post enters a manifest only once it is read and checked.

Anything can land in the exchange: a truncated or random object, a post of another wire, a
post copied from another run of the same config, stray files. One such post named by a manifest
used to wedge the run for good (every reader died on it at every restart), and a stranger's post
was merged into θ̄ without a word. So:

- **the seal**: every post carries the run's id (``run/start.json``, made once per run by its
  first worker) and a checksum of its arrays; with a shared secret in ``$EDIT_JAX_EXCHANGE_KEY``
  also an HMAC-SHA256 over both and the post's header, so a writer without the key cannot enter
  θ̄. The secret lives only in the environment: never in ``config.json`` or a record.
- **the check** (``rounds.PostCheck.problem``), run by the closer on every post before the manifest
  names it: whole and readable, its seal, its run, its round and slot equal to its key's, its base
  θ̄ hash equal to the closer's θ̄_{r-1}, its wire (``packed.check_post``) and its arrays' shapes.
  A post that fails is left out of the round; the manifest says why (``Manifest.rejected``) and
  the round's record carries it. A worker whose post was left out is late (its steps carried
  into its next post, ``sync.exchange.late_posts``).

Objects of a run started before seals existed (no ``run`` in ``run/start.json``) are read as they
are: without an id there is nothing to compare, and their checksums are the .npz's own CRCs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time

from edit_jax.elastic.admission import NotAdmitted
from edit_jax.rundir.integrity import leaves_hash, unpack_arrays

ENV_KEY = "EDIT_JAX_EXCHANGE_KEY"


def exchange_key() -> bytes | None:
    """The run's shared secret (``$EDIT_JAX_EXCHANGE_KEY``), or None: posts are then sealed with
    the run id and a checksum only."""
    value = os.environ.get(ENV_KEY, "")
    return value.encode() if value else None


def _signature(meta: dict, key: bytes) -> str:
    body = json.dumps({k: v for k, v in meta.items() if k != "sig"}, sort_keys=True).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def seal(meta: dict, arrays, run: str, key: bytes | None) -> dict:
    """``meta`` with the run id, the arrays' checksum (``arrays`` None: the object has its own, as
    a round state's θ̄ hash) and, with a key, the signature over them."""
    out = {**meta, "run": run} if arrays is None else {**meta, "run": run, "sum": leaves_hash(arrays)}
    if key is not None:
        out["sig"] = _signature(out, key)
    return out


def broken_seal(meta: dict, arrays, run: str, key: bytes | None) -> str | None:
    """Why an object's seal does not hold for this run (None: it holds)."""
    if run and meta.get("run") != run:
        return f"another run's (run id {meta.get('run', '(none)')!r}, this run {run!r})"
    if arrays is not None and "sum" in meta and meta["sum"] != leaves_hash(arrays):
        return "its arrays do not match its checksum"
    if arrays is not None and run and "sum" not in meta:
        return "no checksum"
    if key is not None:
        if "sig" not in meta:
            return f"unsigned (this run signs with ${ENV_KEY})"
        if not hmac.compare_digest(str(meta["sig"]), _signature(meta, key)):
            return f"wrongly signed (not this run's ${ENV_KEY})"
    return None


START_KEY = "run/start.json"


def _start(run: str, key: bytes | None) -> bytes:
    info = {"time": time.time(), "run": run}
    if key is not None:  # what a worker with another key (or none) is refused by, before any work
        info["keycheck"] = hmac.new(key, f"keycheck:{run}".encode(), hashlib.sha256).hexdigest()
    return json.dumps(info).encode()


def run_start(ex, say=print, key: bytes | None = None) -> tuple[float, str]:
    """The run's start time and id (``run/start.json``, created once by its first worker). A
    garbled one is written again, with the id the newest published state carries (so posts and
    states already sealed stay this run's) and this moment as the start (saved progress of the
    old start is then passed over: safe, its steps are redone). ``NotAdmitted`` for a worker whose
    ``$EDIT_JAX_EXCHANGE_KEY`` is not the run's (it would leave out every post of the others)."""
    ex.create(START_KEY, _start(secrets.token_hex(8), key))
    data = ex.get(START_KEY)
    try:
        info = json.loads(data.decode())
        start, run = float(info["time"]), str(info.get("run", ""))  # (no id: a run started before ids)
    except (AttributeError, ValueError, TypeError, KeyError, UnicodeDecodeError):
        run = _newest_state_run(ex)
        ex.put(START_KEY, _start(run, key))
        say(f"edit-jax: exchange {ex.url}: {START_KEY} was not readable; written again (run id "
            f"{run or '(none)'} from the newest round state)")
        info = json.loads(ex.get(START_KEY).decode())
        start, run = float(info["time"]), str(info.get("run", ""))
    theirs = info.get("keycheck")
    if (theirs is None) != (key is None) or (key is not None and not hmac.compare_digest(
            str(theirs), json.loads(_start(run, key))["keycheck"])):
        why = ("was started without it: unset it, or start a new run" if theirs is None else
               "is not this run's key" if key is not None else "is not set, and this run signs its objects with one")
        raise NotAdmitted(f"${ENV_KEY} {why} (exchange {ex.url}, {START_KEY})")
    return start, run


def _newest_state_run(ex) -> str:
    for key in reversed(ex.list("state/r")):
        data = ex.get(key)
        try:
            return str(unpack_arrays(data, key)[1].get("run", "")) if data else ""
        except ValueError:
            continue
    return secrets.token_hex(8)


__all__ = ["ENV_KEY", "START_KEY", "exchange_key", "seal", "broken_seal", "run_start"]
