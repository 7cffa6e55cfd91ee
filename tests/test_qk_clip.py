"""QK-clip (train.qk_clip, jmoe/model/qk_clip.py): the heads' largest logits against the [S, S]
scores; a clipped head's largest logit brought to tau and the others untouched, in grouped-query
attention and in MLA (its parts scaled as MuonClip says); sharded and pipelined runs equal to one
device; exact resume; the configs it cannot work with."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmoe.config import ConfigError
from jmoe.model.attention import Attention
from jmoe.model.mla import MLAttention
from jmoe.model.qk_clip import clip_factors
from jmoe.ops.max_logit import max_logit
from jmoe.train.loop import train
from helpers import tiny_config

SEGMENTS = jnp.asarray([[1] * 10 + [2] * 9 + [3] * 3 + [0] * 2, [1] * 24], jnp.int32)


def direct_max_logit(q_BSHA, k_BSGA, scale, window=0, segments_BS=None):
  """The largest logit of each head over the whole [S, S] scores, in float64 numpy."""
  q, k = np.asarray(q_BSHA, np.float64), np.asarray(k_BSGA, np.float64)
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  logits = np.einsum("bshd,bthd->bhst", q, k) * scale
  pos = np.arange(q.shape[1])
  allowed = (pos[None, :] <= pos[:, None])[None, None]
  if window:
    allowed = allowed & (pos[:, None] - pos[None, :] < window)[None, None]
  if segments_BS is not None:
    seg = np.asarray(segments_BS)
    allowed = allowed & ((seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0))[:, None]
  return np.where(allowed, logits, -np.inf).max(axis=(0, 2, 3))


@pytest.mark.parametrize("window, packed, block", [(0, False, 24), (5, False, 8), (0, True, 8),
                                                   (5, True, 6)])
def test_max_logit_equals_the_whole_scores(window, packed, block):
  keys = jax.random.split(jax.random.key(window + packed), 2)
  q, k = jax.random.normal(keys[0], (2, 24, 4, 8)), jax.random.normal(keys[1], (2, 24, 2, 8))
  segments = SEGMENTS if packed else None
  got = max_logit(q, k, scale=0.3, window=window, segment_ids=segments, block=block)
  np.testing.assert_allclose(got, direct_max_logit(q, k, 0.3, window, segments), rtol=1e-6)
  if window:  # a traced `windowed` (layers alternating windowed and full attention)
    full = jax.jit(lambda w: max_logit(q, k, scale=0.3, window=window, windowed=w,
                                       segment_ids=segments, block=block))(False)
    np.testing.assert_allclose(full, direct_max_logit(q, k, 0.3, 0, segments), rtol=1e-6)


def weights(module) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v) for p, v in
          jax.tree.leaves_with_path(nnx.to_pure_dict(nnx.state(module, nnx.Param)))}


def clip_once(module, x_BSD, tau, alpha=0.5):
  """(largest logits before, after, weights before, after) of one QK-clip with tau."""
  positions = jnp.broadcast_to(jnp.arange(x_BSD.shape[1]), x_BSD.shape[:2])
  top = lambda: np.asarray(module(x_BSD, positions, with_max_logit=True)[1])
  before, w_before = top(), weights(module)
  module.clip_logits(clip_factors(jnp.asarray(before), tau), alpha)
  return before, top(), w_before, weights(module)


def test_grouped_query_heads_come_back_to_tau_and_the_rest_are_untouched():
  """4 query heads on 2 key heads: tau between the two heads of group 0, above group 1. Head 0
  (clipped, its group's largest) takes eta^alpha on its query, the shared key eta^(1 - alpha);
  head 1 (below tau, same group) keeps its logits, its query scaled up by what the key lost;
  group 1 is untouched bit for bit."""
  cfg = tiny_config(model=dict(num_heads=4, num_kv_heads=2, attention_bias=True)).model
  module = Attention(cfg, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model))
  positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
  top = np.asarray(module(x, positions, with_max_logit=True)[1])
  # Heads 0, 1 sharpened 3x and 1.5x (group 0), so that tau falls between them and above group 1.
  module.w_q_DHA[...] = module.w_q_DHA[...] * jnp.asarray([3.0, 1.5, 1.0, 1.0])[None, :, None]
  module.b_q_HA[...] = jax.random.normal(jax.random.key(2), module.b_q_HA.shape) * 0.01
  module.b_k_GA[...] = jax.random.normal(jax.random.key(3), module.b_k_GA.shape) * 0.01
  top = np.asarray(module(x, positions, with_max_logit=True)[1])
  tau = float((top[0] + top[1]) / 2)
  assert top[0] > tau > max(top[1:]), top
  alpha = 0.3
  before, after, w0, w1 = clip_once(module, x, tau, alpha)
  np.testing.assert_allclose(after[0], tau, rtol=1e-5)
  np.testing.assert_allclose(after[1:], before[1:], rtol=1e-5)
  eta = tau / before[0]
  key = eta ** (1 - alpha)
  np.testing.assert_allclose(w1["w_k_DGA"][:, 0], w0["w_k_DGA"][:, 0] * key, rtol=1e-6)
  np.testing.assert_allclose(w1["b_k_GA"][0], w0["b_k_GA"][0] * key, rtol=1e-6)
  np.testing.assert_allclose(w1["w_q_DHA"][:, 0], w0["w_q_DHA"][:, 0] * eta ** alpha, rtol=1e-6)
  np.testing.assert_allclose(w1["w_q_DHA"][:, 1], w0["w_q_DHA"][:, 1] / key, rtol=1e-6)
  np.testing.assert_allclose(w1["b_q_HA"][:2], w0["b_q_HA"][:2] * [[eta ** alpha], [1 / key]],
                             rtol=1e-6)
  for name, index in (("w_q_DHA", np.s_[:, 2:]), ("w_k_DGA", np.s_[:, 1]),
                      ("b_q_HA", np.s_[2:]), ("b_k_GA", np.s_[1]), ("w_v_DGA", np.s_[:]),
                      ("w_o_HAD", np.s_[:])):
    np.testing.assert_array_equal(w1[name][index], w0[name][index], err_msg=name)
  np.testing.assert_array_equal(after[2:], before[2:])  # bit for bit


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_mla_parts_scale_as_muonclip_says(q_lora_rank):
  """q's no-rope part by sqrt(eta), its rotary part by eta, each head's no-rope key (in the
  key/value up-projection) by sqrt(eta); the shared rotary key, the values and the heads below
  tau as they were, bit for bit."""
  config = tiny_config(model=dict(attention="mla", num_heads=4, num_kv_heads=4,
                                  mla=dict(q_lora_rank=q_lora_rank, kv_lora_rank=16,
                                           qk_nope_head_dim=8, qk_rope_head_dim=4,
                                           v_head_dim=8)))
  cfg, m = config.model, config.model.mla
  module = MLAttention(cfg, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0))
  q_name = "w_q_b_RHA" if q_lora_rank else "w_q_DHA"
  w_q = getattr(module, q_name)
  w_q[...] = w_q[...] * jnp.asarray([4.0, 1.0, 2.5, 1.0])[None, :, None]
  x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model))
  positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
  top = np.asarray(module(x, positions, with_max_logit=True)[1])
  tau = float(max(top[1], top[3]) * 1.05)
  assert min(top[0], top[2]) > tau, top
  before, after, w0, w1 = clip_once(module, x, tau)
  clipped, kept = [0, 2], [1, 3]
  np.testing.assert_allclose(after[clipped], tau, rtol=1e-5)
  np.testing.assert_array_equal(after[kept], before[kept])
  eta = tau / before[clipped]
  n = m.qk_nope_head_dim
  np.testing.assert_allclose(w1[q_name][:, clipped, :n],
                             w0[q_name][:, clipped, :n] * np.sqrt(eta)[None, :, None], rtol=1e-6)
  np.testing.assert_allclose(w1[q_name][:, clipped, n:],
                             w0[q_name][:, clipped, n:] * eta[None, :, None], rtol=1e-6)
  np.testing.assert_allclose(w1["w_kv_b_RHY"][:, clipped, :n],
                             w0["w_kv_b_RHY"][:, clipped, :n] * np.sqrt(eta)[None, :, None],
                             rtol=1e-6)
  np.testing.assert_array_equal(w1["w_kv_b_RHY"][:, :, n:], w0["w_kv_b_RHY"][:, :, n:])
  np.testing.assert_array_equal(w1[q_name][:, kept], w0[q_name][:, kept])
  np.testing.assert_array_equal(w1["w_kv_b_RHY"][:, kept], w0["w_kv_b_RHY"][:, kept])
  for name in set(w0) - {q_name, "w_kv_b_RHY"}:  # the shared rotary key among them
    np.testing.assert_array_equal(w1[name], w0[name], err_msg=name)


TAU = 0.25  # below some of the tiny model's first largest logits (0.23-0.30 a layer)


def clip_config(parallel=None, **train):
  train = dict(dict(optimizer="muon", steps=4, log_every=1, qk_clip=TAU, micro_batch_size=4),
               **train)
  return tiny_config(train=train,
                     checkpoint=dict(every=2), parallel=parallel or {})


def records(workdir, parallel=None, devices=None):
  return {r["step"]: r for r in train(clip_config(parallel), workdir, progress=False,
                                      devices=devices)}


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
  return records(tmp_path_factory.mktemp("single"), devices=jax.devices()[:1])


SHARDED = dict(dense=dict(data=2, fsdp=2, tensor=2), expert=dict(data=2, expert=4))


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
  """TP 2 over heads x FSDP 2 x DP 2, EP 4 x EDP 2; checkpoints at steps 2 and 4."""
  workdir = tmp_path_factory.mktemp("sharded")
  return workdir, records(workdir, SHARDED)


def test_the_largest_logits_are_logged(single_run):
  first = single_run[1]
  assert len(first["attention_max_logit"]) == 3  # one per layer
  assert first["attention_max_logit_max"] == max(first["attention_max_logit"]) > TAU


def test_a_step_brings_the_heads_above_tau_to_tau():
  """One train step at step 0 (warmup: learning rate 0, so the update is the clip alone), then
  the same batch again: the first layer's heads (whose inputs the clip does not change) that
  were above tau are at tau, the others as they were."""
  from jmoe.parallel import make_layout
  from jmoe.train.optimizer import learning_rate, make_optimizer
  from jmoe.train.state import state_spec
  from jmoe.train.step import make_train_step

  tokens = jax.random.randint(jax.random.key(0), (8, 33), 1, 264)
  config = clip_config()
  layout = make_layout(config.parallel, jax.devices()[:1])
  optimizer = make_optimizer(config.train)
  spec = state_spec(config, layout, optimizer)

  def heads(state):
    return np.asarray(nnx.merge(spec.graphdef, state.params, state.rest).hidden(
        tokens[:, :-1])[1].max_logit_H)

  state = spec.init()
  before = heads(state)
  tau = float(np.median(before[0]))
  config = clip_config(qk_clip=tau)
  step = jax.jit(make_train_step(spec.graphdef, config, optimizer, learning_rate(config.train)))
  with layout.active():
    state, metrics = step(state, {"tokens": tokens})
  np.testing.assert_allclose(metrics["attention_max_logit"], before.max(axis=1), rtol=1e-6)
  after = heads(state)
  above = before[0] > tau
  assert 0 < above.sum() < len(above)
  np.testing.assert_allclose(after[0][above], tau, rtol=1e-5)
  # Grouped queries (4 on 2 key heads): a head below tau whose key is shared with a clipped head
  # keeps its logits (to rounding); one in an unclipped group keeps them bit for bit.
  group_clipped = np.repeat(above.reshape(2, 2).any(axis=1), 2)
  np.testing.assert_allclose(after[0][~above], before[0][~above], rtol=1e-5)
  np.testing.assert_array_equal(after[0][~group_clipped], before[0][~group_clipped])


@pytest.mark.parametrize("layout", ["sharded", "pipeline"])
def test_sharded_and_pipelined_runs_equal_one_device(single_run, sharded_run, layout, tmp_path):
  if layout == "sharded":
    other = sharded_run[1]
  else:
    other = records(tmp_path, dict(pipeline=2, dense=dict(data=2, tensor=2),
                                   expert=dict(data=2, expert=2)))
  for step in range(1, 5):
    np.testing.assert_allclose(other[step]["loss"], single_run[step]["loss"], rtol=1e-5)
    np.testing.assert_allclose(other[step]["attention_max_logit"],
                               single_run[step]["attention_max_logit"], rtol=1e-5)


def test_resume_is_exact(sharded_run, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(sharded_run[0], workdir)
  shutil.rmtree(workdir / "checkpoints" / "4")
  resumed = records(workdir, SHARDED)
  for step in (3, 4):
    assert resumed[step]["loss"] == sharded_run[1][step]["loss"]
    assert resumed[step]["attention_max_logit"] == sharded_run[1][step]["attention_max_logit"]


@pytest.mark.parametrize("overrides, message", [
    (dict(model=dict(qk_norm=True)), r"train.qk_clip cannot work with model.qk_norm"),
    (dict(lora=dict(rank=4)), r"train.qk_clip scales the query and key projections, which "
                              r"LoRA \(lora.rank > 0\) keeps frozen"),
    (dict(), r"train.qk_clip_alpha must be in \[0, 1\], got 1.5"),
])
def test_configs_it_cannot_work_with_are_refused(overrides, message):
  train_cfg = dict(qk_clip=10.0, qk_clip_alpha=1.5 if not overrides else 0.5)
  with pytest.raises(ConfigError, match=message):
    tiny_config(train=train_cfg, **overrides)


def test_pipeline_schedules_other_than_gpipe_are_refused_by_name():
  stages = dict(pipeline=2, dense=dict(data=4), expert=dict(data=1, expert=4))
  train_cfg = dict(qk_clip=10.0, batch_size=16, micro_batch_size=4)  # 4 micro-batches
  with pytest.raises(ConfigError, match=r"train.qk_clip reads attention's largest logits from "
                     r"GPipe's pipeline schedule only; parallel.pipeline_schedule is 1f1b: set "
                     r"parallel.pipeline_schedule=gpipe \(or auto"):
    tiny_config(train=train_cfg, parallel=dict(stages, pipeline_schedule="1f1b"))
  tiny_config(train=train_cfg, parallel=dict(stages, pipeline_schedule="gpipe"))
  tiny_config(train=train_cfg, parallel=stages)  # auto: GPipe under QK-clip
