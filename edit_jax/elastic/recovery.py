"""How an exchange worker reads what it cannot trust to be whole: a round's manifest that does not
read, a post a manifest names that is damaged or gone since, a garbled published state. None of
them is a wedge: the round is redone as its manifest's next version, from the posts that still
pass the check (``rounds.collect(..., version=)``), or its published state is taken; a garbled
newest state is passed over for the one before it. Split from ``worker.py`` (the round protocol's
happy path) so that each reads whole; ``ElasticWorker`` is a ``RoundRecovery``."""

from __future__ import annotations

import time

from edit_jax.elastic import rounds as R

POLL_S = 0.05  # as worker.POLL_S: how often a waiting worker looks at the exchange


class Published(Exception):
    """Round ``round`` cannot be replayed here, and a state of it (or later) is published: take that."""

    def __init__(self, r: int):
        super().__init__(r)
        self.round = r


class RoundRecovery:
    """The recovering half of ``ElasticWorker`` (it sets ``ex``, ``check``, ``cfg``, ``me``, ``say``,
    ``stop``, ``template``, ``record``, ``applied``, ``catch_up`` and ``_publish``)."""

    def manifest(self, shared: R.RoundState, r: int) -> R.Manifest | None:
        """Round r's manifest (its newest version); one that cannot be read is superseded (``redo``)."""
        try:
            return R.read_manifest(self.ex, r, self.check)
        except R.BadObject as e:
            return self.redo(shared, r, str(e), None)

    def redo(self, shared: R.RoundState, r: int, why: str, members: list[int] | None) -> R.Manifest | None:
        """Round r again, from the posts of ``members`` (None: any) that still pass the check, as its
        manifest's next version (create-exclusive: of several workers that found the same fault, one
        writes it, all read it). Its published state instead, where there is one or its closer
        publishes one within ``sync.exchange.grace`` s: the round was applied and kept (no θ̄ split)."""
        until = time.monotonic() + self.cfg.sync.exchange.grace
        while self._newest_good_state(r, required=False) is None:
            if time.monotonic() >= until or self.stop:
                break
            time.sleep(getattr(self.ex, "poll_s", POLL_S))
        else:
            raise Published(r)
        version = max(R.manifest_versions(self.ex, r), default=-1) + 1
        self.say(f"edit-jax worker {self.me}: round {r}: {why}; the round is redone without it (version {version})")
        self.record({"step": shared.global_step, "worker": self.me, "round_redone": r, "why": why[:300],
                     "version": version})
        m = R.collect(self.ex, r, self.me, True, shared.digest(), self.check, version, why[:300], members)
        if m is None:
            raise RuntimeError(f"round {r}: {why}, and no post of the round can be read any more nor a state of "
                               f"round >= {r} is published (exchange {self.ex.url})")
        return m

    def hand_over_last(self, shared: R.RoundState) -> None:
        """The run ended on a round this process applied and another closed. Its closer publishes
        the round's state and record; one that died between its manifest and its state leaves
        neither, and no round r + 1 comes whose closer would publish them (``apply``). So after
        ``sync.exchange.grace`` s without the state, this worker publishes both, ``published_for`` the
        closer's slot (creates are exclusive: a closer only slow writes nothing after it)."""
        last = self.applied
        if self.stop or not last or last[0].round != shared.round or last[0].closer == self.me:
            return
        until = time.monotonic() + self.cfg.sync.exchange.grace
        while not self.ex.list(R.state_key(shared.round)):
            if time.monotonic() >= until:
                self._publish(shared, *last, published_for=last[0].closer)
                return
            if self.stop:
                return
            time.sleep(getattr(self.ex, "poll_s", POLL_S))

    def _state(self, r: int) -> R.RoundState | None:
        """The published state of round r, or None (absent, or not a readable state of this run: said)."""
        key = R.state_key(r)
        data = self.ex.get(key)
        if data is None:
            return None
        try:
            return R.RoundState.decode(data, self.template, key, self.check)
        except ValueError as e:
            self.say(f"edit-jax worker {self.me}: {str(e)[:300]}; passed over")
            return None

    def _newest_good_state(self, r: int, required: bool = True) -> R.RoundState | None:
        """The newest readable published state of a round >= r (a garbled newest one: the one before)."""
        for have in reversed(R.state_rounds(self.ex)):
            state = self._state(have) if have >= r else None
            if state is not None:
                return state
        if not required:
            return None
        raise RuntimeError(f"round {r}: its posts were collected and no readable state of round >= {r} is "
                           f"published (exchange {self.ex.url})")


__all__ = ["RoundRecovery", "Published"]
