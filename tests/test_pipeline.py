"""Pipeline stages (jmoe/model/pipeline.py, pipeline_1f1b.py) compute what the single-device
micro-batch loop computes: loss, every gradient and the per-layer router statistics, under each
schedule (GPipe, 1F1B, interleaved), for stages folded with the dense and expert layouts, circular
repeats, uneven groups of layers and a model with dense layers first; and checkpoints move
between pipeline sizes and schedules."""

import functools

import shutil

import jax
import numpy as np
import pytest

from jmoe.checkpoint.target import with_shardings
from jmoe.config import ConfigError, DenseLayout, ExpertLayout, ParallelConfig
from jmoe.data import first_batches
from jmoe.model.pipeline import Schedule, Slots, bubble_fraction
from jmoe.parallel import make_layout
from jmoe.train.loop import train
from jmoe.train.optimizer import make_optimizer
from jmoe.train.state import state_spec
from jmoe.train.step import make_gradients
from helpers import tiny_config

# 1 dense layer, then 4 MoE layers: 2 or 4 stages, or 2 stages of 2 repeats.
MODEL = dict(d_model=32, num_heads=8, num_kv_heads=4, head_dim=8, d_ff=64, num_layers=5)
BATCH = dict(batch_size=16, micro_batch_size=4)

LAYOUTS = {  # name: parallel config
    "pp2_ep4": dict(pipeline=2, dense=dict(data=4), expert=dict(data=1, expert=4)),
    "pp2_tp2_ep2": dict(pipeline=2, dense=dict(data=2, tensor=2), expert=dict(data=2, expert=2)),
    "pp4_fsdp2": dict(pipeline=4, dense=dict(data=1, fsdp=2), expert=dict(data=2)),
    "pp2_fsdp4": dict(pipeline=2, dense=dict(data=1, fsdp=4), expert=dict(data=1, expert=4)),
    "pp2_repeats2": dict(pipeline=2, pipeline_repeats=2, dense=dict(data=4),
                         expert=dict(data=2, expert=2)),
    "pp2_repeats2_fsdp2_tp2": dict(pipeline=2, pipeline_repeats=2,
                                   dense=dict(data=1, fsdp=2, tensor=2),
                                   expert=dict(data=1, expert=2, tensor=2)),
}
# (layout, schedule): GPipe on each layout; 1F1B folded with EP x TP (4 micro-batches: on 2
# stages more than the 3 in flight, so the ring of stage inputs wraps) and FSDP; interleaved
# with FSDP x TP x EP (and EP alone among the uneven cases below).
SCHEDULES = [*((name, "gpipe") for name in ("pp2_ep4", "pp2_tp2_ep2", "pp4_fsdp2",
                                            "pp2_repeats2")),
             ("pp2_tp2_ep2", "1f1b"), ("pp4_fsdp2", "1f1b"),
             ("pp2_repeats2_fsdp2_tp2", "interleaved")]


def pipelined(repeats: int) -> str:
  return "interleaved" if repeats > 1 else "1f1b"


def config_for(parallel=None, checkpoint=None, **train):
  moe = dict(dispatcher="alltoall", balance=dict(aux_loss_coef=0.01, z_loss_coef=0.001))
  return tiny_config(model=MODEL, moe=moe, train=dict(BATCH, **train),
                     **({"parallel": parallel} if parallel else {}),
                     **({"checkpoint": checkpoint} if checkpoint else {}))


def gradients(config, devices):
  layout = make_layout(config.parallel, devices)
  spec = state_spec(config, layout, make_optimizer(config.train, config.precision.moments))
  state = spec.init()
  batch = jax.device_put(first_batches(config)[0], layout.batch)
  with layout.active():
    grads, _, metrics = jax.jit(make_gradients(spec.graphdef, config))(
        state.params, state.rest, batch, None)
  return jax.device_get((grads, metrics))


@pytest.fixture(scope="module")
def reference():
  return gradients(config_for(), jax.devices()[:1])


@pytest.mark.parametrize("name, schedule", SCHEDULES)
def test_stages_match_single_device(name, schedule, reference):
  parallel = dict(LAYOUTS[name], pipeline_schedule=schedule)
  assert_matches(gradients(config_for(parallel), jax.devices()), reference)


@pytest.mark.parametrize("name, schedule, batch", [
    ("pp2_ep4", "gpipe", (24, 6)), ("pp2_fsdp4", "1f1b", (32, 4)),
    ("pp2_repeats2_fsdp2_tp2", "interleaved", (24, 6))])
def test_the_batch_reaches_the_stages_without_being_gathered_whole(name, schedule, batch, capfd):
  """Cutting the batch (sequences split over the stages and their devices) into the stages'
  micro-batches, and the stack's output and input gradient back, compile to collectives XLA's
  partitioner plans: it once fell back to gathering the whole batch onto every device ("involuntary
  full rematerialization", 896 GiB a GPU in Megatron's PP 16 plan), which it says on stderr."""
  config = config_for(dict(LAYOUTS[name], pipeline_schedule=schedule), batch_size=batch[0],
                      micro_batch_size=batch[1])
  layout = make_layout(config.parallel, jax.devices())
  spec = state_spec(config, layout, make_optimizer(config.train, config.precision.moments))
  params = with_shardings(spec.abstract.params, spec.shardings.params)
  rest = with_shardings(spec.abstract.rest, spec.shardings.rest)
  batch = jax.device_put(first_batches(config)[0], layout.batch)
  capfd.readouterr()
  with layout.active():
    jax.jit(make_gradients(spec.graphdef, config)).lower(params, rest, batch, None).compile()
  err = capfd.readouterr().err
  assert "Involuntary full rematerialization" not in err, err[-2000:]


def assert_matches(result, reference):
  """Losses to 1e-5, expert loads (per layer and expert, the mean over micro-batches) to 1e-6,
  every gradient to 1e-4 relative (absolute: 1e-5 of the largest)."""
  (grads, metrics), (ref_grads, ref_metrics) = result, reference
  for key in ("loss", "lm_loss", "aux_loss", "z_loss"):
    np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(metrics["expert_load"], ref_metrics["expert_load"], atol=1e-6)
  flat, ref_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)
  scale = max(float(np.max(np.abs(g))) for g in ref_flat)
  for (path, g), ref in zip(flat, ref_flat):
    np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-5 * scale,
                               err_msg=jax.tree_util.keystr(path))


# Uneven groups: (MoE layers, parallel config); each gradient of the stack (masked slots
# included: theirs must add exactly nothing) against the run without stages.
UNEVEN = {
    "3_layers_pp2_even_as_can_be": (3, LAYOUTS["pp2_ep4"]),  # 2 + 1
    "3_layers_pp2_listed": (3, dict(LAYOUTS["pp2_tp2_ep2"], pipeline_layers=(1, 2))),
    "5_layers_pp2_repeats2": (5, dict(LAYOUTS["pp2_repeats2"], pipeline_layers=(1, 2, 1, 1))),
}


def uneven_config(moe_layers, parallel=None):
  return tiny_config(
      model=dict(MODEL, num_layers=moe_layers + 1), train=BATCH,
      moe=dict(dispatcher="alltoall", balance=dict(aux_loss_coef=0.01, z_loss_coef=0.001)),
      **({"parallel": parallel} if parallel else {}))


@functools.lru_cache(maxsize=None)
def uneven_reference(moe_layers):
  return gradients(uneven_config(moe_layers), jax.devices()[:1])


@pytest.mark.parametrize("name", sorted(UNEVEN))
@pytest.mark.parametrize("schedule", ["gpipe", "pipelined"])
def test_uneven_stages_match_single_device(name, schedule):
  """`pipelined`: 1F1B, or interleaved where the stages have repeats."""
  moe_layers, parallel = UNEVEN[name]
  if schedule == "pipelined":
    schedule = pipelined(parallel.get("pipeline_repeats", 1))
  parallel = dict(parallel, pipeline_schedule=schedule)
  assert_matches(gradients(uneven_config(moe_layers, parallel), jax.devices()),
                 uneven_reference(moe_layers))


def test_slots_of_uneven_groups():
  slots = Slots(counts=(1, 2, 1, 1), stages=2)  # 2 stages x 2 repeats
  assert slots.width == 2 and not slots.even
  np.testing.assert_array_equal(slots.starts, [[0, 1], [3, 4]])
  np.testing.assert_array_equal(slots.layers[:, :, 0], [[0, 0], [3, 3]])  # masked: its last
  np.testing.assert_array_equal(slots.active[:, :, 1], [[True, True], [True, False]])
  assert slots.describe() == ("MoE layers per stage: 2, 3 (per virtual stage, each stage's "
                              "repeats: 1+1, 2+1); each group runs 2 slots, masked where it has "
                              "fewer layers")


# DeepSeek-like: MLA, an MTP module, a shared expert, sigmoid group routing, sequence-wise aux
# loss and aux-loss-free bias; GPT-OSS-like: no dense layer first (4 MoE layers), sliding windows
# on alternate layers (so each stage must know its layers' indices), sinks, biased experts.
FAMILIES = {
    "deepseek": dict(
        model=dict(MODEL, attention="mla", mtp_depth=1,
                   mla=dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                            qk_rope_head_dim=4, v_head_dim=8)),
        moe=dict(num_shared_experts=1, router=dict(score="sigmoid", num_groups=4, topk_groups=2,
                                                   scaling_factor=2.5),
                 balance=dict(bias_update_rate=0.001, aux_loss_type="seq", aux_loss_coef=0.01))),
    "gpt_oss": dict(
        model=dict(MODEL, num_layers=4, sliding_window=6, full_attention_every=2,
                   attention_bias=True, attention_sinks=True),
        moe=dict(first_k_dense=0, expert_bias=True, activation="clamped_swiglu",
                 router=dict(score="softmax_topk", bias=True))),
}


@pytest.mark.parametrize("family, layers, schedule", [
    *((f, None, "gpipe") for f in sorted(FAMILIES)), ("deepseek", 4, "gpipe"),
    ("gpt_oss", 3, "gpipe"), ("deepseek", 4, "1f1b")])
def test_families_match_single_device(family, layers, schedule):
  """`layers`: fewer layers, so that the MoE blocks split unevenly (2 + 1: the MTP module after
  them, under 1F1B on each micro-batch as it leaves the last stage; the sliding windows
  alternating by each layer's index in the model)."""
  variant = FAMILIES[family]
  if layers:
    variant = dict(variant, model=dict(variant["model"], num_layers=layers))
  config = lambda **parallel: tiny_config(**variant, train=BATCH, **parallel)
  parallel = dict(LAYOUTS["pp2_ep4"], pipeline_schedule=schedule)
  assert_matches(gradients(config(parallel=parallel), jax.devices()),
                 gradients(config(), jax.devices()[:1]))


def test_stage_axis_is_outermost_and_shown():
  layout = make_layout(config_for(LAYOUTS["pp2_tp2_ep2"]).parallel)
  assert layout.mesh.axis_names[0] == "stage" and layout.mesh.shape["stage"] == 2
  table = layout.describe()
  assert "stage" in table.splitlines()[1] and "pipeline: 2 stages" in table
  # with the model's MoE layers, the table says how they are shared out over the stages
  uneven = make_layout(uneven_config(5, UNEVEN["5_layers_pp2_repeats2"][1]).parallel)
  assert uneven.describe(5).splitlines()[-1] == (
      "pipeline: MoE layers per stage: 2, 3 (per virtual stage, each stage's repeats: 1+1, "
      "2+1); each group runs 2 slots, masked where it has fewer layers")


def test_bubble_fraction():
  assert bubble_fraction(stages=4, repeats=1, micro_batches=4) == pytest.approx(3 / 7)
  assert bubble_fraction(stages=4, repeats=2, micro_batches=4) == pytest.approx(3 / 11)
  assert bubble_fraction(stages=1, repeats=1, micro_batches=8) == 0
  # 1F1B: M + 2 S - 2 ticks, whose idle slots are skipped: GPipe's bubble, at most 2 S - 1 in
  # flight (GPipe: all M); interleaved: 2 R S - 1 stage inputs of a virtual stage each.
  one_f_one_b = Schedule(stages=4, repeats=1, micro_batches=16, kind="1f1b")
  assert one_f_one_b.iterations == 22 and one_f_one_b.bubble == pytest.approx(3 / 19)
  assert one_f_one_b.in_flight == 7 and Schedule(4, 1, 16).in_flight == 16
  assert Schedule(4, 2, 16, kind="interleaved").in_flight == 15
  assert Schedule(4, 1, 4, kind="1f1b").in_flight == 4


def test_default_schedule():
  """auto: GPipe first; the schedule the stages bound is 1F1B, interleaved with repeats where
  the stages divide the micro-batches, none otherwise."""
  parallel = lambda **kw: ParallelConfig(DenseLayout(), ExpertLayout(), **kw)
  assert parallel(pipeline=4).schedule == "gpipe"
  assert parallel(pipeline=4, pipeline_schedule="1f1b").schedule == "1f1b"
  assert parallel(pipeline=4).bounded_schedule(8) == "1f1b"
  assert parallel(pipeline=4, pipeline_repeats=2).bounded_schedule(8) == "interleaved"
  assert parallel(pipeline=4, pipeline_repeats=2).bounded_schedule(6) is None


@pytest.mark.parametrize("name, bounded", [("pp2_ep4", "1f1b"), ("pp2_repeats2", "interleaved")])
def test_auto_keeps_gpipe_where_its_step_fits_and_bounds_memory_where_it_does_not(
    name, bounded, caplog):
  """The compiled GPipe step (4 micro-batches over 2 stages) against a device memory of its own
  size, then one byte less: the bounded schedule, whose compiled step needs less; under QK-clip
  GPipe stays (with a warning)."""
  import dataclasses
  from jmoe.train.step import compiled_peak, fitting_schedule

  def fitted(config, memory):
    layout = make_layout(config.parallel, jax.devices())
    optimizer = make_optimizer(config.train, config.precision.moments)
    spec = state_spec(config, layout, optimizer)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                         first_batches(config)[0])
    chosen, compiled = fitting_schedule(config, layout, spec, optimizer, batch, memory=memory)
    return chosen.parallel.pipeline_schedule, compiled_peak(compiled)

  config = config_for(LAYOUTS[name])
  assert config.parallel.pipeline_schedule == "auto"
  kind, gpipe_bytes = fitted(config, None)  # no limit (as on CPU)
  assert kind == "gpipe"
  assert fitted(config, gpipe_bytes) == ("gpipe", gpipe_bytes)
  kind, bounded_bytes = fitted(config, gpipe_bytes - 1)
  assert kind == bounded and bounded_bytes < gpipe_bytes
  clipped = dataclasses.replace(config, train=dataclasses.replace(config.train, qk_clip=10.0))
  with caplog.at_level("WARNING"):
    assert fitted(clipped, gpipe_bytes - 1)[0] == "gpipe"
  assert "train.qk_clip runs on GPipe only" in caplog.text


def test_pipeline_sizes_that_cannot_work():
  with pytest.raises(ConfigError, match=r"parallel.pipeline \(3\) must divide the 8 devices"):
    make_layout(ParallelConfig(DenseLayout(data=-1), ExpertLayout(data=-1), pipeline=3))
  cases = [
      (dict(pipeline=8), {}, "the 4 MoE layers cannot fill"),
      (dict(pipeline=2, pipeline_repeats=2), dict(train=dict(batch_size=16, micro_batch_size=16)),
       "at least as many micro-batches as stages"),
      (dict(pipeline=2), dict(precision=dict(gemm="fp8", fp8_recipe="delayed", fp8_dense=True)),
       "fp8_recipe=current"),
      (dict(pipeline_repeats=2), {}, "needs pipeline stages"),
      (dict(pipeline=2, pipeline_schedule="zb"), {}, "parallel.pipeline_schedule"),
      (dict(pipeline=2, pipeline_repeats=2, pipeline_schedule="1f1b"), {},
       "use pipeline_schedule=interleaved"),
      (dict(pipeline=2, pipeline_schedule="interleaved"), {}, "set parallel.pipeline_repeats"),
      (dict(pipeline=4, pipeline_repeats=2, pipeline_schedule="interleaved"),
       dict(train=dict(batch_size=24, micro_batch_size=4)), "must be a multiple of"),
  ]
  for parallel, extra, message in cases:
    with pytest.raises(ConfigError, match=message):
      tiny_config(model=MODEL, parallel=parallel, **extra)


# (stages, repeats, schedule) saved with, then resumed with; sequences per micro-batch.
RESUMES = [((2, 1, "gpipe"), (1, 1, "gpipe"), 8), ((1, 1, "gpipe"), (4, 1, "gpipe"), 8),
           ((2, 2, "interleaved"), (4, 1, "1f1b"), 4)]


@pytest.mark.parametrize("first, then, micro", RESUMES)
def test_resume_across_pipeline_sizes(tmp_path, first, then, micro):
  """A run saved with one pipeline size and schedule resumes with another and logs the
  uninterrupted run's losses."""
  def run(pipeline, workdir):
    stages, repeats, schedule = pipeline
    parallel = dict(pipeline=stages, pipeline_repeats=repeats, pipeline_schedule=schedule,
                    dense=dict(data=8 // stages), expert=dict(data=8 // stages))
    config = config_for(parallel, dict(every=2, async_save=False), steps=4, warmup_steps=1,
                        micro_batch_size=micro)
    return {r["step"]: r["loss"] for r in train(config, workdir, progress=False)}

  whole = run(first, tmp_path / "whole")
  shutil.copytree(tmp_path / "whole", tmp_path / "split")  # as if it had stopped after step 2
  shutil.rmtree(tmp_path / "split" / "checkpoints" / "4")
  resumed = run(then, tmp_path / "split")
  assert sorted(resumed) == [3, 4]
  for step in (3, 4):
    np.testing.assert_allclose(resumed[step], whole[step], rtol=1e-5)
