"""The one method table: what each method is, what it fixes in the config, and when it syncs.

Every method is a configuration of one machinery (EDIT.md, "The methods the paper compares"):

| method           | outer state | sync                                        | penalty |
|------------------|-------------|---------------------------------------------|---------|
| `baseline`       | no          | gradients over `replica` every step (HSDP)  | -       |
| `post_local_sgd` | θ̄ = mean    | whole model after the step, every τ         | -       |
| `diloco`         | θ̄ + outer   | whole model after the step, every τ         | -       |
| `edit`           | θ̄ + outer   | layer by layer inside the forward, every τ  | yes     |
| `a_edit`         | θ̄ + outer   | as `edit`, every τ_time seconds, async      | yes     |
| `co2`            | θ̄ + outer   | one round stale: round t's all-reduce is    | -       |
|                  | + in flight | applied at the end of round t + 1 (CO2.md)  |         |

``plan_for(cfg)`` is the only place a method's meaning is decided. It returns a ``MethodPlan``:
the static ``Plan`` the compiled steps need, the *normalised* config (the sync fields a method
fixes are written as they take effect, so ``config.json`` says what ran), the list of fields it
changed (announced by ``train``), and the ``Schedule`` the training loop queries each step.

To add a method: one ``Method`` row in ``METHODS`` naming its sync rule's factory; a new kind of
sync is one module of ``localsgd/`` with its ``SyncRule`` subclass (``rule.py`` lists them),
whose ``build`` the row names. The rule says where it syncs (``in_forward``) and when
(``asynchronous``), and ``plan_for`` picks the schedule from that. The config rules that ask
this table (a known method and outer optimizer) are ``validate`` at the end; what each method
allows is its rule's (``rules.validate``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edit_jax.config import RULE_SECTIONS, Config, SyncConfig, get_field, register_rule_section, require, with_fields
from edit_jax.localsgd.compressed import Compressed
from edit_jax.localsgd.layerwise import LayerwiseSync
from edit_jax.localsgd.outer_spec import OUTER_OPTIMIZERS, OuterSpec, Penalty
from edit_jax.localsgd.rule import NoSync, SyncRule
from edit_jax.localsgd.stale import StaleSync
from edit_jax.localsgd.timed import Timed
from edit_jax.localsgd.whole_model import WholeModelSync

# Importing the rules imports JAX, which creates no backend: a config is validated (``validate``
# below) before the CPU device count is set, and that count still takes effect (test_imports.py).

# Kinds of compiled step (programs.py). A schedule maps each inner step k to one of them.
STEP_KINDS = ("hsdp", "local", "sync_forward", "local_then_sync")
SYNC_KINDS = ("sync_forward", "local_then_sync")  # the kinds that run a sync (and may carry a group)


@dataclass(frozen=True)
class StepKind:
    """One kind of compiled step: ``name`` in ``STEP_KINDS`` and, for a streaming sync
    (``sync.fragments > 1``), the fragment ``group`` it syncs. ``str(kind)`` is the name records
    and logs use (``"sync_forward@2"``); ``StepKind.parse`` reads it back."""

    name: str
    group: int | None = None

    def __post_init__(self):
        if self.name not in STEP_KINDS:
            raise ValueError(f"unknown step kind {self.name!r}; expected one of {', '.join(STEP_KINDS)}")
        if self.group is not None and (self.name not in SYNC_KINDS or self.group < 0):
            raise ValueError(f"step kind {self.name!r}: a fragment group ({self.group}) is for the sync kinds "
                             f"{', '.join(SYNC_KINDS)} only, and >= 0")

    @property
    def syncs(self) -> bool:
        """Runs a sync over `replica` (and so reads and writes the outer state)."""
        return self.name in SYNC_KINDS

    @property
    def crosses_replica(self) -> bool:
        """Any value crosses `replica` in this step (gradients or pseudo gradients): every worker
        must run it together. Only ``local`` steps stay within one worker."""
        return self.name != "local"

    def __str__(self) -> str:
        return self.name if self.group is None else f"{self.name}@{self.group}"

    @classmethod
    def parse(cls, kind: "StepKind | str") -> "StepKind":
        """``"sync_forward@2"`` -> StepKind("sync_forward", 2); a StepKind is returned as is."""
        if isinstance(kind, StepKind):
            return kind
        name, _, group = str(kind).partition("@")
        try:
            return cls(name, int(group) if group else None)
        except ValueError as e:
            raise ValueError(f"step kind {kind!r}: {e}") from None


HSDP, LOCAL = StepKind("hsdp"), StepKind("local")


RuleFactory = Callable[[SyncConfig], SyncRule]  # a rule class's ``build``, or ``Timed.around(...)``


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    # The factory of the sync rule it runs (a rule module's ``SyncRule`` subclass, built from the
    # sync config; ``rule.py`` lists them). The rule says where and when it syncs.
    rule: RuleFactory
    # sync fields this method sets whatever the config says ("outer.lr": a section's)
    fixed: dict = field(default_factory=dict)
    penalty: bool = False  # EDiT's penalty (anomaly elimination, weighting, clipping) is configurable

    @property
    def keeps_outer(self) -> bool:  # θ̄, an outer optimizer state and anomaly detectors
        return self.rule(SyncConfig()).keeps_outer


_NO_PENALTY = {"penalty.anomaly": False, "penalty.weighting": False, "penalty.clip": False}

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("baseline", "synchronous HSDP: gradients averaged over replica every step", rule=NoSync.build,
           fixed={"layerwise": False, **_NO_PENALTY}),
    # θ̄ = the plain mean of the workers: SGD with lr 1 and no momentum on the pseudo gradient.
    Method("post_local_sgd", "W synchronous steps, then params averaged every tau steps", rule=WholeModelSync.build,
           fixed={"layerwise": False, "outer.optimizer": "nesterov", "outer.lr": 1.0, "outer.momentum": 0.0,
                  "outer.nesterov": False, **_NO_PENALTY}),
    Method("diloco", "pseudo gradients of the whole model after the step, outer optimizer, every tau",
           rule=WholeModelSync.build, fixed={"layerwise": False, **_NO_PENALTY}),
    Method("edit", "pseudo gradients layer by layer in the forward, penalised, outer optimizer, every tau",
           rule=LayerwiseSync.build, penalty=True),
    # A-EDiT: EDiT's sync, due by wall clock per worker (one process per worker, multihost.py).
    Method("a_edit", "EDiT's sync every tau_time seconds; workers step at their own pace",
           rule=Timed.around(LayerwiseSync.build),
           penalty=True),
    # CO2 (Sun et al., ICLR 2024; docs/design/CO2.md): heavy-ball outer momentum on the
    # previous round's mean pseudo gradient, so the all-reduce never waits for this round's steps.
    Method("co2", "outer step on the previous round's all-reduced pseudo gradient (one round stale), every tau",
           rule=StaleSync.build,
           fixed={"layerwise": False, "outer.optimizer": "nesterov", "outer.nesterov": False, **_NO_PENALTY}),
)}

LIBRARY_METHODS = tuple(METHODS)  # the rows above; ``register`` adds others, never replaces these


@dataclass(frozen=True)
class Plan:
    """The static facts the compiled steps need, derived once from the (normalised) config."""

    method: str
    rule: SyncRule  # the rule as it runs (compressed when sync.wire.kind is set): ``rule.py``
    layerwise: bool  # the rule syncs inside the forward, unit by unit (``rule.in_forward``)
    penalty: Penalty
    outer: OuterSpec  # with the rule's own part (CO2's momentum clamp: ``SyncRule.outer_spec``)


# ----------------------------------------------------------------------------- schedules


@dataclass(frozen=True)
class StepSchedule:
    """Which step inner step k (0-based) is, by step count (EDIT.md, Algorithm 1).

    The loop asks ``kind(k)`` before step k and ``init_outer_due(k)``; ``outer_is_live(k)`` says
    whether θ̄ (rather than the replicas' identical params) is the model after k steps. A
    time-based schedule (A-EDiT) or a stale one (CO2) answers the same three questions.
    """

    uses_outer: bool
    layerwise: bool
    warmup: int  # W: synchronous (HSDP) steps first
    tau: int
    fragments: int = field(default=1, kw_only=True)  # F > 1: staggered groups (fragments.py)

    def kind(self, k: int) -> StepKind:
        w = self.warmup
        if not self.uses_outer or k < w:
            return HSDP
        if self.layerwise:  # the sync of the window [k - tau, k) runs inside step k's forward
            g = self.due_group(k - w)
            return LOCAL if g is None else self.with_group("sync_forward", g)
        g = self.due_group(k + 1 - w)  # the same window, synced after step k - 1
        return LOCAL if g is None else self.with_group("local_then_sync", g)

    def due_group(self, j: int) -> int | None:
        """The fragment group whose sync is due at position ``j`` of the local phase (j = k - W for
        the sync in step k's forward, k + 1 - W for a sync after step k), or None. Group f is due
        when j > 0 and j mod tau == f tau / F; with F = 1: j mod tau == 0 (group 0, every unit)."""
        tau, f = self.tau, self.fragments
        if j <= 0 or (j % tau) % (tau // f):
            return None
        return (j % tau) // (tau // f)

    def with_group(self, name: str, group: int) -> StepKind:
        """``sync_forward`` (F = 1: every unit) or ``sync_forward@f`` (group f only)."""
        return StepKind(name, None if self.fragments == 1 else group)

    def init_outer_due(self, k: int) -> bool:
        """The first sync (k == W > 0) only sets θ̄ to the (identical) replicas' params."""
        return self.uses_outer and self.warmup > 0 and k == self.warmup

    def outer_is_live(self, k: int) -> bool:
        return self.uses_outer and k > self.warmup


@dataclass(frozen=True)
class SyncDecision:
    """What every worker does at an A-EDiT meeting (identical everywhere: it is computed from the
    step counts all workers exchanged)."""

    run: bool  # False: too few steps since the last sync; skipped, timers reset
    shares: tuple[float, ...]  # each worker's share of the steps since the last sync
    mean_step: int  # the global mean inner step: the learning-rate schedule follows it
    finished: bool  # the global token budget is reached: this is the final sync


@dataclass(frozen=True)
class TimeSchedule:
    """A-EDiT (EDIT.md, "A-EDiT"): W synchronous (HSDP) steps, then every worker takes local steps
    at its own pace; a sync is due on a worker when ``tau_time`` seconds of wall time (float64
    clock) passed since the last one. At its due point a worker enters the meeting and contributes
    its step counts; ``decide`` turns everyone's counts into one decision. It answers the questions
    every schedule answers (``kind``, ``init_outer_due``, ``outer_is_live``), without a tau."""

    uses_outer: bool
    layerwise: bool
    warmup: int  # W: synchronous (HSDP) steps first
    tau_time: float
    min_total_steps: int
    target_total_steps: int  # steps x workers: the global budget of inner steps (tokens / batch)

    def kind(self, k: int) -> StepKind:
        return HSDP if k < self.warmup else LOCAL

    def init_outer_due(self, k: int) -> bool:
        """The first sync (k == W > 0) only sets θ̄ to the (identical) replicas' params."""
        return self.uses_outer and self.warmup > 0 and k == self.warmup

    def outer_is_live(self, k: int) -> bool:
        return self.uses_outer and k > self.warmup

    def sync_kind(self) -> StepKind:
        return StepKind("sync_forward" if self.layerwise else "local_then_sync")

    def sync_due(self, now: float, last_sync: float) -> bool:
        return now - last_sync >= self.tau_time

    def decide(self, steps_since: list[int], steps_done: list[int]) -> SyncDecision:
        """``steps_since[i]``: worker i's steps since the last sync; ``steps_done[i]``: its steps
        since the start of training."""
        total_since, total_done = int(sum(steps_since)), int(sum(steps_done))
        finished = total_done >= self.target_total_steps
        run = finished or total_since >= self.min_total_steps
        shares = tuple(float(x) / total_since if total_since else 1.0 / len(steps_since) for x in steps_since)
        return SyncDecision(run, shares, int(round(total_done / len(steps_done))), finished)


def step_kinds(schedule, cfg, start: int = 0) -> list[str]:
    """The step kinds ``schedule`` runs from step ``start`` on (a resumed run: past the warmup, no
    warmup step), in first-use order (the warmup, one tau window and a bit). A kind first runs next
    to the warmup's end or to a fragment group's due step, and the kinds repeat every tau steps
    after the warmup, so only the steps around those are asked (a warmup or tau of 10^9 steps is
    planned at once, not stepped through)."""
    kinds = []
    w, tau, f = schedule.warmup, max(cfg.sync.tau, 1), max(cfg.sync.fragments, 1)
    base = w if start <= w else w + (start - w) // tau * tau  # the tau window start is in
    horizon = base + 2 * tau + 2
    due = {start, w, *(base + j for g in range(f) for j in (g * tau // f, tau + g * tau // f))}
    for k in sorted({k + d for k in due for d in (-1, 0, 1, 2) if start <= k + d < horizon}):
        name = str(schedule.kind(k))
        if name not in kinds:
            kinds.append(name)
    if hasattr(schedule, "sync_kind") and str(schedule.sync_kind()) not in kinds:  # A-EDiT: by wall time
        kinds.append(str(schedule.sync_kind()))
    return kinds


Schedule = StepSchedule | TimeSchedule  # each answers kind, init_outer_due, outer_is_live


@dataclass(frozen=True)
class MethodPlan:
    plan: Plan
    cfg: Config  # normalised: what runs is what it says
    changed: tuple[tuple[str, Any, Any], ...]  # (key, configured value, value that took effect)
    schedule: Schedule

    def user_changes(self) -> tuple[tuple[str, Any, Any], ...]:
        """The ``changed`` entries whose configured value is not ``SyncConfig``'s default, i.e.
        what the user set (an override, a config file) and the method overrode: the only ones worth
        saying. The others (a default the method does not use) show only in ``config.json``."""
        defaults = SyncConfig()
        return tuple(c for c in self.changed if c[1] != get_field(defaults, c[0].removeprefix("sync.")))

    def asynchronous_at(self, k: int) -> bool:
        """Step ``k`` (before it runs) is in the asynchronous phase: each worker at its own pace
        (A-EDiT after its warmup); the loop then drives the workers apart (drivers.AsyncWorkers)."""
        return isinstance(self.schedule, TimeSchedule) and k >= self.schedule.warmup


def register(row: Method) -> None:
    """Adds ``row`` to ``METHODS``: a rule from outside the library, its one line (in a Python
    config file, a test, a user's module; before a config naming it is read). A rule class with
    hyperparameters declares ``owned_section`` and ``section_type``: ``sync.<owned_section>`` then
    reads as that dataclass on a command line, in a config file and in ``config.json``."""
    if not isinstance(row, Method):
        raise TypeError(f"register: expected a methods.Method row, got {row!r}")
    if row.name in LIBRARY_METHODS:
        raise ValueError(f"method {row.name!r} is a row of the library's method table ({', '.join(LIBRARY_METHODS)}); "
                         "register a rule of your own under a name of its own")
    # A registered row registered again replaces it (a config file read twice, a notebook cell run again).
    owner = rule_class(row.rule)
    if owner is not None and owner.section_type is not None:
        register_rule_section(owner.owned_section, owner.section_type)
    METHODS[row.name] = row


def unregister(name: str) -> None:
    """Takes a row ``register`` added out of the method table (and its rule's section, when no
    other row's rule owns it): for tests and notebooks that register a rule and go on."""
    row = METHODS.pop(name)
    owner = rule_class(row.rule)
    if owner is not None and owner.section_type is not None and all(
            rule_class(m.rule) is not owner for m in METHODS.values()):
        RULE_SECTIONS.pop(owner.owned_section, None)


def rule_class(factory: RuleFactory) -> type | None:
    """The ``SyncRule`` class whose ``build`` ``factory`` is (None for a wrapper's factory such as
    ``Timed.around(...)``, whose rule owns no section)."""
    owner = getattr(factory, "__self__", None)
    return owner if isinstance(owner, type) and issubclass(owner, SyncRule) else None


def section_owners() -> dict[str, type]:
    """sync section name -> the rule class that owns it, over the method table's rows."""
    owners = (rule_class(m.rule) for m in METHODS.values())
    return {c.owned_section: c for c in owners if c is not None and c.owned_section}


def method(name: str) -> Method:
    if name not in METHODS:
        raise KeyError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    return METHODS[name]


def normalise(cfg: Config) -> tuple[Config, tuple[tuple[str, Any, Any], ...]]:
    """``cfg`` with the sync fields its method fixes set as they take effect, and what changed."""
    m = method(cfg.sync.method)
    changed = tuple((f"sync.{k}", get_field(cfg.sync, k), v) for k, v in m.fixed.items() if get_field(cfg.sync, k) != v)
    if not changed:
        return cfg, ()
    return dataclasses.replace(cfg, sync=with_fields(cfg.sync, m.fixed)), changed


def plan_for(cfg: Config) -> MethodPlan:
    """The plan, normalised config and schedule of ``cfg`` (validated already): the method's rule
    built from the sync config (wrapped for compression), and the schedule its timing asks for."""
    cfg, changed = normalise(cfg)
    m, s = method(cfg.sync.method), cfg.sync
    rule = m.rule(s)
    if s.wire.kind != "none" and rule.keeps_outer:
        rule = Compressed.of(rule, s)
    penalty = Penalty.from_config(s) if m.penalty else Penalty.off()
    o = s.outer
    outer = rule.outer_spec(OuterSpec(o.optimizer, o.lr, o.momentum, o.nesterov, o.b2))
    plan = Plan(m.name, rule, rule.in_forward, penalty, outer)
    if rule.asynchronous:
        schedule = TimeSchedule(rule.keeps_outer, rule.in_forward, s.warmup_steps, s.time.tau, s.time.min_total_steps,
                                cfg.steps * cfg.mesh.replica)
    else:
        schedule = StepSchedule(rule.keeps_outer, rule.in_forward, s.warmup_steps, s.tau, fragments=s.fragments)
    return MethodPlan(plan, cfg, changed, schedule)


def sync_fields_for(name: str) -> dict:
    """The sync fields method ``name`` fixes (for presets)."""
    return dict(method(name).fixed)


# ----------------------------------------------------------------------------- config rules


def validate(cfg: Config) -> None:
    """The config's rules that ask the method table: a known ``sync.method`` and
    ``sync.outer.optimizer``. What each method's rule allows is the rule's (``rules.validate``)."""
    s = cfg.sync
    require(s.method in METHODS, "sync.method", f"expected one of {', '.join(METHODS)}; got {s.method!r}")
    require(s.outer.optimizer in OUTER_OPTIMIZERS, "sync.outer.optimizer",
            f"expected one of {', '.join(OUTER_OPTIMIZERS)}; got {s.outer.optimizer!r}")


def keeps_outer(name: str) -> bool:
    """Method ``name`` keeps θ̄ and an outer optimizer (its sync fields matter)."""
    return method(name).keeps_outer


__all__ = ["step_kinds", "METHODS", "Method", "Plan", "OuterSpec", "Penalty", "MethodPlan", "StepSchedule",
           "TimeSchedule", "SyncDecision", "Schedule", "STEP_KINDS", "SYNC_KINDS", "StepKind", "HSDP", "LOCAL",
           "OUTER_OPTIMIZERS", "plan_for", "normalise", "method", "sync_fields_for", "validate", "keeps_outer",
           "register", "unregister", "rule_class", "section_owners"]
