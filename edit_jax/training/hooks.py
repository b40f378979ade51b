"""What the loop runs after each advance, each on its own cadence (levanter's ``every=N``).

    hooks = Hooks(last_step=cfg.steps)
    hooks.add("records", write_records)                    # after every advance
    hooks.add("evaluate", evaluate, every=cfg.eval_every)  # when a multiple of eval_every is crossed
    end = hooks.run(adv, before, now)                      # None, or End: the loop stops here

A hook is ``fn(adv, before, now) -> End | Rewind | None``. Hooks without ``every`` run after every advance
(records, progress, the stop checks), in the order they were added; a hook with ``every=N`` runs
when the step crosses a multiple of N (an A-EDiT meeting may advance many steps at once), only
where the driver says the cadence may fall (A-EDiT: after a sync ran) and never at the last step
(the loop's end evaluates and saves). The first hook that returns an ``End`` ends the loop; one
that returns ``Rewind`` (it rolled the state back) ends this advance's hooks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class End:
    """How the loop ends. ``interrupted``: no final evaluation and save (the hook that ended it
    saved already, or there is nothing new to save); ``diverged``: the message of a run that
    cannot recover."""

    interrupted: bool
    diverged: str | None = None


class Rewind:
    """A hook rolled the state back (a loss spike): the advance's later hooks do not run, the
    loop goes on from the restored step."""


@dataclass(frozen=True)
class Hook:
    name: str
    fn: Callable[..., End | None]  # (adv, before, now) -> End | None
    every: int | None = None  # None: after every advance; N: when a multiple of N is crossed (0: never)


def crossed(every: int, before: int, now: int) -> bool:
    """A multiple of ``every`` lies in (before, now]: the cadence when the step advances by one
    (lock-step) or by many (an A-EDiT meeting)."""
    return bool(every) and now // every > before // every


class Hooks:
    """The loop's hooks, in the order they run."""

    def __init__(self, last_step: int):
        self.last_step = last_step
        self.hooks: list[Hook] = []
        self.seconds: dict[str, float] = {}

    def add(self, name: str, fn: Callable[..., End | None], every: int | None = None) -> None:
        self.hooks.append(Hook(name, fn, every))

    def due(self, hook: Hook, cadence: bool, before: int, now: int) -> bool:
        if hook.every is None:
            return True
        return cadence and now < self.last_step and crossed(hook.every, before, now)

    def run(self, adv, before: int, now: int) -> End | Rewind | None:
        """Runs the due hooks after an advance from ``before`` to ``now``; the first ``End`` or
        ``Rewind`` wins."""
        self.seconds = {}  # each hook that ran: its time (the loop's timing record)
        for hook in self.hooks:
            if self.due(hook, adv.cadence, before, now):
                t0 = time.perf_counter()
                end = hook.fn(adv, before, now)
                self.seconds[hook.name] = time.perf_counter() - t0
                if end is not None:
                    return end
        return None


__all__ = ["End", "Hook", "Hooks", "Rewind", "crossed"]
