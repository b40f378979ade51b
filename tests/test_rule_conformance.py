"""One sync rule, three drivers (issue 56, items 3 and 5): the rule objects of the registry
(``rule.py``) run in the trainer's programs (``StepPrograms.sync_fn``: ``shard_map`` over the
(replica, shard) mesh, FSDP blocks), in the public API (``LocalSGD.sync`` / ``flush``: the workers
a ``vmap`` over ``replica``), built from one method name and the same sync fields
(``from_method``), and in the exchange's round (``elastic/outer_round.OuterRound``: the posts of
the workers, stacked on the host's CPU; rounds by step count). On the same posts (every worker's
params, θ̄, the outer momentum, CO2's pseudo gradients in flight) they give the NumPy reference's
θ̄, momentum and workers:

- diloco, post_local_sgd, edit (penalty: weights softmax(−g/T), per-unit clip; fresh detectors fed),
  through ``test_edit_sync.np_sync`` (Algorithm 2 written from EDIT.md);
- co2: the flush (θ̄ − η(μm + mean pending / Λ)) and, in the API, one round (the new pending is
  θ̄ − θ_i), written here from CO2.md;
- a lossy wire with error feedback (int8, topk2) on EDiT: trainer and API equal to each other,
  residuals included, and within the wire's error of the uncompressed reference; topk2 through the
  exchange too (packed posts, each poster's residual settled by the round's flags);
- a rule written in this file (the coordinate-wise trimmed mean of the pseudo gradients), with a
  config section of its own (``sync.trimmed_mean.trim``), registered with one line
  (``methods.register``), runs in all three drivers and equals NumPy's median at trim 1/3 of 3
  workers and the mean at 0; its section reads like a field (command line, ``config.json``) and is
  refused for another method, out of range, or where the rule is not registered.

CO2 is the one rule the exchange does not run (its pending pseudo gradients live on the workers
between rounds; ``admission`` refuses it). Two workers, tiny shapes: a few seconds per case.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from edit_jax.elastic import packed as PK
from edit_jax.elastic.outer_round import OuterRound
from edit_jax.elastic.rounds import Post
from edit_jax.localsgd import api, methods
from edit_jax.localsgd.codec import Codec
from edit_jax.localsgd.quantize import flatten_unit
from edit_jax.localsgd.outer import sgd_trace, with_sgd_trace
from edit_jax.localsgd.programs import StepPrograms
from edit_jax.localsgd.sharding import REPLICA, gather_workers
from edit_jax.localsgd.sync import local_blocks, reset_nonfinite_workers, sync_metrics, unit_sq_sums, \
    with_replica_dim, as_varying
from edit_jax.localsgd.whole_model import WholeModelSync
from edit_jax.runtime.mesh import make_mesh
from edit_jax.config import CO2Config, ConfigError, OuterConfig, PenaltyConfig, WireConfig, from_dict, \
    register_rule_section, require, to_dict
from edit_jax.validate import load_config
from tests.stages import one_stage
from tests.test_api import _close
from tests.test_edit_sync import TINY, Ref, np_sync

N = 2
BASE = ["data.seq_len=16", "steps=20", "model.n_layers=2", "sync.penalty.anomaly_warmup=3",
        "sync.warmup_steps=0"]
# Each method with non-default constants, so that each one matters.
FIELDS = {
    "diloco": dict(outer=OuterConfig(lr=0.6, momentum=0.8)),
    "post_local_sgd": {},
    "edit": dict(outer=OuterConfig(lr=0.7, momentum=0.8),
                 penalty=PenaltyConfig(anomaly_warmup=3, temperature=0.05, clip_threshold=0.5)),
    "co2": dict(outer=OuterConfig(lr=0.5, momentum=0.7), co2=CO2Config(gap_penalty=2.0)),
}


def _trainer(method: str, shard: int, n: int = N, **fields) -> StepPrograms:
    flat = {f"{section}.{k}": v for section in [k for k, v in fields.items() if dataclasses.is_dataclass(v)]
            for k, v in dataclasses.asdict(fields.pop(section)).items()}  # a section's fields, as keys
    cfg = load_config(TINY, BASE + [f"mesh.replica={n}", f"mesh.shard={shard}", f"batch_size={max(4, n * shard)}",
                                     f"sync.method={method}"]
                      + [f"sync.{k}={str(v).lower() if isinstance(v, bool) else v}"
                         for k, v in {**fields, **flat}.items()])
    return StepPrograms.for_config(cfg, make_mesh(cfg.mesh, jax.devices()[:n * shard]))


def _posts(m: StepPrograms, seed: int = 0):
    """The trainer's state with every worker moved off θ̄ by its own amount (worker i 2^i as far),
    a non-zero outer momentum and, for CO2, pseudo gradients in flight."""
    rng = np.random.default_rng(seed)
    state = jax.device_get(m.init_state(0))
    theta = state.outer.params
    away = lambda scale: jax.tree.map(
        lambda t: np.stack([t - s * 0.05 * rng.standard_normal(t.shape) for s in scale]).astype(np.float32), theta)
    outer = state.outer.with_trace(jax.tree.map(lambda t: (0.02 * rng.standard_normal(t.shape)).astype(np.float32),
                                                theta))
    if outer.extra is not None and "pending" in outer.extra:
        outer = outer.replace(extra={**outer.extra, "pending": away([0.5, 1.5])})
    return state.replace(params=away([2.0 ** i for i in range(m.cfg.mesh.replica)]), outer=outer)


def _api(method: str, m: StepPrograms, posts, rule=None) -> tuple[api.LocalSGD, api.LocalSGDState]:
    """``LocalSGD`` with ``from_method(method, same fields)`` on the same devices, holding the posts."""
    rule = rule or api.from_method(method, **FIELDS.get(method, {}))
    n = m.cfg.mesh.replica
    trainer = api.LocalSGD(rule, jax.make_mesh((n,), (REPLICA,), devices=jax.devices()[:n]), tau=1,
                           loss_fn=lambda *a: None, optimizer=optax.adam(0.0), donate=False)
    theta = posts.outer.params
    state = trainer.init(theta)
    if rule.layerwise:
        outer_opt = posts.outer.opt_state
    else:  # the whole pytree is one unit: its momentum is the units' trace as one tree
        outer_opt = with_sgd_trace(state.outer_opt_state, posts.outer.trace)
    extra = posts.outer.extra
    if extra is not None and not rule.layerwise:
        extra = {k: {"root": v, "layers": {}} for k, v in extra.items()}
    return trainer, state._replace(params=posts.params, outer_params=theta, outer_opt_state=outer_opt, extra=extra)


def _exchange(m: StepPrograms, posts):
    """The exchange's round on the same posts: each worker posts Δ_i = θ̄ − θ_i (float32, or packed
    by ``sync.wire.kind`` from a zero residual); returns (the round state, its figures, each
    poster's settled residual per unit, or None)."""
    codec = Codec.from_sync(m.cfg.sync)
    rnd = OuterRound(m.plan, codec)
    layerwise = rnd.layerwise
    theta = posts.outer.params
    units = 1 + m.cfg.model.n_layers if layerwise else 1
    n = m.cfg.mesh.replica
    start = rnd.initial(theta, n, units, max(2, m.plan.penalty.warmup))
    trace = posts.outer.trace
    start.outer_opt = posts.outer.opt_state if layerwise else with_sgd_trace(start.outer_opt, trace)
    if layerwise:  # the trainer's warm detectors, per worker and unit
        start.detectors = jax.tree.map(np.asarray, posts.outer.detector)
    if start.extra is not None:  # CO2: the round state keeps the mean of the workers' pending
        start.extra = {"pending": jax.tree.map(lambda x: np.asarray(x, np.float32).mean(0),
                                               posts.outer.extra["pending"])}
    sent, pending = [], []
    for w in range(n):
        delta = jax.tree.map(lambda t, x: (t - x[w]).astype(np.float32),  # noqa: B023 - called at once
                             theta, posts.params)
        if codec.kind == "none":
            sent.append(Post(w, 1, jax.tree.leaves(delta), m.cfg.sync.tau, 0, 0.0, ""))
            continue
        rows, norms, new_e = jax.device_get(PK.encode_post(delta, PK.zero_residual(theta, layerwise, codec), codec,
                                                           layerwise))
        sent.append(Post(w, 1, [np.asarray(r) for r in rows], m.cfg.sync.tau, 0, 0.0, "", wire=codec.name,
                         norms=np.asarray(norms)))
        pending.append(new_e)
    got, figures = rnd.apply(start, sent)
    settled = [PK.settle_residual(pending[w], np.asarray(figures["unit_flagged"])[:, w], layerwise)
               for w in range(len(pending))] or None
    return got, figures, settled


def _ref(m: StepPrograms) -> Ref:
    s = m.cfg.sync  # normalised: what the method fixes, as it took effect
    p = s.penalty
    return Ref(anomaly=p.anomaly, alpha=p.anomaly_alpha, k=p.anomaly_warmup, delta=p.anomaly_threshold,
               weighting=p.weighting, temperature=p.temperature, clip=p.clip, phi=p.clip_threshold,
               lr=s.outer.lr, mu=s.outer.momentum)


# ============================================================================= the paper's rules


@pytest.mark.parametrize("method", ["diloco", "post_local_sgd", "edit"])
def test_each_rule_gives_the_reference_in_the_trainer_and_the_api(method):
    if method == "post_local_sgd":  # DiLoCo's sync at lr 1, momentum 0: once per CI run
        one_stage("3.12", "Post Local SGD in both drivers", 5)
    m = _trainer(method, shard=2, **FIELDS[method])
    posts = _posts(m)
    det = tuple(np.asarray(x) for x in (posts.outer.detector.mean, posts.outer.detector.m2,
                                         posts.outer.detector.count, posts.outer.detector.window))
    theta, trace, _, workers, info = np_sync(posts.outer.params, posts.outer.trace, posts.params, det, _ref(m))
    if method == "edit":  # the penalty matters here: unequal weights, and a unit clipped
        assert np.ptp(info["w"]) > 0.1 and info["clip"].min() < 1.0, info

    synced, figures = jax.device_get(m.sync_fn()(jax.device_put(posts, m.state_shardings)))
    _close(synced.outer.params, theta, f"{method} trainer θ̄")
    _close(synced.outer.trace, trace, f"{method} trainer momentum")
    _close(synced.params, workers, f"{method} trainer workers")

    trainer, state = _api(method, m, posts)
    assert trainer.rule.sync == m.plan.rule  # the same rule object, built from the same fields
    new, figures = jax.device_get(trainer.sync(state))
    _close(new.outer_params, theta, f"{method} API θ̄")
    _close(sgd_trace(new.outer_opt_state) if not trainer.rule.layerwise else
           {u: sgd_trace(new.outer_opt_state[u]) for u in ("root", "layers")}, trace, f"{method} API momentum")
    _close(new.params, workers, f"{method} API workers")
    if method == "edit":  # per unit, as the trainer's
        np.testing.assert_allclose(np.asarray(figures["unit_weight"]), info["w"], atol=1e-5)
    assert not np.asarray(figures["inner_reset"]).any() and not bool(figures["sync_refused"])

    got, figures, _ = _exchange(m, posts)
    _close(got.theta, theta, f"{method} exchange θ̄")
    _close(sgd_trace(got.outer_opt) if method != "edit"
           else {u: sgd_trace(got.outer_opt[u]) for u in ("root", "layers")},
           trace, f"{method} exchange momentum")
    if method == "edit":
        np.testing.assert_allclose(np.asarray(figures["unit_weight"]), info["w"], atol=1e-5)


def test_the_named_constructors_are_the_method_table_rows():
    assert api.diloco(0.6, 0.8) == api.from_method("diloco", outer=OuterConfig(lr=0.6, momentum=0.8))
    assert api.post_local_sgd() == api.from_method("post_local_sgd")
    assert api.co2(0.5, 0.7, gap_penalty=2.0) == api.from_method("co2", **FIELDS["co2"])
    assert api.edit().sync == api.from_method("edit").sync


def test_co2_flush_and_round_give_the_reference_in_all_three_drivers():
    """CO2.md: the flush lands the last round's all-reduce, θ̄' = θ̄ − η(μm + mean_i pending_i / Λ)
    (heavy ball, no Nesterov); a round does the same and then sends θ̄ − θ_i (the new pending). The
    exchange's round keeps the pending's mean (its workers change from round to round): the same θ̄,
    and the mean of the new pending."""
    f = FIELDS["co2"]
    m = _trainer("co2", shard=2, **f)
    posts = _posts(m)
    lr, mu, lam = f["outer"].lr, f["outer"].momentum, f["co2"].gap_penalty
    f64 = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float64), t)
    theta, m0, pending, workers = (f64(x) for x in (posts.outer.params, posts.outer.trace, posts.outer.extra["pending"],
                                                    posts.params))
    trace = jax.tree.map(lambda b, p: mu * b + p.mean(0) / lam, m0, pending)
    want = jax.tree.map(lambda t, b: t - lr * b, theta, trace)

    synced, _ = jax.device_get(m.sync_fn()(jax.device_put(posts, m.state_shardings)))
    _close(synced.outer.params, want, "co2 trainer θ̄")
    _close(synced.outer.trace, trace, "co2 trainer momentum")
    _close(synced.outer.extra["pending"], pending, "co2 trainer pending (kept by a flush)")

    trainer, state = _api("co2", m, posts)
    flushed, _ = jax.device_get(trainer.flush(state))
    _close(flushed.outer_params, want, "co2 API θ̄ (flush)")
    _close(flushed.params, jax.tree.map(lambda w: np.broadcast_to(w, (N,) + w.shape), want), "co2 API workers")
    rounded, figures = jax.device_get(trainer.sync(state))
    _close(rounded.outer_params, want, "co2 API θ̄ (round)")
    _close(rounded.extra["pending"]["root"], jax.tree.map(lambda t, w: t[None] - w, theta, workers),
           "co2 API new pending θ̄ − θ_i")
    np.testing.assert_allclose(np.asarray(figures["pseudo_grad_norm"]),  # the norms of what was in flight
                               [np.sqrt(sum(np.sum(x[i] ** 2) for x in jax.tree.leaves(pending))) for i in range(N)],
                               rtol=1e-5)

    got, _, _ = _exchange(m, posts)
    _close(got.theta, want, "co2 exchange θ̄ (round)")
    _close(got.extra["pending"], jax.tree.map(lambda t, w: t - w.mean(0), theta, workers),
           "co2 exchange pending: the mean of θ̄ − θ_i")
    rnd = OuterRound(m.plan)
    last = rnd.flushed(got)  # what the run's model is after that round: its pending applied too
    trace2 = jax.tree.map(lambda b, p: mu * b + p / lam, trace, f64(got.extra["pending"]))
    _close(last.theta, jax.tree.map(lambda t, b: t - lr * b, f64(got.theta), trace2), "co2 exchange flush")
    assert last.extra is got.extra and last.round == got.round  # the round state itself is unchanged


@pytest.mark.parametrize("wire", ["int8", "topk2"])
def test_a_lossy_wire_with_error_feedback_is_the_same_in_both_drivers(wire):
    """The compressed wrapper around EDiT's rule: one shard per worker, so both drivers cut the
    same flat units into the same chunks; θ̄, momentum and every worker's residual agree."""
    one_stage("default" if wire == "int8" else "3.12", f"EDiT on {wire} in both drivers", 11,
              other=f"the same on {'topk2' if wire == 'int8' else 'int8'}")
    fields = dict(FIELDS["edit"], wire=WireConfig(kind=wire, error_feedback=True))
    m = _trainer("edit", shard=1, **fields)
    posts = _posts(m)
    synced, _ = jax.device_get(m.sync_fn()(jax.device_put(posts, m.state_shardings)))
    trainer, state = _api("edit", m, posts, rule=api.from_method("edit", **fields))
    assert trainer.rule.sync == m.plan.rule and trainer.rule.sync.codec.kind == wire
    new, _ = jax.device_get(trainer.sync(state))
    _close(new.outer_params, synced.outer.params, f"{wire}: θ̄ API vs trainer", rtol=1e-5, atol=1e-6)
    _close(new.extra["residual"], synced.outer.extra["residual"], f"{wire}: residual API vs trainer",
           rtol=1e-5, atol=1e-6)
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(new.extra["residual"])) > 0  # the wire lost some
    # Within the wire's error of the float32 sync.
    plain, _ = jax.device_get(_api("edit", m, posts)[0].sync(_api("edit", m, posts)[1]))
    err = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(new.outer_params),
                                                      jax.tree.leaves(plain.outer_params), strict=True)]
    moved = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(plain.outer_params),
                                                        jax.tree.leaves(posts.outer.params), strict=True)]
    assert max(err) < max(moved), (err, moved)
    if wire == "topk2":  # the exchange's packed posts: the posters encode, the round decodes
        got, _, settled = _exchange(m, posts)
        _close(got.theta, synced.outer.params, "topk2: θ̄ exchange vs trainer", rtol=1e-5, atol=1e-6)
        res = synced.outer.extra["residual"]
        for w in range(N):
            flat = [np.asarray(flatten_unit(jax.tree.map(lambda x: x[w], res["root"]),  # noqa: B023 - called at once
                                            m.plan.rule.codec.chunk)[0])]
            flat.append(np.stack([
                np.asarray(flatten_unit(jax.tree.map(lambda x: x[w, i], res["layers"]),  # noqa: B023 - called at once
                                        m.plan.rule.codec.chunk)[0])
                for i in range(m.cfg.model.n_layers)]))
            _close(settled[w], flat, f"topk2: worker {w}'s residual, poster vs trainer", rtol=1e-5, atol=1e-6)


def test_the_api_refuses_what_one_program_cannot_run():
    with pytest.raises(ValueError, match="one process per worker"):
        api.from_method("a_edit")
    with pytest.raises(ValueError, match="every step"):
        api.from_method("baseline")
    with pytest.raises(ValueError, match="sync.fragments"):
        api.from_method("edit", fragments=2)
    with pytest.raises(ValueError, match="sync.co2.gap_penalty"):
        api.from_method("diloco", co2_gap_penalty=3.0)  # CO2's own field on another method
    with pytest.raises(ValueError, match="unknown sync field"):
        api.from_method("edit", outer_lrr=0.1)
    with pytest.raises(ValueError, match="sync.wire.error_feedback"):
        api.compressed(api.diloco(), "topk2", error_feedback=False)
    with pytest.raises(ValueError, match="wire"):
        api.compressed(api.diloco(), "topk3")


# ============================================================================= a rule of one's own


@dataclasses.dataclass
class TrimmedMeanConfig:
    """The rule's own hyperparameters: ``sync.trimmed_mean.trim`` on a command line."""

    trim: float = 0.0  # the fraction of the workers dropped at each end, per coordinate (0: the mean)


class TrimmedMeanSync(WholeModelSync):
    """θ̄ takes the outer step on the coordinate-wise trimmed mean of the workers' pseudo gradients:
    the ⌊trim·N⌋ smallest and largest dropped (robust to a worker gone astray; trim 1/3 of 3
    workers is the median). Written against the protocol only (``after_step`` and ``flush``), with a
    config section of its own."""

    name = "trimmed_mean"
    owned_section, section_type = "trimmed_mean", TrimmedMeanConfig

    def __init__(self, trim: float = 0.0):
        self.trim = float(trim)

    @classmethod
    def build(cls, sync):
        return cls(sync.trimmed_mean.trim)

    @staticmethod
    def validate_fields(s):
        require(0 <= s.trimmed_mean.trim < 0.5, "sync.trimmed_mean.trim",
                f"must be in [0, 0.5) (a fraction dropped at each end), got {s.trimmed_mean.trim}")

    def flush(self, params, outer, spec, residual=None):
        n = spec.n_workers
        cut = int(self.trim * n)
        delta = jax.tree.map(lambda t, x: t - x.astype(jnp.float32), outer.params, local_blocks(params))
        kept = jax.tree.map(lambda d: jnp.sort(gather_workers(d), axis=0)[cut:n - cut].mean(0), delta)
        new_outer, new_opt = {}, {}
        for u, update in (("root", spec.opt.update), ("layers", jax.vmap(spec.opt.update))):
            if not jax.tree.leaves(kept[u]):  # the API's whole-model view: any pytree is the root
                new_outer[u], new_opt[u] = outer.params[u], outer.opt_state[u]
                continue
            step, new_opt[u] = update(kept[u], outer.opt_state[u], outer.params[u])
            new_outer[u] = optax.apply_updates(outer.params[u], step)
        sq = unit_sq_sums(delta)
        g = jnp.sqrt(jax.lax.psum(sq, spec.reduction.norm_axes) if spec.reduction.norm_axes else sq)
        g_all = gather_workers(g, axis=1)  # [U, N], identical on every worker
        unit = {"pseudo_grad_norm": g_all, "weight": jnp.full_like(g_all, 1.0 / n),
                "flagged": jnp.zeros(g_all.shape, bool), "clip_factor": jnp.ones(g_all.shape[:1]),
                "update_norm": jnp.zeros(g_all.shape[:1])}
        new_params = jax.tree.map(lambda o, p: o.astype(p.dtype), with_replica_dim(as_varying(new_outer)), params)
        return new_params, outer.replace(params=new_outer, opt_state=new_opt, syncs=outer.syncs + 1), \
            sync_metrics(unit), residual

    def after_step(self, params, outer, opt_state, spec, shares=None, span=None, residual=None):
        params, outer, metrics, residual = self.flush(params, outer, spec, residual)
        opt_state, metrics["inner_reset"] = reset_nonfinite_workers(opt_state, metrics, spec.inner_opt_specs,
                                                                    spec.reduction.norm_axes)
        return params, outer, opt_state, metrics, residual


@pytest.fixture
def trimmed_mean_registered():
    # The one line a user writes (in a Python config file, a module of theirs):
    methods.register(methods.Method("trimmed_mean", "the trimmed mean pseudo gradient", rule=TrimmedMeanSync.build))
    yield
    methods.unregister("trimmed_mean")


def test_a_rule_written_here_registers_with_one_line_and_runs_in_all_three_drivers(trimmed_mean_registered):
    # 3 workers, trim 0.34: the median, which is not the mean
    outer = OuterConfig(lr=0.6, momentum=0.8)
    m = _trainer("trimmed_mean", shard=2, n=3, outer=outer, trimmed_mean=TrimmedMeanConfig(trim=0.34))
    posts = _posts(m)
    assert m.plan.rule == TrimmedMeanSync(0.34) and m.cfg.sync.trimmed_mean.trim == 0.34
    f64 = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float64), t)
    theta, trace0, workers = f64(posts.outer.params), f64(posts.outer.trace), f64(posts.params)
    med = jax.tree.map(lambda t, w: np.median(t[None] - w, axis=0), theta, workers)
    trace = jax.tree.map(lambda b, d: 0.8 * b + d, trace0, med)  # Nesterov, as DiLoCo's outer step
    want = jax.tree.map(lambda t, d, b: t - 0.6 * (d + 0.8 * b), theta, med, trace)
    mean = jax.tree.map(lambda t, w: np.mean(t[None] - w, axis=0), theta, workers)
    assert min(float(np.abs(a - b).max())
               for a, b in zip(jax.tree.leaves(med), jax.tree.leaves(mean), strict=True)) > 1e-3

    synced, _ = jax.device_get(m.sync_fn()(jax.device_put(posts, m.state_shardings)))
    _close(synced.outer.params, want, "trimmed mean trainer θ̄")
    rule = api.from_method("trimmed_mean", outer=outer, trimmed_mean=TrimmedMeanConfig(trim=0.34))
    trainer, state = _api("trimmed_mean", m, posts, rule=rule)
    new, figures = jax.device_get(trainer.sync(state))
    _close(new.outer_params, want, "trimmed mean API θ̄")
    assert np.asarray(figures["unit_pseudo_grad_norm"]).shape == (1, 3)  # the API's one unit
    got, figures, _ = _exchange(m, posts)
    _close(got.theta, want, "trimmed mean exchange θ̄")
    assert np.asarray(figures["unit_pseudo_grad_norm"]).shape == (1, 3)  # the exchange's one unit too
    # trim 0 is the mean: the hyperparameter reaches the sync
    m0 = _trainer("trimmed_mean", shard=2, n=3, outer=outer)
    synced0, _ = jax.device_get(m0.sync_fn()(jax.device_put(posts, m0.state_shardings)))
    trace = jax.tree.map(lambda b, d: 0.8 * b + d, trace0, mean)
    _close(synced0.outer.params, jax.tree.map(lambda t, d, b: t - 0.6 * (d + 0.8 * b), theta, mean, trace),
           "trimmed mean at trim 0 (the mean) trainer θ̄")


def test_a_registered_rule_section_reads_like_a_field_and_is_refused_where_it_does_not_belong(trimmed_mean_registered):
    base = BASE + ["mesh.replica=2", "mesh.shard=1", "batch_size=4"]
    cfg = load_config(TINY, base + ["sync.method=trimmed_mean", "sync.trimmed_mean.trim=0.25"])
    assert cfg.sync.trimmed_mean == TrimmedMeanConfig(0.25)
    assert to_dict(cfg)["sync"]["trimmed_mean"] == {"trim": 0.25}  # config.json: sync.trimmed_mean, as a field's
    assert from_dict(to_dict(cfg)) == cfg
    with pytest.raises(ConfigError, match="'sync.trimmed_mean.trim': is used by method trimmed_mean only"):
        load_config(TINY, base + ["sync.method=diloco", "sync.trimmed_mean.trim=0.25"])
    with pytest.raises(ConfigError, match=r"'sync.trimmed_mean.trim': must be in \[0, 0.5\)"):
        load_config(TINY, base + ["sync.method=trimmed_mean", "sync.trimmed_mean.trim=0.5"])
    with pytest.raises(ConfigError, match="unknown config key 'sync.trimmed_mean.trimm'; did you mean"):
        load_config(TINY, base + ["sync.method=trimmed_mean", "sync.trimmed_mean.trimm=0.1"])
    with pytest.raises(ValueError, match="sync.trimmed_mean: expected a TrimmedMeanConfig"):
        api.from_method("trimmed_mean", trimmed_mean={"trim": 0.1})
    with pytest.raises(ValueError, match="a row of the library's method table"):
        methods.register(methods.Method("diloco", "another diloco", rule=TrimmedMeanSync.build))
    with pytest.raises(ConfigError, match="sync.trimmed_mean is already registered as .*TrimmedMeanConfig"):
        register_rule_section("trimmed_mean", OuterConfig)
    saved = to_dict(cfg)
    methods.unregister("trimmed_mean")
    try:  # a run dir's config.json read where the rule is not registered: one line, naming the key
        with pytest.raises(ConfigError, match="unknown config key 'sync.trimmed_mean': .*registers its section"):
            from_dict(saved)
    finally:
        methods.register(methods.Method("trimmed_mean", "the trimmed mean pseudo gradient",
                                        rule=TrimmedMeanSync.build))
