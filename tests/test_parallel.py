"""Every parallel layout computes what the single-device run computes."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jmoe.config import ConfigError, DenseLayout, ExpertLayout, ParallelConfig
from jmoe.data import first_batches
from jmoe.parallel import make_layout
from jmoe.parallel.fold import fold
from jmoe.train.optimizer import make_optimizer
from jmoe.train.state import state_spec
from jmoe.train.step import make_loss_fn, target_counts
from helpers import tiny_config

MODEL = dict(d_model=32, num_heads=8, num_kv_heads=4, head_dim=8, d_ff=64, num_layers=3)

LAYOUTS = {  # name: (dense, expert)
    "dp8": (dict(data=8), dict(data=8)),
    "fsdp8": (dict(data=1, fsdp=8), dict(data=8)),
    "tp2_dp4_ep8": (dict(data=4, tensor=2), dict(data=1, expert=8)),
    "tp4_ep4_etp2": (dict(data=2, tensor=4), dict(data=1, expert=4, tensor=2)),
    "cp2_fsdp4_ep8": (dict(data=1, fsdp=4, context=2), dict(data=1, expert=8)),
    "ep2_edp4": (dict(data=8), dict(data=4, expert=2)),
}





def loss_and_grads(config, devices):
  layout = make_layout(config.parallel, devices)
  spec = state_spec(config, layout, make_optimizer(config.train, config.precision.moments))
  state = spec.init()
  # A packed batch: several documents per row, attention kept within each.
  batch = jax.device_put(first_batches(config)[0], layout.batch)
  loss_fn = make_loss_fn(spec.graphdef, config)
  counts = target_counts(batch, config.model.mtp_depth)
  with layout.active():
    fn = jax.jit(lambda p, r, b: jax.value_and_grad(loss_fn, has_aux=True)(p, r, b, counts, 1))
    (loss, metrics), grads = fn(state.params, state.rest, batch)
  return jax.device_get((loss, metrics, grads))


@pytest.fixture(scope="module")
def reference():
  """The single-device run (one device has no exchange: either dispatcher computes this)."""
  return loss_and_grads(tiny_config(model=MODEL), jax.devices()[:1])


# Each layout with each dispatcher; without expert parallelism both are the all-gather one (the
# same program), run once.
CASES = [(name, dispatcher) for name, (_, expert) in sorted(LAYOUTS.items())
         for dispatcher in ("allgather", "alltoall")
         if dispatcher == "allgather" or expert.get("expert", 1) > 1]


@pytest.mark.parametrize("name, dispatcher", CASES)
def test_layout_matches_single_device(name, dispatcher, reference):
  dense, expert = LAYOUTS[name]
  config = tiny_config(model=MODEL, moe=dict(dispatcher=dispatcher),
                       parallel=dict(dense=dense, expert=expert))
  loss, metrics, grads = loss_and_grads(config, jax.devices())
  ref_loss, ref_metrics, ref_grads = reference
  np.testing.assert_allclose(metrics["expert_load"], ref_metrics["expert_load"], atol=1e-6)
  assert_matches(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("name", ["cp2_fsdp4_ep8", "tp4_ep4_etp2"])
def test_alltoall_later_rounds_match_single_device(name, reference):
  """Buffers of the mean load per peer (dispatch_factor 1): routing overflows them, and the
  copies past them travel in later rounds inside the layer stack's loop."""
  dense, expert = LAYOUTS[name]
  config = tiny_config(model=MODEL, moe=dict(dispatcher="alltoall", dispatch_factor=1.0),
                       parallel=dict(dense=dense, expert=expert))
  loss, metrics, grads = loss_and_grads(config, jax.devices())
  assert metrics["overflow_rounds"] > 0
  ref_loss, ref_metrics, ref_grads = reference
  assert "overflow_rounds" not in ref_metrics  # one device: no exchange, no rounds to count
  assert_matches(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("dispatcher, factor", [("alltoall", 1.0), ("alltoall", 1.25),
                                               ("allgather", 1.25)])
def test_remat_keeping_the_exchanges_matches_single_device(dispatcher, factor, reference):
  """`train.remat=exchanges`: the backward pass recomputes each layer from the token rows the
  exchanges received (kept), later rounds included (factor 1.0 overflows the first round)."""
  dense, expert = LAYOUTS["tp4_ep4_etp2"]
  config = tiny_config(model=MODEL, train=dict(remat="exchanges"),
                       moe=dict(dispatcher=dispatcher, dispatch_factor=factor),
                       parallel=dict(dense=dense, expert=expert))
  loss, metrics, grads = loss_and_grads(config, jax.devices())
  assert factor > 1 or metrics["overflow_rounds"] > 0
  ref_loss, _, ref_grads = reference
  assert_matches(loss, grads, ref_loss, ref_grads)


def assert_matches(loss, grads, ref_loss, ref_grads):
  """Loss to 1e-5 and gradients to 1e-4 relative (absolute: 1e-5 of the largest gradient)."""
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))
  for (path, g), ref in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-5 * scale,
                               err_msg=jax.tree_util.keystr(path))


def test_fold_matches_the_design_example():
  f = fold(ParallelConfig(DenseLayout(data=4, tensor=4), ExpertLayout(data=2, expert=8)), 16)
  assert f.axis_sizes == (2, 2, 4)
  assert f.dense["data"] == ("data/data", "data/expert") and f.dense["tensor"] == ("tensor/expert",)
  assert f.expert["expert"] == ("data/expert", "tensor/expert")
  assert f.expert["data"] == ("data/data",)


@pytest.mark.parametrize("devices, dense, expert, message", [
    (6, dict(data=2, tensor=3), dict(data=3, expert=2), "cannot share 6 devices"),
    (4, dict(data=8), dict(data=-1), "multiplies to 8, but there are 4 devices"),
    (4, dict(data=-1, tensor=3), dict(data=-1), "multiply to 3, which does not divide the 4"),
])
def test_layouts_that_do_not_fold(devices, dense, expert, message):
  with pytest.raises(ConfigError, match=message):
    fold(ParallelConfig(DenseLayout(**dense), ExpertLayout(**expert)), devices)


def test_expert_parallelism_must_divide_experts():
  with pytest.raises(ConfigError, match=r"moe.num_experts \(8\) must be a multiple of "
                                        r"parallel.expert.expert \(3\)"):
    tiny_config(parallel=dict(expert=dict(data=1, expert=3)))


def param_specs(dense, expert):
  config = tiny_config(model=MODEL, parallel=dict(dense=dense, expert=expert))
  layout = make_layout(config.parallel)
  spec = state_spec(config, layout, make_optimizer(config.train, config.precision.moments))
  flat = jax.tree.leaves_with_path(spec.shardings.params)
  name = lambda path: jax.tree_util.keystr(path).removesuffix(".value")
  sizes = {name(p): a.size for p, a in jax.tree.leaves_with_path(spec.abstract.params)}
  return {name(p): s.spec for p, s in flat}, sizes


def test_sharding_snapshot_tp4_ep4_etp2():
  specs, _ = param_specs(dict(data=2, tensor=4), dict(data=1, expert=4, tensor=2))
  # Mesh axes outermost first: data/expert 2, tensor/expert 2, tensor/tensor 2.
  tp, ep, etp = ("tensor/expert", "tensor/tensor"), ("data/expert", "tensor/expert"), (
      "tensor/tensor",)
  expected = {
      "['embed']['table']": P(tp, None),
      "['head_DV']": P(None, tp),
      "['moe_blocks']['attn']['w_q_DHA']": P(None, None, tp, None),
      "['moe_blocks']['attn']['w_k_DGA']": P(None, None, tp, None),
      "['moe_blocks']['attn']['w_o_HAD']": P(None, tp, None, None),
      "['dense_blocks']['mlp']['w_in_D2F']": P(None, None, None, tp),
      "['dense_blocks']['mlp']['w_out_FD']": P(None, tp, None),
      "['moe_blocks']['mlp']['w_in_ED2F']": P(None, ep, None, None, etp),
      "['moe_blocks']['mlp']['w_out_EFD']": P(None, ep, etp, None),
      "['moe_blocks']['mlp']['router_DE']": P(None, None, None),
      "['final_norm']['scale']": P(None),
  }
  for name, spec in expected.items():
    assert specs[name] == spec, (name, specs[name])


def test_a_dimension_the_whole_group_does_not_divide_splits_over_the_largest_run_that_does():
  """A micro-batch of 4 sequences over 2 stages x 4 data devices splits over the data ones (the
  1F1B loop's head ran replicated on every device before); 6 over them, over 2 (the stages);
  7: whole; a vocabulary of 250 over 2 x 2 tensor devices: over 2, 251: whole."""
  from jax.sharding import PartitionSpec as P
  config = tiny_config(parallel=dict(pipeline=2, dense=dict(data=4), expert=dict(data=4)),
                       train=dict(batch_size=16, micro_batch_size=4))
  layout = make_layout(config.parallel)
  stage = layout.stage_axes[0]
  data = layout.activation_spec(("act_batch",), (8,))[0][-1]
  assert layout.activation_spec(("act_batch",), (8,)) == P((stage, data))
  assert layout.activation_spec(("act_batch", None), (4, 3)) == P((data,), None)
  assert layout.activation_spec(("act_batch",), (6,)) == P((stage,))
  assert layout.activation_spec(("act_batch",), (7,)) == P(None)
  tp = make_layout(tiny_config(model=MODEL, parallel=dict(
      dense=dict(data=2, tensor=4), expert=dict(data=1, expert=4, tensor=2))).parallel)
  assert tp.param_spec(("vocab", None), (256, 8)) == P(("tensor/expert", "tensor/tensor"), None)
  assert tp.param_spec(("vocab", None), (250, 8)) == P(("tensor/tensor",), None)
  assert tp.param_spec(("vocab", None), (251, 8)) == P(None, None)


@pytest.mark.parametrize("name", ["fsdp8", "cp2_fsdp4_ep8"])
def test_no_large_parameter_left_replicated(name):
  specs, sizes = param_specs(*LAYOUTS[name])
  for key, spec in specs.items():
    if sizes[key] >= 1024:
      assert any(entry is not None for entry in spec), key


def compiled_state_bytes(dense, expert):
  """(XLA's per-device argument bytes of the train step, the bytes the shardings say)."""
  from jmoe.train.step import compile_train_step
  config = tiny_config(model=MODEL, parallel=dict(dense=dense, expert=expert))
  layout = make_layout(config.parallel)
  optimizer = make_optimizer(config.train, config.precision.moments)
  spec = state_spec(config, layout, optimizer)
  batch = {"tokens": jax.ShapeDtypeStruct((config.train.batch_size, config.data.seq_len + 1),
                                          np.int32)}
  compiled = compile_train_step(config, layout, spec, optimizer, batch)
  state_bytes = sum(np.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
                    for a, s in zip(jax.tree.leaves(spec.abstract), jax.tree.leaves(spec.shardings)))
  batch_bytes = np.prod(layout.batch.shard_shape(batch["tokens"].shape)) * 4
  return compiled.memory_analysis().argument_size_in_bytes, state_bytes + batch_bytes


def test_per_device_state_memory_shrinks_as_computed():
  measured = {}
  for fsdp in (1, 8):
    xla, computed = compiled_state_bytes(dict(data=8 // fsdp, fsdp=fsdp), dict(data=8))
    np.testing.assert_allclose(xla, computed, rtol=0.01)
    measured[fsdp] = xla
  assert measured[1] > measured[8]
  # Experts split 2 ways by expert and 4 by FFN width (no expert-data FSDP): as computed.
  xla, computed = compiled_state_bytes(dict(data=8), dict(data=1, expert=2, tensor=4))
  np.testing.assert_allclose(xla, computed, rtol=0.01)


DEEPSEEK_LIKE = dict(
    model=dict(MODEL, attention="mla", mtp_depth=1, mla=dict(q_lora_rank=16, kv_lora_rank=16,
                                                 qk_nope_head_dim=8, qk_rope_head_dim=4,
                                                 v_head_dim=8),
               yarn=dict(factor=4.0, original_max_len=8, mscale_all_dim=1.0)),
    moe=dict(num_shared_experts=1, router=dict(score="sigmoid", num_groups=4, topk_groups=2,
                                               scaling_factor=2.5),
             balance=dict(bias_update_rate=0.001, aux_loss_type="seq")))


@pytest.fixture(scope="module")
def single_device():
  """Single-device loss and gradients per model variant, computed once."""
  cache = {}

  def get(name, variant):
    if name not in cache:
      cache[name] = loss_and_grads(tiny_config(**variant), jax.devices()[:1])
    return cache[name]

  return get


GPT_OSS_LIKE = dict(
    model=dict(MODEL, sliding_window=6, full_attention_every=2, attention_bias=True,
               attention_sinks=True),
    moe=dict(first_k_dense=0, expert_bias=True, activation="clamped_swiglu",
             router=dict(score="softmax_topk", bias=True)))


VARIANTS = {"deepseek": DEEPSEEK_LIKE, "gpt_oss": GPT_OSS_LIKE}


@pytest.mark.parametrize("variant, name", [("deepseek", "tp2_dp4_ep8"),
                                           ("deepseek", "cp2_fsdp4_ep8"),
                                           ("gpt_oss", "tp4_ep4_etp2"),
                                           ("gpt_oss", "cp2_fsdp4_ep8")])
def test_family_features_match_single_device(variant, name, single_device):
  """MLA, MTP, shared experts, sigmoid groups (DeepSeek-like); sinks, alternating windows,
  biased clamped experts (GPT-OSS-like)."""
  dense, expert = LAYOUTS[name]
  config = tiny_config(**VARIANTS[variant], parallel=dict(dense=dense, expert=expert))
  ref_loss, _, ref_grads = single_device(variant, VARIANTS[variant])
  loss, _, grads = loss_and_grads(config, jax.devices())
  assert_matches(loss, grads, ref_loss, ref_grads)
