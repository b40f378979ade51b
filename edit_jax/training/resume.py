"""Where a run starts and what it may keep: restore with verification and fallback, and the check
before every save. Both hold in every mode (one process, or one per worker).

- ``restore_verified``: the newest checkpoint that reads and verifies (or ``--restore-step``'s).
  Damaged ones newer than it are reported and moved to ``RUN_DIR/checkpoints.bad/``; with
  ``restore_step`` newer good ones go to ``checkpoints.aside/``; nothing is ever deleted. A
  checkpoint of another ``mesh.replica`` is an elastic restart; one of the first state format
  is upgraded.
- ``check_before_save``: a state with non-finite values is never saved (``DivergedError``),
  except that a checkpoint due while only some Local-SGD workers are non-finite is skipped
  (their next sync rolls them back).

With several processes every process runs the same restore (the arrays are global, their
checksums too, so every process reaches the same verdict); only process 0 moves directories,
the others wait for it (``barrier``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax

from edit_jax.config import Config, ConfigError
from edit_jax.localsgd.codec import Codec
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.localsgd.state import TrainState, state_shapes_of_format, with_residual_dtype
from edit_jax.rundir.checkpoint import Checkpointer, CheckpointError, UnreadableCheckpointError, debug_enabled
from edit_jax.rundir.integrity import finite_report, nonfinite_parts


class DivergedError(RuntimeError):
    """Training produced non-finite values; nothing non-finite was saved (the CLI exits with 3)."""


def restore(ckpt: Checkpointer, step: int, cfg: Config, programs: StepPrograms, meta: dict | None = None):
    """Restores checkpoint ``step`` (checked against ``cfg`` first): (state, data state). ``meta``:
    its metadata, if the caller read it already."""
    meta = ckpt.read_meta(step) if meta is None else meta
    ckpt.check_compatible(meta, cfg, step)
    layout = programs.layout
    fmt = meta.get("state_format", 1)  # older formats are restored as written, then upgraded
    old_n = meta["config"]["mesh"]["replica"]
    # The residual as it was written (its dtype may change on resume: cast after the checksums)
    saved_ef, ef = saved_codec(meta).residual_dtype, programs.rule.codec.residual_dtype
    try:
        if old_n == cfg.mesh.replica:
            target = with_residual_dtype(layout.abstract_state_of_format(fmt), saved_ef)
            state, data_state = ckpt.restore(step, target, meta)
            state = with_residual_dtype(layout.upgrade(state), ef)
            state = jax.device_put(state, layout.state_shardings)
        else:
            old_cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, replica=old_n))
            host, data_state = ckpt.restore_host(step, state_shapes_of_format(old_cfg, fmt), meta)
            state = layout.elastic_state(with_residual_dtype(layout.upgrade(host), ef), old_n)
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {os.path.join(ckpt.directory, str(step))}: {e}") from e
    return state, data_state


def saved_codec(meta: dict) -> Codec:
    """The wire a checkpoint was written with (its config's)."""
    return Codec.from_sync(meta["config"].get("sync") or {})


def restore_verified(ckpt: Checkpointer, cfg: Config, programs: StepPrograms, say: Callable[[str], None],
                     restore_step: int | None, *, lead: bool = True, barrier: Callable[[], None] = lambda: None):
    """Restores the newest checkpoint that reads and verifies (or ``restore_step``): (state, data
    state, step), all None when there is none. If none verifies, nothing is moved and
    ``CheckpointError`` lists them all. An incompatible config is not a damaged checkpoint: it
    raises at once. ``lead``: this process moves directories (the others call ``barrier`` too)."""
    steps = sorted(ckpt.all_steps(), reverse=True)
    if restore_step is not None and restore_step not in steps:
        raise CheckpointError(f"--restore-step {restore_step}: no checkpoint {restore_step} in {ckpt.directory} "
                              f"(have {sorted(steps) or 'none'})")
    if restore_step is None:
        steps = _skip_unhealthy(ckpt, steps, say, lead, barrier)
    candidates = [restore_step] if restore_step is not None else steps
    bad, errors = [], []
    for step in candidates:
        try:
            meta = ckpt.read_meta(step)
            old_n = meta["config"]["mesh"]["replica"]
            state, data_state = restore(ckpt, step, cfg, programs, meta)
        except UnreadableCheckpointError as e:
            bad.append(step)
            errors.append(e)
            continue
        moves = [(b, "checkpoints.bad", err) for b, err in zip(bad, errors, strict=True)]
        moves += [(newer, "checkpoints.aside", None) for newer in steps if newer > step and newer not in bad]
        for victim, where, err in moves:
            dest = ckpt.set_aside(victim, where, move=lead)
            if err is not None:
                say(_fallback_line(ckpt, victim, err, dest, step))
            else:
                say(f"edit-jax: --restore-step {step}: moved newer checkpoint {victim} to {dest}")
        if moves:
            barrier()  # every process sees the moved directories before it reads the checkpoint list again
            ckpt.reload()
        # The rule's wire against the checkpoint's (check_compatible refused a change of the state):
        change = programs.rule.codec.resume_change(saved_codec(meta), residual_kept=old_n == cfg.mesh.replica)
        if change and programs.rule.keeps_outer:  # (a rule without outer state sends no wire: nothing changed)
            say(f"edit-jax: checkpoint {step}: {change}")
        if old_n != cfg.mesh.replica:
            say(f"edit-jax: elastic restart: checkpoint {step} has mesh.replica={old_n}, this run {cfg.mesh.replica}; "
                "every worker restarts from the outer params, inner optimizer moments are the old workers' mean")
        return state, data_state, step
    way_out = _spike_way_out(ckpt) if restore_step is None else ""
    if len(errors) == 1:
        if not way_out:
            raise errors[0]
        raise UnreadableCheckpointError(f"{errors[0]}{way_out}", why=errors[0].why,
                                        details=errors[0].details) from errors[0]
    if errors:
        raise CheckpointError(f"no checkpoint in {ckpt.directory} verifies (tried {', '.join(map(str, bad))}); "
                              f"all were left untouched. Move them away to start over.{way_out}")
    return None, None, None


def _spike_way_out(ckpt: Checkpointer) -> str:
    """When no checkpoint in ``checkpoints/`` verifies: the ones a loss spike set aside in
    ``checkpoints.spike/`` are the way on (a rollback's target that is damaged, and nothing older,
    would otherwise exit 2 on every rerun). "" when there are none."""
    spike_dir = os.path.join(os.path.dirname(ckpt.directory), "checkpoints.spike")
    held = sorted((int(d) for d in (os.listdir(spike_dir) if os.path.isdir(spike_dir) else []) if d.isdigit()),
                  reverse=True)
    if not held:
        return ""
    newest = held[0]
    return (f" {spike_dir} holds checkpoint(s) {', '.join(map(str, held))}, written during a loss spike: to go on "
            f"from {newest}, move {os.path.join(spike_dir, str(newest))} back into {ckpt.directory} and rerun with "
            f"--restore-step {newest} (perhaps with a lower optim.lr)")


def _fallback_line(ckpt: Checkpointer, victim: int, err: UnreadableCheckpointError, dest: str, step: int) -> str:
    """One short line for a damaged checkpoint set aside: which one (its path in the run dir, which
    names its step), what is wrong in a few words (the array and TensorStore's reason, or the
    checksums), where it went and the step the run falls back to. ``--debug`` adds the libraries'
    whole report (orbax's error with the TensorStore spec) as a second line."""
    run_dir = os.path.dirname(ckpt.directory)
    why = err.why or str(err).split(". It was left untouched")[0]
    line = (f"edit-jax: {os.path.relpath(os.path.join(ckpt.directory, str(victim)), run_dir)} is damaged: {why}; "
            f"moved to {os.path.relpath(dest, run_dir)}, falling back to step {step}")
    if err.details and debug_enabled():
        line += f"\nedit-jax: (--debug) checkpoint {victim}: {err.details}"
    return line


def _skip_unhealthy(ckpt: Checkpointer, steps: list[int], say, lead: bool, barrier) -> list[int]:
    """``steps`` (newest first) without the checkpoints written during a loss spike that are newer
    than the newest healthy one (a run stopped mid-spike); those are moved to
    ``RUN_DIR/checkpoints.spike/``, never deleted. With no healthy one, nothing moves."""
    # An unreadable checkpoint (None) counts as healthy here: the restore reports it and falls back.
    newest_healthy = next((step for step in steps if ckpt.healthy(step) is not False), None)
    if newest_healthy is None:
        return steps
    spiked = [step for step in steps if step > newest_healthy]
    for step in spiked:
        dest = ckpt.set_aside(step, "checkpoints.spike", move=lead)
        say(f"edit-jax: checkpoint {step} was written during a loss spike; moved it to {dest} (not deleted), "
            f"resuming from {newest_healthy}")
    if spiked:
        barrier()
        ckpt.reload()
    return [step for step in steps if step not in spiked]


def set_aside_untrusted(ckpt: Checkpointer, trusted_through: int | None, say, lead: bool, barrier) -> list[int]:
    """Moves the checkpoints newer than ``trusted_through`` (no healthy training record vouches for
    them: written during a spike or just before one) to ``RUN_DIR/checkpoints.spike/``, never
    deleted; returns their steps."""
    moved = [step for step in ckpt.all_steps() if trusted_through is None or step > trusted_through]
    dests = [ckpt.set_aside(step, "checkpoints.spike", move=lead) for step in moved]
    if moved:
        say(f"edit-jax: checkpoint(s) {', '.join(map(str, moved))} written after the last healthy training loss "
            f"moved to {os.path.dirname(dests[0])} (not deleted)")
        barrier()
        ckpt.reload()
    return moved


def check_before_save(state: TrainState, step: int, keeps_outer: bool, final: bool, last_good) -> bool:
    """True if ``state`` may be saved. A state with non-finite values is never saved: the run stops
    (``DivergedError``) unless only some workers are non-finite in a Local SGD method with a finite
    outer state, mid-run (``final`` False): their next sync rolls them back to θ̄ and resets their
    inner state, so this checkpoint is skipped (False) and the next one tried."""
    report = finite_report(state)
    bad = nonfinite_parts(report)
    if not bad:
        return True
    recoverable = (keeps_outer and bool(report["outer"]) and bool(report["opt_state (shared)"])
                   and bool((report["params"] & report["opt_state"]).any()))
    if recoverable and not final:
        return False
    raise DivergedError(f"non-finite values at step {step} in {'; '.join(bad)}: not saved. "
                        f"Last good checkpoint: {last_good or 'none'} (kept). Lower optim.lr or check the data.")


__all__ = ["DivergedError", "restore", "restore_verified", "set_aside_untrusted", "check_before_save"]
