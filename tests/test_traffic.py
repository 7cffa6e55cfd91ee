"""The communication report (jmoe/memory/traffic.py, scripts/comm_volume.py): each collective's
bytes on a program whose traffic is known by hand, and the all-to-all dispatcher's bytes against
the rows its routing moves."""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jmoe.config import load_config
from jmoe.memory.traffic import collective_traffic, communication
from jmoe.parallel import make_layout

ROOT = pathlib.Path(__file__).resolve().parents[1]
N = 8  # devices


def test_each_collective_counts_as_a_ring_sends_it():
  """Every kind once, an all-to-all in a scan of 3 trips and one in a loop whose trip count
  depends on the data (reported per round): [8, 16] float32 blocks, 512 bytes per device."""
  mesh = jax.make_mesh((N,), ("x",))
  a2a = lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True)

  def body(x_8x16, trips):
    y = a2a(x_8x16)
    y = jax.lax.fori_loop(0, 3, lambda i, c: a2a(c * 1.5), y)
    total = jax.lax.psum(y[0], "x")  # [16]
    gathered = jax.lax.all_gather(y[:2], "x", tiled=True)  # [16, 16]
    scattered = jax.lax.psum_scatter(y, "x", tiled=True)  # [1, 16]
    rounds = jax.lax.while_loop(lambda c: c[1] < trips[0],
                                lambda c: (a2a(c[0] + 1), c[1] + 1), (y, 0))[0]
    moved = jax.lax.ppermute(y, "x", [(i, (i + 1) % N) for i in range(N)])
    return rounds + moved + total + gathered.sum(0) + scattered

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
  compiled = step.lower(
      jax.ShapeDtypeStruct((N * 8, 16), jnp.float32, sharding=NamedSharding(mesh, P("x"))),
      jax.ShapeDtypeStruct((1,), jnp.int32, sharding=NamedSharding(mesh, P()))).compile()
  traffic = collective_traffic(compiled.as_text(), N)
  block = 8 * 16 * 4
  assert traffic.every_step == {
      "all-to-all": 4 * block * (N - 1) / N,  # once, then 3 trips
      "all-gather": 16 * 16 * 4 * (N - 1) / N,
      "reduce-scatter": 16 * 4 * (N - 1),
      "all-reduce": 2 * 16 * 4 * (N - 1) / N,
      "collective-permute": block}
  assert traffic.per_round["all-to-all"] == block * (N - 1) / N
  assert sum(traffic.if_taken.values()) == 0



def test_combined_collectives_count_as_the_ones_they_join():
  """XLA's combiner joins two gradient reductions into one float32 tuple all-reduce named
  "PREFIX/(a:b)" after partitioning, where they were bfloat16: one reduce-scatter (its sum only
  sliced, through a transpose) and one all-reduce. Each counts as it was, in bfloat16."""
  partitioned = """ENTRY %main (p0: bf16[64], p1: bf16[32]) -> bf16[8] {
  %ar.1 = bf16[64]{0} all-reduce(%p0), replica_groups=[1,8]<=[8], metadata={op_name="jit(f)/w/dot_general"}
  %t.1 = bf16[64]{0} transpose(%ar.1), dimensions={0}
  %ds.1 = bf16[8]{0} dynamic-slice(%t.1, %i), dynamic_slice_sizes={8}
  %ar.2 = bf16[32]{0} all-reduce(%p1), replica_groups=[1,8]<=[8], metadata={op_name="jit(f)/b/reduce_sum"}
  ROOT %add.1 = bf16[32]{0} add(%ar.2, %ar.2)
}"""
  optimized = """ENTRY %main (p0: f32[64], p1: f32[32]) -> f32[8] {
  %ar = (f32[64]{0}, f32[32]{0}) all-reduce(%p0, %p1), replica_groups=[1,8]<=[8], metadata={op_name="jit(f)/(w/dot_general:b/reduce_sum)"}
}"""
  traffic = collective_traffic(optimized, N, partitioned)
  assert traffic.every_step["reduce-scatter"] == 64 * 2 / N * (N - 1)
  assert traffic.every_step["all-reduce"] == 2 * 32 * 2 * (N - 1) / N

def tiny(*overrides):
  return load_config(ROOT / "configs/tiny_moe.py", [
      "moe.dispatcher=alltoall", "moe.router.force_balanced=true", "precision.compute=bfloat16",
      "parallel.expert.data=1", "parallel.expert.expert=8", *overrides])


def test_alltoall_sends_the_dispatch_factor_times_the_routed_rows():
  """EP 8, balanced: the copies cross in blocks of dispatch_factor x the mean rows per peer, in
  bfloat16 (the CPU build's float32 widening undone); with blocks for the worst case (factor 8,
  as every copy of a device's tokens could go to one peer) it is EP times the rows."""
  config = tiny()
  report = communication(config, make_layout(config.parallel))
  assert report["all_to_all_over_routed"] == pytest.approx(config.moe.dispatch_factor, rel=0.01)
  assert report["all_to_all_over_routed"] <= 1.5
  assert report["per_overflow_round"]["all-to-all"] > 0  # the rounds a skewed routing adds
  config = tiny("moe.dispatch_factor=8.0")
  worst = communication(config, make_layout(config.parallel))
  assert worst["all_to_all_over_routed"] == pytest.approx(8.0, rel=0.01)
  assert "all-to-all" not in worst["per_overflow_round"]  # every load fits: no later round


def test_remat_keeping_the_exchanges_sends_the_rows_once():
  """`train.remat=full` and `attention_moe` run each MoE layer's forward again in the backward
  pass, its two exchanges included (1.25 x 1.5 the routed rows); `exchanges` keeps what they
  received and sends what `none` does."""
  ratio = {}
  for remat in ("none", "full", "attention_moe", "exchanges"):
    config = tiny(f"train.remat={remat}")
    ratio[remat] = communication(config, make_layout(config.parallel))["all_to_all_over_routed"]
  assert ratio["full"] == ratio["attention_moe"] == pytest.approx(1.25 * 1.5, rel=0.01)
  assert ratio["exchanges"] == ratio["none"] == pytest.approx(1.25, rel=0.01)


def test_allgather_dispatch_sends_no_all_to_all():
  config = tiny("moe.dispatcher=allgather")
  report = communication(config, make_layout(config.parallel))
  assert report["bytes_per_device"]["all-to-all"] == 0
  assert report["all_to_all_over_routed"] == 0
  assert report["bytes_per_device"]["all-gather"] > 0


def test_pipeline_stages_pass_activations_and_slots_count_as_often_as_they_run():
  """PP 2: the stages hand their micro-batches on with collective-permutes; the exchange also
  runs in the bubble's iterations (5 for 4 micro-batches), so above the factor. Under 1F1B the
  stages' exchanges sit in the loop's slot conditionals, counted as often as each slot runs (5
  of the 6 ticks): the backward slot sends twice the forward slot's all-to-all bytes (it runs
  the forward pass again, then its gradient's), so 1F1B's step sends up to 1.5 x GPipe's (1.39
  here: GPipe's visits send a little more each; before, the conditionals counted apart and the
  step's bytes held none of them). The gradients' hand-off is in the backward slot too."""
  from jmoe.memory.traffic import compiled_texts, slot_shares
  from jmoe.model.pipeline_1f1b import SLOTS
  reports = {}
  for schedule in ("gpipe", "1f1b"):
    config = tiny("parallel.pipeline=2", f"parallel.pipeline_schedule={schedule}",
                  "parallel.expert.expert=4", "model.num_layers=5", "train.remat=none",
                  "train.batch_size=16", "train.micro_batch_size=4")
    layout = make_layout(config.parallel)
    optimized, partitioned = compiled_texts(config, layout)
    reports[schedule] = collective_traffic(optimized, N, partitioned,
                                           slot_shares(config, layout))
    assert reports[schedule].every_step["collective-permute"] > 0
    assert not any(reports[schedule].if_taken.values())
  assert slot_shares(config, layout) == dict(zip(SLOTS, (5 / 6, 4 / 6, 5 / 6)))
  routed = communication.__globals__["routed_bytes"](config, layout)
  assert 1.25 <= reports["gpipe"].every_step["all-to-all"] / routed <= 2.0
  once = {slot: collective_traffic(optimized, N, partitioned,
                                   {s: float(s == slot) / 6 for s in SLOTS}).every_step
          for slot in (*SLOTS, None)}  # each slot as if it ran in one tick, and none
  forward, backward = (once[slot]["all-to-all"] - once[None]["all-to-all"]
                       for slot in ("forward_slot", "backward_slot"))
  # (less the few bytes of the routing's counts, which have no gradient to send back)
  assert forward > 0 and backward == pytest.approx(2 * forward, rel=1e-3)
  # The gradients are handed back inside the backward slot, so only in the 5 ticks it runs, one
  # micro-batch's [1, 1, 128, 128] in bf16 per device (before: in all 6 ticks); the activations
  # go outside the slots, every tick, where the send can overlap the tick's other slots.
  handed = {slot: once[slot]["collective-permute"] - once[None]["collective-permute"]
            for slot in ("forward_slot", "backward_slot")}
  assert handed == {"forward_slot": 0, "backward_slot": 128 * 128 * 2}
  ratio = reports["1f1b"].every_step["all-to-all"] / reports["gpipe"].every_step["all-to-all"]
  assert 1.3 <= ratio <= 1.6, ratio


def test_a_slot_counts_as_often_as_it_runs_and_what_it_nests_apart():
  """A conditional made under a slot's scope counts its collectives in the step's bytes for the
  share of the loop's trips given (4 of 6 here: a scalar all-reduce, 7 bytes, 4 times), and a
  conditional nested in its branch counts apart, as if taken, not at the slot's share."""
  mesh = jax.make_mesh((N,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.device_put(jnp.ones((8, 128)), NamedSharding(mesh, P("d")))

  def program(x):
    def tick(c, t):
      def slot(c):
        c = c * jnp.sum(c)
        return jax.lax.cond(t > 3, lambda c: c / jnp.sum(c * c), lambda c: c, c)
      with jax.named_scope("forward_slot"):
        return jax.lax.cond(t < 4, slot, lambda c: c, c), None
    return jax.lax.scan(tick, x, jnp.arange(6))[0]

  hlo = jax.jit(program).lower(x).compile().as_text()
  traffic = collective_traffic(hlo, N, "", {"forward_slot": 4 / 6})
  assert traffic.every_step["all-reduce"] == pytest.approx(4 * 2 * 7 / 8 * 4)
  assert traffic.if_taken["all-reduce"] == pytest.approx(4 * 2 * 7 / 8 * 4)
  assert collective_traffic(hlo, N, "").every_step["all-reduce"] == 0


def test_pipeline_hands_on_one_micro_batch_per_stage_boundary():
  """Inside the schedule's loop the stages exchange nothing but the hand-off: one
  collective-permute of a micro-batch's activations forward and one of their gradient backward,
  each sent by every stage but the last (no wrap-around without repeats) and in bfloat16 here
  (before: 3 forward and 4 backward, the roll's wrapped slice and self-sends, and the outputs and
  inputs broadcast over the stages by all-gathers and all-reduces)."""
  import re
  from jmoe.memory.traffic import compiled_texts
  config = tiny("parallel.pipeline=2", "parallel.pipeline_schedule=gpipe",
                "parallel.expert.expert=4", "model.num_layers=5",
                "train.batch_size=16", "train.micro_batch_size=4")
  optimized, partitioned = compiled_texts(config, make_layout(config.parallel))
  in_loop = [line for line in optimized.splitlines()
             if re.search(r" (collective-permute|all-gather|all-reduce)(-start)?\(", line)
             and "jvp())/while/body/" in line.replace("jvp()/while/body/", "jvp())/while/body/")
             and "/while/body/eval_jaxpr/vmap()" not in line]
  permutes = [line for line in in_loop if "collective-permute" in line]
  # one sequence of 128 tokens of width 128 per device (4 per micro-batch over dense data 4)
  assert len(permutes) == 2 and all("[1,1,128,128]" in p for p in permutes), permutes
  # (the CPU build widens them to float32 after partitioning, as jmoe/memory/traffic.py says)
  assert re.findall(r"= (\w+)\[1,1,128,128\]\S* collective-permute\(", partitioned) == [
      "bf16", "bf16"]
  assert all("{{0,4},{1,5},{2,6},{3,7}}" in p or "{{4,0},{5,1},{6,2},{7,3}}" in p
             for p in permutes), permutes
  big = [line for line in in_loop if "collective-permute" not in line
         and re.search(r"\[\d*,?\d*,?128,128\]", line)]
  assert not big, big  # no activation-sized all-gather or all-reduce in the loop


def test_script_prints_one_json_line(capsys):
  sys.path.insert(0, str(ROOT / "scripts"))
  import comm_volume
  assert comm_volume.main(["--config", str(ROOT / "configs/tiny_moe.py"),
                           "--config.moe.dispatcher=alltoall", "--config.parallel.expert.data=2",
                           "--config.parallel.expert.expert=4"]) == 0
  out = capsys.readouterr().out.strip().splitlines()
  assert "all-to-all / routed = 1.250" in "\n".join(out)
  record = json.loads(out[-1])
  assert record["devices"] == 8 and record["all_to_all_over_routed"] == pytest.approx(1.25, 0.01)
  assert set(record["bytes_per_device"]) == {"all-to-all", "all-gather", "reduce-scatter",
                                             "all-reduce", "collective-permute"}
