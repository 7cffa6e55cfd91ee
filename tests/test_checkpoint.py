"""Checkpoints: exact resume, resume onto other layouts and device counts, several processes,
preemption, damaged checkpoints, starting from another run's parameters, upcycling."""

import json
import logging
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from flags import command_env
from jmoe.checkpoint import Checkpointer
from jmoe.checkpoint.params import read_variables, save_model
from jmoe.config import ConfigError, ParallelConfig, load_config
from jmoe.data import first_batches
from jmoe.parallel import make_layout
from jmoe.train.loop import initial_state, train
from jmoe.train.loss import cross_entropy_sum
from jmoe.train.optimizer import make_optimizer
from jmoe.model.factory import model_factory
from jmoe.train.state import state_spec
from helpers import build, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_moe.py"
# A tiny model, saved at step 3 and 6 of 6; float32 so that other layouts agree closely.
OVERRIDES = ["model.d_model=32", "model.d_ff=64", "model.num_layers=3", "model.num_heads=4",
             "model.num_kv_heads=2", "model.head_dim=8", "moe.d_ff_expert=16", "data.seq_len=32",
             "data.max_corpus_bytes=300000", "train.batch_size=8", "train.steps=6",
             "train.warmup_steps=2", "train.log_every=1", "checkpoint.every=3",
             "moe.gemm=ragged_dot", "moe.balance.bias_update_rate=0.001"]
LAYOUTS = {  # name: (overrides, number of devices)
    "fsdp8_ep8": (["parallel.dense.data=1", "parallel.dense.fsdp=8", "parallel.expert.data=1",
                   "parallel.expert.expert=8"], 8),
    "tp2_ep4_etp2": (["parallel.dense.data=4", "parallel.dense.tensor=2",
                      "parallel.expert.data=1", "parallel.expert.expert=4",
                      "parallel.expert.tensor=2", "moe.dispatcher=alltoall"], 8),
    "fsdp2_tp2_ep2_on4": (["parallel.dense.data=1", "parallel.dense.fsdp=2",
                           "parallel.dense.tensor=2", "parallel.expert.data=2",
                           "parallel.expert.expert=2"], 4),
}


def config_for(layout, *more):
  return load_config(CONFIG, OVERRIDES + LAYOUTS[layout][0] + list(more))


def losses(records):
  return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted run on fsdp8_ep8: its workdir and losses by step."""
  workdir = tmp_path_factory.mktemp("reference")
  records = train(config_for("fsdp8_ep8"), workdir, progress=False)
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [3, 6]
  return workdir, losses(records)


def restore(workdir, step, spec):
  checkpointer = Checkpointer(workdir / "checkpoints", keep=1)
  state, _ = checkpointer.restore(step, spec.abstract, spec.shardings)
  checkpointer.close()
  return state


def stopped_at_3(reference, tmp_path):
  """A copy of the reference workdir as if the run had stopped after step 3."""
  workdir = tmp_path / "run"
  shutil.copytree(reference[0], workdir)
  shutil.rmtree(workdir / "checkpoints" / "6")
  return workdir


def test_a_damaged_latest_checkpoint_falls_back_and_resumes_bit_identically(reference, tmp_path,
                                                                             caplog):
  workdir = tmp_path / "run"
  shutil.copytree(reference[0], workdir)
  for path in (workdir / "checkpoints" / "6" / "state").rglob("*"):
    if path.is_file() and path.parent.name == "d":  # the array data files: cut in half
      path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
  records = train(config_for("fsdp8_ep8"), workdir, progress=False)
  assert "checkpoints/6 cannot be read" in caplog.text
  assert [p.name.split("-")[0] for p in (workdir / "corrupt_checkpoints").iterdir()] == ["6"]
  # Resumed from step 3 on the same layout: the same losses to the bit.
  assert losses(records) == {s: reference[1][s] for s in (4, 5, 6)}
  logged = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").open()]
  assert logged == [1, 2, 3, 4, 5, 6]  # steps 4-6 logged once, not twice


@pytest.mark.parametrize("layout", ["tp2_ep4_etp2", "fsdp2_tp2_ep2_on4"])
def test_resume_on_another_layout_and_device_count(reference, tmp_path, layout):
  workdir = stopped_at_3(reference, tmp_path)
  records = train(config_for(layout), workdir, progress=False,
                  devices=jax.devices()[:LAYOUTS[layout][1]])
  got = losses(records)
  assert sorted(got) == [4, 5, 6]
  for step, loss in got.items():
    np.testing.assert_allclose(loss, reference[1][step], rtol=1e-5)


def test_resuming_with_another_model_is_refused(reference, tmp_path):
  """By the setting that differs from the one the checkpoint records; a checkpoint that records
  none (an earlier jmoe saved it) by its first array of another shape."""
  workdir = stopped_at_3(reference, tmp_path)
  with pytest.raises(ConfigError, match=r"the checkpoint of step 3 in .* was saved with "
                                        r"moe.d_ff_expert 16, but this config has 24"):
    train(config_for("fsdp8_ep8", "moe.d_ff_expert=24"), workdir, progress=False)
  shutil.rmtree(workdir / "checkpoints" / "3" / "run")
  with pytest.raises(ConfigError, match=r"saved by a different model or optimizer: .*"
                                        r"moe_blocks/mlp/w_in_ED2F.* is float32\[2, 8, 32, 2, 16\] "
                                        r"there but float32\[2, 8, 32, 2, 24\]"):
    train(config_for("fsdp8_ep8", "moe.d_ff_expert=24"), workdir, progress=False)
  assert (workdir / "checkpoints" / "3" / "state").is_dir()  # nothing moved aside or lost


def test_load_params_starts_fresh_from_another_runs_model(reference, tmp_path):
  config = config_for("tp2_ep4_etp2", f"checkpoint.load_params={reference[0]}")
  layout = make_layout(config.parallel)
  spec = state_spec(config, layout, make_optimizer(config.train, config.precision.moments))
  empty = Checkpointer(tmp_path, keep=1)
  step, state, data_state = initial_state(config, spec, empty)
  empty.close()
  assert (step, data_state, int(state.step)) == (0, None, 0)
  saved = restore(reference[0], 6, spec)
  for a, b in zip(jax.tree.leaves((state.params, state.rest)),
                  jax.tree.leaves((saved.params, saved.rest))):
    np.testing.assert_array_equal(a, b)
    assert a.sharding == b.sharding  # placed for this run's layout
  assert all(float(np.abs(x).max()) == 0 for x in jax.tree.leaves(state.opt_state)
             if x.ndim)  # fresh Adam moments


def two_processes(workdir, overrides):
  """`python -m jmoe.train` as 2 processes of 4 CPU devices each, joined on localhost."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = command_env(4)
  return [subprocess.Popen(
      [sys.executable, "-m", "jmoe.train", "--config", str(CONFIG), "--workdir", str(workdir),
       "--no-progress", "--coordinator", f"localhost:{port}", "--num-processes", "2",
       "--process-id", str(i), *[f"--config.{o}" for o in overrides]],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]


def wait_for_steps(metrics, count, procs):
  deadline = time.time() + 240
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= count):
    for proc in procs:
      assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.2)


def test_two_processes_resume_and_save_like_one(reference, tmp_path):
  """2 processes x 4 CPU devices restore a one-process checkpoint, train, and save one that a
  single process restores; the last save staged (each process's arrays to the host in parts,
  each part beside the write of the one before)."""
  workdir = stopped_at_3(reference, tmp_path)
  procs = two_processes(workdir, OVERRIDES + LAYOUTS["tp2_ep4_etp2"][0]
                        + ["checkpoint.staging_gb=0.00002"])
  for proc in procs:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
  logged = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
  assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
  for r in logged[3:]:
    np.testing.assert_allclose(r["loss"], reference[1][r["step"]], rtol=1e-5)

  config = config_for("fsdp8_ep8")
  spec = state_spec(config, make_layout(config.parallel),
                    make_optimizer(config.train, config.precision.moments))
  mine, ref = restore(workdir, 6, spec), restore(reference[0], 6, spec)
  for a, b in zip(jax.tree.leaves(mine.params), jax.tree.leaves(ref.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_one_process_saves_replicated_arrays_without_compiling(tmp_path, caplog):
  """Orbax shares the writing of a replicated array among its replicas, slicing it with a
  compiled program per share; within one process jmoe writes it whole (the shares pay only when
  processes split the writing, as in the test above). The saved values are the array's."""
  mesh = jax.make_mesh((8,), ("data",))
  values = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
  state = {"replicated": jax.device_put(values, NamedSharding(mesh, PartitionSpec())),
           "split": jax.device_put(values + 1, NamedSharding(mesh, PartitionSpec("data")))}
  checkpointer = Checkpointer(tmp_path, keep=1, async_save=False)
  with jax.log_compiles(True), caplog.at_level(logging.DEBUG):
    checkpointer.save(1, state)
    checkpointer.wait()
  compiles = [r.getMessage() for r in caplog.records if "XLA compilation" in r.getMessage()]
  assert not compiles, compiles
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  restored, _ = checkpointer.restore(1, abstract, jax.tree.map(lambda x: x.sharding, state))
  checkpointer.close()
  np.testing.assert_array_equal(restored["replicated"], values)
  np.testing.assert_array_equal(restored["split"], values + 1)


def test_a_state_is_written_in_data_files_of_bounded_size(tmp_path, monkeypatch):
  """Each data file is written by one thread: a state larger than DATA_FILE_BYTES is spread over
  several files of about that size (so that many threads write it), and reads back whole."""
  from jmoe.checkpoint import writer
  monkeypatch.setattr(writer, "DATA_FILE_BYTES", 1 << 20)
  rng = np.random.default_rng(0)
  values = {f"w{i}": rng.standard_normal((256, 1024), np.float32) for i in range(24)}  # 24 MiB
  state = jax.tree.map(jax.numpy.asarray, values)
  checkpointer = Checkpointer(tmp_path, keep=1, async_save=False)
  checkpointer.save(1, state)
  checkpointer.wait()
  files = [p for p in (tmp_path / "1" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  sizes = sorted(p.stat().st_size for p in files)
  # (A file closes once past the target: up to two of these 1 MiB arrays; 2 GiB files: one.)
  assert len(files) >= 12 and sizes[-1] <= (2 << 20) + (64 << 10), sizes
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  restored, _ = checkpointer.restore(1, abstract, jax.tree.map(lambda x: x.sharding, state))
  checkpointer.close()
  for name, want in values.items():
    np.testing.assert_array_equal(restored[name], want)


def test_a_save_copies_on_the_devices_and_lets_training_go_on(tmp_path, monkeypatch):
  """With room on the devices, an async save copies the state there and returns: the arrays it
  was given may be donated to the next step (here deleted) while a thread takes the copy to the
  host; what is saved is the state as it was. A failure in that thread stops the next save."""
  from jmoe.checkpoint import manager
  mesh = jax.make_mesh((8,), ("data",))
  values = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
  make = lambda: {"split": jax.device_put(values, NamedSharding(mesh, PartitionSpec("data"))),
                  "replicated": jax.device_put(values + 1, NamedSharding(mesh, PartitionSpec()))}
  shardings = jax.tree.map(lambda x: x.sharding, make())
  # Room: the copy (64 bytes a shard of "split", 512 of "replicated") beside the peak.
  roomy = lambda device: {"bytes_limit": 10_000, "peak_bytes_in_use": 8_000}
  tight = lambda device: {"bytes_limit": 10_000, "peak_bytes_in_use": 9_450}  # (no shard fits)
  assert manager.device_copy(make(), tight) is None
  assert manager.device_copy(make(), lambda device: None) is None  # the host's own memory
  original = make()
  copy = manager.device_copy(original, roomy)
  jax.tree.map(lambda x: x.delete(), original)
  np.testing.assert_array_equal(copy["split"], values)
  assert copy["split"].sharding.is_equivalent_to(shardings["split"], 2)

  real_copy = manager.device_copy
  monkeypatch.setattr(manager, "device_copy", lambda tree, *_: real_copy(tree, roomy))
  checkpointer = Checkpointer(tmp_path / "checkpoints", keep=2)
  state = make()
  checkpointer.save(1, state, {"at": 1})
  assert checkpointer._thread is not None  # the copy goes to the host in a thread
  jax.tree.map(lambda x: x.delete(), state)  # (a train step donating the state)
  checkpointer.wait()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), make())
  restored, data = checkpointer.restore(1, abstract, shardings)
  np.testing.assert_array_equal(restored["split"], values)
  np.testing.assert_array_equal(restored["replicated"], values + 1)
  assert data == {"at": 1}

  def full(*args):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(checkpointer, "_start", full)
  checkpointer.save(2, make())
  with pytest.raises(ConfigError, match=r"saving the checkpoint of step 2 in .* failed "
                                        r"\(OSError: .*No space left on device\), so training "
                                        r"stopped; the checkpoint of step 1 is kept"):
    checkpointer.save(3, make())
  checkpointer.close()
  assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["1"]


def test_a_paced_save_takes_its_device_copy_to_the_host_one_array_at_a_time(tmp_path,
                                                                           monkeypatch):
  """With `paced_transfer`, the save's thread puts the state's device copy in page-locked host
  memory array by array, deleting each device array once it is there, and Orbax writes from
  those: the checkpoint holds the state as it was, restored onto the devices."""
  from jmoe.checkpoint import manager
  mesh = jax.make_mesh((8,), ("data",))
  values = {"split": np.arange(8 * 16, dtype=np.float32).reshape(8, 16),
            "replicated": np.arange(3, dtype=np.float32)}
  make = lambda: {"split": jax.device_put(values["split"], NamedSharding(mesh, PartitionSpec(
      "data"))), "replicated": jax.device_put(values["replicated"], NamedSharding(
          mesh, PartitionSpec()))}
  roomy = lambda device: {"bytes_limit": 1 << 30, "peak_bytes_in_use": 0}
  real_copy, copies, given = manager.device_copy, [], []
  monkeypatch.setattr(manager, "device_copy",
                      lambda tree, *_: copies.append(real_copy(tree, roomy)) or copies[-1])
  checkpointer = Checkpointer(tmp_path / "c", keep=1, paced_transfer=True)
  start = checkpointer._start
  monkeypatch.setattr(checkpointer, "_start",
                      lambda step, state, items: given.append(state) or start(step, state, items))
  state = make()
  checkpointer.save(1, state)
  jax.tree.map(lambda x: x.delete(), state)
  checkpointer.wait()
  assert {k: x.sharding.memory_kind for k, x in given[0].items()} == {
      "split": "pinned_host", "replicated": "pinned_host"}
  assert all(copies[0][k].is_deleted() for k in values)
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in values.items()}
  restored, _ = checkpointer.restore(1, abstract, {k: x.sharding for k, x in make().items()})
  for name, want in values.items():
    np.testing.assert_array_equal(restored[name], want)
    assert restored[name].sharding.memory_kind == "device"
  checkpointer.close()


def test_a_saves_transfer_waits_for_the_loops_lead_of_steps(tmp_path, monkeypatch):
  """With `transfer_lead` N, a save copied on the devices takes the copy to the host only once
  the loop has launched N steps after it (`stepped`), at `wait` if it comes first, or after
  TRANSFER_LEAD_S; every way, the checkpoint holds the state of the save's step."""
  import threading
  import time
  from jmoe.checkpoint import manager
  roomy = lambda device: {"bytes_limit": 1 << 30, "peak_bytes_in_use": 0}
  real_copy = manager.device_copy
  monkeypatch.setattr(manager, "device_copy", lambda tree, *_: real_copy(tree, roomy))
  checkpointer = Checkpointer(tmp_path / "c", keep=3, transfer_lead=3)
  started, start = threading.Event(), checkpointer._start
  monkeypatch.setattr(checkpointer, "_start",
                      lambda *args: started.set() or start(*args))
  state = lambda v: {"w": jax.numpy.full((4, 8), v, np.float32)}
  checkpointer.save(1, state(1.0))
  for _ in range(2):
    checkpointer.stepped()
  assert not started.wait(0.5)  # (two steps of three: the transfer waits)
  checkpointer.stepped()
  assert started.wait(5.0)
  checkpointer.save(2, state(2.0))  # (the first save is waited for; this one's lead is not met)
  started.clear()
  checkpointer.stepped()
  checkpointer.wait()  # (starts it at once)
  assert started.is_set()
  monkeypatch.setattr(manager, "TRANSFER_LEAD_S", 0.2)
  began = time.perf_counter()
  checkpointer.save(3, state(3.0))
  started.clear()
  assert started.wait(5.0) and time.perf_counter() - began >= 0.2
  checkpointer.wait()
  abstract = {"w": jax.ShapeDtypeStruct((4, 8), np.float32)}
  for step in (1, 2, 3):
    restored, _ = checkpointer.restore(step, abstract, {"w": state(0.0)["w"].sharding})
    np.testing.assert_array_equal(restored["w"], np.full((4, 8), float(step), np.float32))
  checkpointer.close()


def test_a_staged_save_takes_the_state_to_the_host_a_part_at_a_time(tmp_path, monkeypatch):
  """With `staging_gb`, a save whose state nothing changes while it is written (the caller waits
  for it, or it is the save's own copy on the devices) takes the arrays to the host in parts of
  at most that many bytes (here one array a part), each part while the one before is written
  and only once the one before that is written (two parts on the host at most), and one the
  caller waits for returns written; a save beside training without a copy still takes every
  array to the host before it returns (the next step may overwrite them). All read back whole."""
  import asyncio
  from jmoe.checkpoint import manager, writer
  events = []
  monkeypatch.setattr(writer.TransferOrder, "on_transfer_end",
                      lambda self, key: events.append(("to host", jax.tree_util.keystr(key))))
  monkeypatch.setattr(writer.TransferOrder, "on_write_end",
                      lambda self, key: events.append(("written", jax.tree_util.keystr(key))))
  write_part = writer.orbax_arrays._async_serialize_replica_slices

  async def slow_write(*args, **kwargs):  # (a part's write outlasts the next part's transfer)
    await asyncio.sleep(0.3)
    return await write_part(*args, **kwargs)

  monkeypatch.setattr(writer.orbax_arrays, "_async_serialize_replica_slices", slow_write)
  values = {f"w{i}": np.full((8, 64), i, np.float32) for i in range(3)}  # 2 KiB each
  state = jax.tree.map(jax.numpy.asarray, values)
  keys = [f"['{name}']" for name in values]
  one_by_one = [("to host", keys[0]), ("to host", keys[1]), ("written", keys[0]),
                ("to host", keys[2]), ("written", keys[1]), ("written", keys[2])]
  all_first = [("to host", key) for key in keys] + [("written", key) for key in keys]
  roomy = lambda device: {"bytes_limit": 1 << 30, "peak_bytes_in_use": 0}
  real_copy = manager.device_copy
  staged = Checkpointer(tmp_path / "s", keep=5, staging_gb=3000 / 1e9)
  plain = Checkpointer(tmp_path / "p", keep=5, waited_parts_gb=0)
  # (checkpointer, step, room for a copy, waited, the order wanted, at save's return)
  cases = [(staged, 1, False, True, one_by_one, one_by_one),  # (the run's last: written)
           (staged, 2, True, False, one_by_one, None),  # (its own copy, in a thread)
           (staged, 3, False, False, all_first, all_first[:3]),  # (training goes on beside it)
           (plain, 1, False, True, all_first, all_first[:3]),  # (waited, Orbax's way)
           (plain, 2, True, False, all_first, None)]
  for checkpointer, step, room, waited, want, at_return in cases:
    monkeypatch.setattr(manager, "device_copy", lambda tree, *_, room=room: (
        real_copy(tree, roomy) if room else None))
    events.clear()
    checkpointer.save(step, state, waited=waited)
    if at_return is not None:
      assert events[:len(at_return)] == at_return and len(events) >= len(at_return), step
    assert (str(step) in {p.name for p in checkpointer.directory.iterdir()}) == (
        at_return == one_by_one), step  # (finished at once only when it was staged, waited for)
    checkpointer.wait()
    assert sorted(events, key=want.index) == want and events == want, (step, events)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  for checkpointer, step in ((staged, 1), (staged, 2), (staged, 3), (plain, 1), (plain, 2)):
    restored, _ = checkpointer.restore(step, abstract, jax.tree.map(lambda x: x.sharding, state))
    for name, array in values.items():
      np.testing.assert_array_equal(restored[name], array)
  for checkpointer in (staged, plain):
    checkpointer.close()
  monkeypatch.setattr(writer, "TransferPriority", None)  # (an Orbax without them)
  with pytest.raises(ConfigError, match=r"checkpoint.staging_gb=2 needs the transfer priorities "
                                        r"of orbax-checkpoint 0.12.*set it to 0"):
    Checkpointer(tmp_path / "n", keep=1, staging_gb=2)
  Checkpointer(tmp_path / "n", keep=1).close()
  assert not (tmp_path / "n").exists()


def test_a_waited_save_writes_each_part_as_soon_as_it_is_on_the_host(tmp_path, monkeypatch):
  """Not staged, a save the caller waits for takes the state to the host in parts of
  `waited_parts_gb` and starts each part's write as soon as it is there, beside the writes of
  the parts before (here each part's write holds on until the last part's has started: written
  one after another, it would never end), returns written, and stores every array's metadata
  (Orbax's store rewrites one file: parts storing their own would drop each other's). Beside
  training, or with `waited_parts_gb=0`, every array goes to the host before the first write."""
  import functools
  from orbax.checkpoint._src.metadata import array_metadata_store
  from jmoe.checkpoint import writer
  events = []
  monkeypatch.setattr(writer.TransferOrder, "on_transfer_end",
                      lambda self, key: events.append(("to host", jax.tree_util.keystr(key))))
  # (jmoe's writer keeps no store of array metadata; one with Orbax's must keep every array's)
  monkeypatch.setattr(writer, "ArrayWriter", functools.partial(
      writer.ArrayWriter, array_metadata_store=array_metadata_store.Store()))
  monkeypatch.setattr(writer, "_registered", None)
  try:
    parts_written_together(tmp_path, monkeypatch, writer, events)
  finally:  # (Orbax's registry keeps the last writer: the next save registers jmoe's own again)
    monkeypatch.undo()
    writer._registered = None


def parts_written_together(tmp_path, monkeypatch, writer, events):
  import asyncio
  write_part = writer.orbax_arrays._async_serialize_replica_slices
  names = [f"w{i}" for i in range(4)]
  started, last_started = [], asyncio.Event()

  async def held_write(on_host, infos, *args, **kwargs):
    name = jax.tree_util.keystr(infos[0].keypath)
    started.append(name)
    if name == f"['{names[-1]}']":
      last_started.set()
    await asyncio.wait_for(last_started.wait(), 20)
    return await write_part(on_host, infos, *args, **kwargs)

  monkeypatch.setattr(writer.orbax_arrays, "_async_serialize_replica_slices", held_write)
  values = {name: np.full((8, 64), i, np.float32) for i, name in enumerate(names)}  # 2 KiB
  state = jax.tree.map(jax.numpy.asarray, values)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  keys = [f"['{name}']" for name in names]
  checkpointer = Checkpointer(tmp_path / "c", keep=5, waited_parts_gb=3000 / 1e9)
  checkpointer.save(1, state, waited=True)
  assert (tmp_path / "c" / "1").is_dir()  # (written before save returned)
  assert started == keys and events == [("to host", key) for key in keys]
  checkpointer.wait()
  restored, _ = checkpointer.restore(1, abstract, jax.tree.map(lambda x: x.sharding, state))
  for name, array in values.items():
    np.testing.assert_array_equal(restored[name], array)
  stored = [path.read_text() for path in (tmp_path / "c" / "1" / "state").rglob("*")
            if path.is_file() and "array_metadatas" in str(path)]
  assert len(stored) == 1, stored
  assert sorted(entry["array_metadata"]["param_name"]
                for entry in json.loads(stored[0])["array_metadatas"]) == names
  # (beside training, and without parts: all of it on the host first, in one write)
  monkeypatch.setattr(writer.orbax_arrays, "_async_serialize_replica_slices", write_part)
  whole = Checkpointer(tmp_path / "w", keep=5, waited_parts_gb=0)
  for n, (chosen, waited) in enumerate([(checkpointer, False), (whole, True)], start=2):
    events.clear()
    chosen.save(n, state, waited=waited)
    assert events == [("to host", key) for key in keys], n
    chosen.wait()
    restored, _ = chosen.restore(n, abstract, jax.tree.map(lambda x: x.sharding, state))
    np.testing.assert_array_equal(restored["w3"], values["w3"])
  for chosen in (checkpointer, whole):
    chosen.close()


def test_the_room_for_a_copy_leaves_out_the_copies_made_before(monkeypatch):
  """Once a state's copy has lived beside a step, a device's peak counts both; the room for the
  next save's copy is judged by the peak before the first copy (or what is in use, if more), so
  a state whose copy fits beside the step once fits at every save."""
  from jmoe.checkpoint import manager
  from jmoe.checkpoint.snapshot import CopyRoom
  state = {"w": jax.device_put(np.ones(250, np.float32), jax.devices()[0])}  # 1,000 bytes
  figures = {"bytes_limit": 10_000, "peak_bytes_in_use": 8_000, "bytes_in_use": 3_000}
  room = CopyRoom(lambda device: dict(figures))
  assert manager.device_copy(state, room) is not None  # 8,000 + 1,000 <= 9,500
  room.copied = True
  figures["peak_bytes_in_use"] = 9_000  # (the step beside the copy)
  assert manager.device_copy(state, lambda device: dict(figures)) is None  # (the raw peak)
  assert manager.device_copy(state, room) is not None
  figures["bytes_in_use"] = 8_600  # (more in use now than the step's peak: counted)
  assert manager.device_copy(state, room) is None
  assert CopyRoom(lambda device: None)(jax.devices()[0]) is None  # (the host's own memory)
  checkpointer = Checkpointer("/nonexistent/checkpoints", keep=1)
  figures.update(peak_bytes_in_use=8_000, bytes_in_use=3_000)
  monkeypatch.setattr(checkpointer._room, "_stats", lambda device: dict(figures))
  assert checkpointer.copy_for_save(state) is not None and checkpointer._room.copied
  figures["peak_bytes_in_use"] = 9_000
  assert checkpointer.copy_for_save(state) is not None
  checkpointer.close()


def test_old_steps_are_removed_by_several_threads(tmp_path, monkeypatch):
  """A step past `keep` is removed by jmoe's `StepRemover` in Orbax's place: its files (a
  checkpoint's data files share one directory) unlinked by several threads, `write_threads`
  after a save beside training and every core after one the caller waits for; files already
  gone are no failure, a file that cannot go is named."""
  import threading
  from jmoe.checkpoint import remover, writer
  tree = tmp_path / "step"
  (tree / "d").mkdir(parents=True)
  for i in range(40):
    (tree / "d" / f"{i}").write_bytes(b"x" * 100)
  (tree / "meta").write_text("{}")
  unlink, seen = remover.os.unlink, set()

  def slow_unlink(path, **how):  # (the directories' own rmtree passes `dir_fd`)
    if not how:
      seen.add(threading.get_ident())
      time.sleep(0.005)
    unlink(path, **how)

  monkeypatch.setattr(remover.os, "unlink", slow_unlink)
  remover.remove_in_parallel(tree, 4)
  assert not tree.exists() and 2 <= len(seen) <= 4
  (tree / "d").mkdir(parents=True)
  (tree / "d" / "gone").write_text("")
  (tree / "d" / "stays").write_text("")
  monkeypatch.setattr(remover.os, "unlink", lambda path, **how: unlink(path, **how) if how else
                      (_ for _ in ()).throw(FileNotFoundError(2, "gone") if path.endswith("gone")
                                            else PermissionError(13, "denied")))
  with pytest.raises(OSError, match=r"removing .*step failed: .*stays: denied"):
    remover.remove_in_parallel(tree, 2)
  monkeypatch.setattr(remover.os, "unlink", unlink)

  removed = []
  real = remover.remove_in_parallel
  monkeypatch.setattr(remover, "remove_in_parallel",
                      lambda path, threads: removed.append((path.name, threads)) or real(path,
                                                                                        threads))
  monkeypatch.setattr(writer, "host_cores", lambda: 16)
  checkpointer = Checkpointer(tmp_path / "c", keep=1, write_threads=3)
  assert isinstance(checkpointer._manager._checkpoint_deleter, remover.StepRemover)
  state = {"w": jax.numpy.ones((4, 8))}
  for step, waited in ((1, False), (2, False), (3, True)):
    checkpointer.save(step, state, waited=waited)
    checkpointer.wait()
  assert removed == [("1", 3), ("2", 16)]
  assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["3"]
  checkpointer.close()
  monkeypatch.setattr(remover, "deleter", None)  # (an Orbax without that deleter: its own stays)
  own = Checkpointer(tmp_path / "o", keep=1)
  assert not isinstance(own._manager._checkpoint_deleter, remover.StepRemover)
  own.close()


@pytest.mark.parametrize("staging_gb", [0, 3000 / 1e9])
def test_a_waited_save_reports_where_its_time_went(tmp_path, monkeypatch, caplog, staging_gb):
  """A save the caller waits for is timed in phases from its call (`Checkpointer.last_save`,
  logged): its arrays on the host, written, finished, and the removal of the step past `keep`
  within the finishing; whole or staged. Each phase here is slowed by a known time, so a mark
  taken at the wrong moment (or not taken) fails. A save beside training is not timed."""
  import asyncio
  from jmoe.checkpoint import remover, writer
  write_part = writer.orbax_arrays._async_serialize_replica_slices

  async def slow_write(*args, **kwargs):
    await asyncio.sleep(0.3)
    return await write_part(*args, **kwargs)

  real_remove = remover.remove_in_parallel
  monkeypatch.setattr(writer.orbax_arrays, "_async_serialize_replica_slices", slow_write)
  monkeypatch.setattr(remover, "remove_in_parallel",
                      lambda *args: time.sleep(0.4) or real_remove(*args))
  checkpointer = Checkpointer(tmp_path / "c", keep=1, staging_gb=staging_gb)
  state = {f"w{i}": jax.numpy.full((8, 64), i, np.float32) for i in range(3)}  # 2 KiB each
  rows = NamedSharding(jax.make_mesh((8,), ("x",)), PartitionSpec("x"))
  state["w0"] = jax.device_put(state["w0"], rows)  # (a sharded array counts whole)
  checkpointer.save(1, state)  # (beside training: not timed)
  checkpointer.wait()
  assert checkpointer.last_save is None
  with caplog.at_level(logging.INFO, logger="jmoe"):
    checkpointer.save(2, state, waited=True)
    checkpointer.wait()
  times = checkpointer.last_save
  assert times.step == 2 and times.gib == pytest.approx(3 * 2048 / 2**30)
  # (staged: three parts, each written 0.3 s after it reached the host, the next taken beside)
  assert 0 <= times.on_host_s < times.written_s
  assert times.written_s >= (0.9 if staging_gb else 0.3) - 0.05
  assert times.removing_s >= 0.4 and times.finished_s >= times.written_s + 0.4
  assert f"step 2 saved in {times.finished_s:.1f} s (0.0 MiB: on the host after" in caplog.text
  assert "removing steps past checkpoint.keep" in caplog.text
  checkpointer.close()
  line = writer.SaveTimes(step=600, gib=31.3, on_host_s=2.65, written_s=3.56, finished_s=4.17,
                          removing_s=0.53).summary()
  assert line == ("step 600 saved in 4.2 s (31.3 GiB: on the host after 2.6 s, written after "
                  "3.6 s, 0.5 s of it removing steps past checkpoint.keep)")
  assert writer.SaveTimes(step=1, gib=0.5, on_host_s=None, written_s=None, finished_s=0.04,
                          removing_s=0.0).summary() == "step 1 saved in 0.0 s (512.0 MiB)"


def test_page_locked_memory_is_reserved_up_to_a_limit(monkeypatch):
  """`pinned.reserve` allocates the state's arrays in order, all of them or, with a limit, until
  they reach it (a staged save's two parts)."""
  from jmoe.checkpoint import pinned
  put = []
  monkeypatch.setattr(pinned.jax, "device_put", lambda x, sharding: put.append(x.shape) or x)
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  tree = [jax.ShapeDtypeStruct((n, 250), np.float32, sharding=sharding) for n in (1, 2, 3, 4)]
  pinned.reserve(tree)
  assert put == [(1, 250), (2, 250), (3, 250), (4, 250)]
  put.clear()
  pinned.reserve(tree, 3_000)  # 1,000 + 2,000 bytes reach it
  assert put == [(1, 250), (2, 250)]


def test_saves_beside_training_hold_tensorstore_to_their_threads(tmp_path, monkeypatch):
  """A save written in the background (training goes on beside it: copied on the devices first,
  or not where they lack room) writes through TensorStore pools of `write_threads` threads each,
  one context for all its arrays, compressed; one that training waits for (`waited`, or a
  Checkpointer without async saves) through pools of three threads per core (or
  `waited_write_threads`; None: TensorStore's own), uncompressed unless `compress_waited` (the
  zarr metadata on disk says which); all read back whole, the two kinds side by side in one
  directory. The default beside training leaves two of the cores this process may use to it."""
  from jmoe.checkpoint import manager, writer
  pools, contexts = [], set()
  parent = writer.ArrayWriter.serialize

  async def seen(self, values, infos, args=None):
    written = await parent(self, values, infos, args)  # (which sets each info's pools)
    pools.extend(({k: v.get("limit") for k, v in info.ts_context.spec.to_json().items()
                   if k.endswith("_concurrency")}, info.use_compression) for info in infos)
    contexts.update(id(info.ts_context) for info in infos)
    return written

  monkeypatch.setattr(writer.ArrayWriter, "serialize", seen)
  roomy = lambda device: {"bytes_limit": 1 << 30, "peak_bytes_in_use": 0}
  real_copy = manager.device_copy
  values = {f"w{i}": np.full((8, 64), i, np.float32) for i in range(3)}
  state = jax.tree.map(jax.numpy.asarray, values)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  bounded = {"data_copy_concurrency": 3, "file_io_concurrency": 3}
  own = {"file_io_concurrency": 128}  # (Orbax's setting; data copies: one thread per core)
  tripled = {"data_copy_concurrency": 3 * writer.host_cores(),
             "file_io_concurrency": 3 * writer.host_cores()}  # (a waited save's: three per core)
  in_background = Checkpointer(tmp_path / "a", keep=3, write_threads=3)
  in_foreground = Checkpointer(tmp_path / "f", keep=3, async_save=False, write_threads=3)
  compressing = Checkpointer(tmp_path / "c", keep=3, write_threads=3, compress_waited=True)
  held = Checkpointer(tmp_path / "h", keep=3, write_threads=3, waited_write_threads=5)
  tensorstores = Checkpointer(tmp_path / "t", keep=3, write_threads=3, waited_write_threads=None)
  # (a save the caller waits for is never copied on the devices: it returns once on the host)
  cases = [(in_background, 1, real_copy, False, True, (bounded, True)),  # (copied on the devices)
           (in_background, 2, None, False, False, (bounded, True)),  # (no room: Orbax's own thread)
           (in_background, 3, real_copy, True, False, (tripled, False)),  # (the run's last)
           (in_foreground, 1, real_copy, False, False, (tripled, False)),
           (compressing, 1, real_copy, True, False, (tripled, True)),  # (compress_waited)
           (held, 1, real_copy, True, False,
            ({"data_copy_concurrency": 5, "file_io_concurrency": 5}, False)),
           (tensorstores, 1, real_copy, True, False, (own, False))]
  for checkpointer, step, copy, waited, threaded, want in cases:
    monkeypatch.setattr(manager, "device_copy", (lambda tree, *_: copy(tree, roomy)) if copy else
                        (lambda tree, *_: None))
    pools.clear()
    contexts.clear()
    checkpointer.save(step, state, waited=waited)
    assert (checkpointer._thread is not None) == threaded
    checkpointer.wait()
    assert pools == [want] * len(values) and len(contexts) == 1, (step, pools)
    assert stored_compressors(checkpointer.directory / str(step) / "state") == (
        {name: want[1] for name in values}), step
  for checkpointer, step in ((in_background, 1), (in_background, 2), (in_background, 3),
                             (in_foreground, 1), (compressing, 1), (held, 1), (tensorstores, 1)):
    restored, _ = checkpointer.restore(step, abstract, jax.tree.map(lambda x: x.sharding, state))
    for name, array in values.items():
      np.testing.assert_array_equal(restored[name], array)
  for checkpointer in (in_background, in_foreground, compressing, held, tensorstores):
    checkpointer.close()
  for cores, threads in ((16, 7), (64, 31), (3, 1), (2, 1), (1, 1)):
    monkeypatch.setattr(writer, "host_cores", lambda: cores)
    assert writer.write_threads(0) == threads and writer.waited_threads(0) == 3 * cores
  assert writer.write_threads(5) == 5 and writer.write_threads(None) is None
  assert writer.waited_threads(5) == 5 and writer.waited_threads(None) is None
  assert writer.host_cores() >= 1


def stored_compressors(directory) -> dict[str, bool]:
  """Whether each array of the Orbax item at `directory` is stored compressed, by the zarr
  metadata in its OCDBT database (what a reader goes by): jmoe's checkpoints are zarr 2, whose
  `.zarray` names a compressor or null (an array found in no `.zarray` is missing here)."""
  import tensorstore as ts
  store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{directory}"}).result()
  return {key.decode().removesuffix("/.zarray"):
          json.loads(store.read(key).result().value)["compressor"] is not None
          for key in store.list().result() if key.decode().endswith("/.zarray")}


def test_sigterm_saves_and_the_same_command_resumes(tmp_path):
  env = command_env(2)

  def command(steps):
    overrides = [o for o in OVERRIDES if not o.startswith(("train.steps", "checkpoint.every"))]
    return [sys.executable, "-m", "jmoe.train", "--config", str(CONFIG), "--workdir",
            str(tmp_path), "--no-progress", f"--config.train.steps={steps}",
            *[f"--config.{o}" for o in overrides]]

  metrics = tmp_path / "metrics.jsonl"
  proc = subprocess.Popen(command(100_000), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  wait_for_steps(metrics, 3, [proc])
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
  checkpointer = Checkpointer(tmp_path / "checkpoints", keep=1)
  stopped = checkpointer.latest_step()
  checkpointer.close()
  assert f"stopped by SIGTERM after step {stopped}" in err
  assert json.loads(metrics.read_text().splitlines()[-1])["step"] <= stopped

  result = subprocess.run(command(stopped + 2), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"resuming from {tmp_path / 'checkpoints' / str(stopped)}" in result.stderr
  records = [json.loads(line) for line in metrics.read_text().splitlines()]
  steps = [r["step"] for r in records]
  assert steps[-2:] == [stopped + 1, stopped + 2] and len(steps) == len(set(steps))
  # What every run writes besides checkpoints.
  for key in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "tokens_per_s", "lr"):
    assert all(np.isfinite(r[key]) for r in records), key
  assert np.asarray(records[0]["expert_load"]).shape == (2, 8)  # two MoE layers, 8 experts
  assert any((tmp_path / "tensorboard").iterdir())
  assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == stopped + 2


def test_sigterm_to_one_of_two_processes_stops_both_at_one_step(tmp_path):
  overrides = [o for o in OVERRIDES if not o.startswith(("train.steps", "checkpoint.every"))]
  procs = two_processes(tmp_path, overrides + ["train.steps=100000", "model.num_layers=2"])
  wait_for_steps(tmp_path / "metrics.jsonl", 3, procs)
  procs[1].send_signal(signal.SIGTERM)
  errors = [proc.communicate(timeout=120)[1] for proc in procs]
  assert [proc.returncode for proc in procs] == [143, 143], errors[0][-3000:]
  checkpointer = Checkpointer(tmp_path / "checkpoints", keep=1)
  stopped = checkpointer.latest_step()
  checkpointer.close()
  for err in errors:
    assert f"stopped by SIGTERM after step {stopped}" in err


# Upcycling -------------------------------------------------------------------------------------

DENSE = dict(model=dict(d_ff=64), moe=dict(first_k_dense=3))
UPCYCLED = {
    # copies of the MLP, softmax with renormalised top-k, random router
    "copies": (dict(num_experts=4, top_k=2, d_ff_expert=64, first_k_dense=0), None),
    # 4 slices, 2 copies, one layer left dense, a shared expert, softmax over the chosen
    "fine_grained": (dict(num_experts=8, top_k=4, d_ff_expert=16, first_k_dense=1,
                          num_shared_experts=1, router=dict(score="softmax_topk")), None),
    # sigmoid without renormalisation, scaled, group-limited: equal under uniform routing
    "sigmoid_groups": (dict(num_experts=8, top_k=2, d_ff_expert=32, first_k_dense=0,
                            router=dict(score="sigmoid", norm_topk_prob=False,
                                        scaling_factor=2.5, num_groups=2, topk_groups=1)), 0.0),
}


def mean_loss(model, tokens_BN):
  logits_BSV, _ = model(tokens_BN[:, :-1])
  return float(cross_entropy_sum(logits_BSV, tokens_BN[:, 1:])) / tokens_BN[:, 1:].size


@pytest.mark.parametrize("name", list(UPCYCLED))
def test_upcycled_model_computes_what_the_dense_model_does(tmp_path, name):
  from jmoe.checkpoint.params import load_model
  from jmoe.checkpoint.upcycle import upcycle
  moe, router_std = UPCYCLED[name]
  dense_config = tiny_config(**DENSE)
  dense = build(dense_config)
  save_model(tmp_path / "dense", nnx.state(dense), dense_config)
  config = tiny_config(model=dict(d_ff=64), moe=moe)
  upcycle(tmp_path / "dense", config, tmp_path / "moe", router_std)
  _, model = load_model(tmp_path / "moe", make_layout(ParallelConfig(), jax.devices()[:1]))
  tokens = first_batches(config)[0]["tokens"]
  dense_logits, _ = dense(tokens[:, :-1])
  moe_logits, stats = model(tokens[:, :-1])
  np.testing.assert_allclose(moe_logits, dense_logits, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(mean_loss(model, tokens), mean_loss(dense, tokens), rtol=1e-6)
  if router_std is None:  # a random router spreads tokens over the copies
    assert float(np.min(np.max(stats.router.load_E, axis=-1))) < 0.9


def test_upcycling_from_the_command_line_then_training(tmp_path):
  """`jmoe.convert upcycle` on a trained dense run; the MoE run's first loss is the dense one's."""
  dense_overrides = [o for o in OVERRIDES if not o.startswith("moe.balance")] + [
      "model.d_ff=64", "moe.first_k_dense=3", "train.steps=3", "checkpoint.every=0"]
  dense = load_config(CONFIG, dense_overrides)
  train(dense, tmp_path / "dense", progress=False, devices=jax.devices()[:1])
  moe_overrides = dense_overrides[:-3] + ["moe.first_k_dense=0", "moe.num_experts=8",
                                          "moe.top_k=4", "moe.d_ff_expert=16"]
  result = subprocess.run(
      [sys.executable, "-m", "jmoe.convert", "upcycle", "--checkpoint", str(tmp_path / "dense"),
       "--config", str(CONFIG), "--out", str(tmp_path / "moe"),
       *[f"--config.{o}" for o in moe_overrides]],
      cwd=ROOT, capture_output=True, text=True, timeout=240,
      env=command_env())
  assert result.returncode == 0, result.stderr[-3000:]
  assert "wrote" in result.stdout

  def first_lm_loss(config_overrides, source, workdir):
    config = load_config(CONFIG, config_overrides + ["train.steps=3",
                                                     f"checkpoint.load_params={source}"])
    return train(config, workdir, progress=False, devices=jax.devices()[:1])[0]["lm_loss"]

  dense_loss = first_lm_loss(dense_overrides[:-2], tmp_path / "dense", tmp_path / "d2")
  moe_loss = first_lm_loss(moe_overrides, tmp_path / "moe", tmp_path / "m2")
  np.testing.assert_allclose(moe_loss, dense_loss, rtol=1e-5)


def test_upcycling_refuses_what_cannot_match(tmp_path):
  from jmoe.checkpoint.upcycle import upcycle
  dense_config = tiny_config(**DENSE)
  save_model(tmp_path / "dense", nnx.state(build(dense_config)), dense_config)
  with pytest.raises(ConfigError, match=r"moe.num_experts \(6\) and moe.top_k \(2\) must be "
                                        r"multiples of it"):
    upcycle(tmp_path / "dense", tiny_config(model=dict(d_ff=64), moe=dict(
        num_experts=6, top_k=2, d_ff_expert=16)), tmp_path / "out")
  with pytest.raises(ConfigError, match=r"model.d_model \(48 here, 32 in the checkpoint\)"):
    upcycle(tmp_path / "dense", tiny_config(model=dict(d_ff=64, d_model=48)), tmp_path / "out")
  with pytest.raises(ConfigError, match="nothing does not exist"):
    read_variables(tmp_path / "nothing", None, None)
  abstract = nnx.state(nnx.eval_shape(model_factory(dense_config)))
  with pytest.raises(ConfigError, match=r"neither model/ \(a model checkpoint\) nor a checkpoint"):
    read_variables(tmp_path, abstract,
                   make_layout(ParallelConfig(), jax.devices()[:1]).shardings(abstract))


def _conversion_model(tmp_path: pathlib.Path, part_bytes: int):
  """(config, model state, model bytes, largest part): a model of many small parts, saved in
  tmp_path/ckpt; its largest part is one layer of one variable, or with a small `part_bytes` a
  block of experts within it (one expert at least)."""
  config = load_config(ROOT / "configs" / "tiny_qwen3_moe.py", [
      "model.num_layers=16", "model.d_model=128", "moe.num_experts=16", "moe.d_ff_expert=128",
      "model.vocab_size=512"])
  model = nnx.state(build(config))
  save_model(tmp_path / "ckpt", model, config)
  flat = nnx.to_flat_state(model)
  layer = lambda path, v: v[...][0] if str(path[0]).endswith("blocks") else v[...]
  experts = lambda path: str(path[-1]).split("_")[-1].startswith("E")  # w_in_ED2F, w_out_EFD
  part = max(max(layer(path, v).nbytes for path, v in flat if not experts(path)),
             *(min(layer(path, v).nbytes, max(part_bytes, layer(path, v)[0].nbytes))
               for path, v in flat if experts(path)))
  model_bytes = sum(v[...].nbytes for _, v in flat)
  assert model_bytes > 20 * part  # the bounds below are far from holding the model
  return config, model, model_bytes, part


def _assert_read_back(directory: pathlib.Path, config, model) -> None:
  abstract = nnx.state(nnx.eval_shape(model_factory(config)))
  one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  back = read_variables(directory, abstract, jax.tree.map(lambda _: one_device, abstract))
  for (path, want), (_, got) in zip(nnx.to_flat_state(model), nnx.to_flat_state(back)):
    np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want[...]), err_msg=str(path))


@pytest.mark.parametrize("part_bytes", [1 << 30, 200_000])
def test_import_hf_holds_a_few_parts_never_the_model(tmp_path, part_bytes):
  """import-hf makes and writes one part of one variable at a time (a layer; with a small
  `part_bytes`, a block of experts): the numpy memory it holds at its peak (tracemalloc sees every
  numpy array) is a few of the largest parts, a small share of the model, and the checkpoint it
  writes is the model, value for value."""
  import tracemalloc
  from jmoe.hf.convert import export_hf, import_hf
  config, model, model_bytes, part = _conversion_model(tmp_path, part_bytes)
  export_hf(tmp_path / "ckpt", tmp_path / "hf")
  tracemalloc.start()
  try:
    import_hf(tmp_path / "hf", tmp_path / "back", part_bytes=part_bytes)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < 5 * part, (peak, part, model_bytes)
  largest_layer = max(v[...][0].nbytes for path, v in nnx.to_flat_state(model)
                      if str(path[0]).endswith("blocks"))
  if part_bytes < largest_layer:  # the experts' layers were made in blocks
    assert peak < largest_layer, (peak, largest_layer)
  _assert_read_back(tmp_path / "back", config, model)


@pytest.mark.parametrize("part_bytes", [1 << 30, 200_000])
def test_export_hf_reads_a_part_at_a_time_never_the_model(tmp_path, monkeypatch, part_bytes):
  """export-hf reads one part of one variable at a time from the checkpoint (whose chunks each
  hold one layer, of one expert for the experts' weights, so a part's read touches only its own
  chunks) and holds at most one safetensors file besides: no read is larger than a part, each
  part is read once, the reads alive at once are at most the file being filled (whose tensors
  may be views of them) and two parts, and the numpy memory at its peak (tracemalloc, which does
  not see tensorstore's reads) is the file and a few parts. What it writes imports back to the
  model, value for value."""
  import tracemalloc
  from jmoe.hf.convert import export_hf, import_hf
  from jmoe.checkpoint.params import open_variables
  from jmoe.checkpoint.streamed import StoredArray
  config, model, model_bytes, part = _conversion_model(tmp_path, part_bytes)
  abstract = nnx.state(nnx.eval_shape(model_factory(config)))
  stored = jax.tree_util.tree_flatten_with_path(open_variables(tmp_path / "ckpt", abstract))[0]
  for path, leaf in stored:
    names = [str(key.key) for key in path]
    lead = (names[0].endswith("blocks")) + (names[-1] in ("w_in_ED2F", "w_out_EFD"))
    chunk = leaf.store.chunk_layout.read_chunk.shape
    assert chunk == (1,) * lead + leaf.shape[lead:], (names, chunk)
  # tensorstore's reads are not numpy's allocations: counted here while they live.
  reads, live, read = [], [0, 0], StoredArray.read

  def counted(self, region=()):
    value = read(self, region)
    reads.append(value.nbytes)
    live[0] += value.nbytes
    live[1] = max(live)
    weakref.finalize(value, lambda n=value.nbytes: live.__setitem__(0, live[0] - n))
    return value

  monkeypatch.setattr(StoredArray, "read", counted)
  shard_bytes = part
  tracemalloc.start()
  try:
    export_hf(tmp_path / "ckpt", tmp_path / "hf", shard_bytes=shard_bytes, part_bytes=part_bytes)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert max(reads) <= part and sum(reads) == model_bytes  # each part read once, on its own
  assert live[1] <= shard_bytes + 2 * part, (live[1], part)  # reads the file's tensors view
  assert peak < shard_bytes + 5 * part, (peak, part, model_bytes)
  import_hf(tmp_path / "hf", tmp_path / "back")
  _assert_read_back(tmp_path / "back", config, model)


# ---- data: exact resume from every step ----

def short_documents(directory: pathlib.Path, count: int = 40) -> pathlib.Path:
  """Text files of 3 to 70 characters: rows of 33 tokens end inside a document at some steps and
  exactly at a document's end at others, the two kinds of input position a packer saves."""
  rng = np.random.default_rng(5)
  directory.mkdir(parents=True, exist_ok=True)
  for i in range(count):
    (directory / f"{i:03d}.txt").write_text(f"d{i}" + "xyz "[:int(rng.integers(1, 4))]
                                            * int(rng.integers(0, 17)))
  return directory


@pytest.mark.parametrize("packing", ["concat", "none"])
def test_resume_from_every_step_reads_what_the_uninterrupted_run_read(tmp_path, monkeypatch,
                                                                      packing):
  """A run of 4 steps, checkpointed after each, against resumes from steps 1, 2 and 3: the same
  losses to the bit (one compiled step shared by all, so that only the restored state and input
  position can differ)."""
  import jmoe.train.loop as loop
  original, compiled = loop.fitting_schedule, []

  def compile_once(*args, **kwargs):
    if not compiled:
      compiled.append(original(*args, **kwargs))
    return compiled[0]

  monkeypatch.setattr(loop, "fitting_schedule", compile_once)
  config = config_for("fsdp8_ep8", "train.steps=4", "checkpoint.every=1", "checkpoint.keep=10",
                      f"data.source={short_documents(tmp_path / 'docs')}",
                      f"data.packing={packing}")
  expected = losses(train(config, tmp_path / "run", progress=False))
  assert sorted(expected) == [1, 2, 3, 4]
  for step in (1, 2, 3):
    workdir = tmp_path / f"from{step}"
    shutil.copytree(tmp_path / "run", workdir)
    for later in range(step + 1, 5):
      shutil.rmtree(workdir / "checkpoints" / str(later))
    got = losses(train(config, workdir, progress=False))
    assert got == {s: expected[s] for s in range(step + 1, 5)}, (step, got, expected)


def loader_case(packing: str, masked: bool):
  """Documents of 1 to 40 tokens (with a loss mask where `masked`) and the batches of 3 rows of 17
  tokens that 5 of 8 rows read."""
  import grain
  from jmoe.data.pipeline import KEYS, MASKED_KEYS, Batches
  rng = np.random.default_rng(1)
  documents = []
  for _ in range(60):
    tokens = rng.integers(0, 256, int(rng.integers(1, 41))).astype(np.int32)
    documents.append({"tokens": tokens, "loss_mask": rng.integers(0, 2, tokens.size)}
                     if masked else tokens)
  order = grain.MapDataset.source(documents).shuffle(seed=3).repeat(None)
  return lambda: Batches(order, [0, 2, 3, 5, 7], 8, 17, packing,
                         MASKED_KEYS if masked else KEYS)


@pytest.mark.parametrize("packing", ["concat", "none"])
@pytest.mark.parametrize("masked", [False, True])
def test_the_input_position_saved_after_any_batch_resumes_exactly(packing, masked):
  """The position after each of 30 batches, through JSON as a checkpoint keeps it, gives back the
  batches that followed it (documents of 1 to 40 tokens: rows end inside documents, at their
  ends, and span several)."""
  from jmoe.data.pipeline import Prefetcher
  make = loader_case(packing, masked)
  loader = Prefetcher(make(), depth=2)
  positions, batches = [json.loads(json.dumps(loader.state))], []
  for _ in range(30):
    batches.append(next(loader))
    positions.append(json.loads(json.dumps(loader.state)))
  loader.close()
  for step, position in enumerate(positions[:-1]):
    resumed = make()
    resumed.set_state(position)
    for expected in batches[step:step + 4]:
      got = next(resumed)
      for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=f"after batch {step}")


# --- page-locked host memory reserved before the first save ---------------------------------

def test_pinned_reserve_copies_each_arrays_shape_and_placement_without_reading_it(monkeypatch):
  """`reserve_in_thread` takes each array's shape, dtype and sharding when called, so a state
  donated (deleted) right after does not stop it, and it puts an array of each into page-locked
  host memory, placed as the original; what it made is freed when it ends."""
  import jax.numpy as jnp
  from jmoe.checkpoint import pinned
  mesh = jax.make_mesh((len(jax.devices()),), ("d",))
  tree = {"a": jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, PartitionSpec("d"))),
          "b": jnp.ones(3, jnp.bfloat16), "step": 7}
  assert pinned.has_pinned_host(tree)
  made = []
  put = jax.device_put

  def recording_put(x, sharding):
    made.append(put(x, sharding))
    return made[-1]
  monkeypatch.setattr(pinned.jax, "device_put", recording_put)
  wanted = [(x.shape, x.dtype, x.sharding.with_memory_kind("pinned_host"))
            for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
  thread = pinned.reserve_in_thread(tree)
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array):
      x.delete()  # as the next step's donation would
  thread.join()
  assert [(x.shape, x.dtype, x.sharding) for x in made] == wanted
  assert all(x.is_deleted() for x in made)


def test_checkpointer_reserves_page_locked_memory_only_for_gpu_async_saves(tmp_path, monkeypatch):
  from jmoe.checkpoint import pinned
  started = []
  monkeypatch.setattr(pinned, "reserve_in_thread",
                      lambda tree, limit: started.append((tree, limit)))
  tree = {"a": jax.numpy.ones(4)}
  Checkpointer(tmp_path / "c", keep=1).reserve_host_memory(tree)
  assert started == []  # the CPU's saves take no page-locked copy
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  Checkpointer(tmp_path / "c", keep=1, async_save=False).reserve_host_memory(tree)
  assert started == []
  Checkpointer(tmp_path / "c", keep=1).reserve_host_memory(tree)
  assert started == [(tree, None)]  # (all of it)
  Checkpointer(tmp_path / "c", keep=1, staging_gb=2.5).reserve_host_memory(tree)
  assert started[1:] == [(tree, 5e9)]  # (two parts of a staged save)


def test_a_staged_checkpointer_reserves_the_whole_state_where_no_copy_will_fit(tmp_path,
                                                                              monkeypatch):
  """Page-locked memory reserved for two parts of a staged save is made the whole state's before
  training starts where the compiled step leaves no room for the state's copy, or the devices
  give no memory figures (those saves take all of it to the host at once), and left so where
  the copy fits, or without staging."""
  from jmoe.checkpoint import pinned
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pinned, "reserve_in_thread", lambda tree, limit: None)
  whole = []
  monkeypatch.setattr(pinned, "reserve", lambda tree, limit=None: whole.append((tree, limit)))
  tree = {"a": jax.numpy.ones((4, 256)), "b": jax.numpy.ones(256, jax.numpy.bfloat16), "n": 3}
  nbytes = 4 * 256 * 4 + 256 * 2  # (on one device)
  stats = lambda limit: lambda device: limit and {"bytes_limit": limit, "peak_bytes_in_use": 0}
  for staging, step_bytes, limit, reserved in [
      (2.5, 1000, 1000 + nbytes + 300, False),  # (the copy fits in 95% beside the step)
      (2.5, 1000, 1000 + nbytes, True),  # (it does not)
      (2.5, 1000, None, True),  # (no memory figures: no copy is taken, as in device_copy)
      (0.0, 1000, 1000 + nbytes, False)]:  # (not staged: all of it reserved already)
    whole.clear()
    checkpointer = Checkpointer(tmp_path / "c", keep=1, staging_gb=staging)
    checkpointer.reserve_host_memory(tree)
    checkpointer.expect_step(step_bytes, stats(limit))
    if reserved:
      (leaves, limit), = whole
      assert limit is None and [(x.shape, x.dtype) for x in leaves[:2]] == [
          ((4, 256), np.float32), ((256,), jax.numpy.bfloat16)]
    else:
      assert whole == []
    checkpointer.expect_step(step_bytes, stats(1))  # (told once)
    assert len(whole) == reserved


def test_the_states_device_copy_is_one_program_compiled_before_the_first_save(tmp_path,
                                                                             monkeypatch):
  """Where saves copy the state on its devices (GPU, async, one process), `reserve_host_memory`
  (called while the train step compiles) compiles that copy in a thread, one program for the
  whole state: the first save's copy compiles nothing, and holds the same values, shardings and
  weak types in new buffers; non-array leaves pass through."""
  import jax.numpy as jnp
  from jmoe.checkpoint import manager, pinned
  mesh = jax.make_mesh((len(jax.devices()),), ("d",))
  tree = {"a": jax.device_put(jnp.arange(64.0).reshape(16, 4),
                              NamedSharding(mesh, PartitionSpec("d"))),
          "b": jnp.ones(3, jnp.bfloat16), "scale": jnp.asarray(2.0), "step": 7}
  assert tree["scale"].weak_type and not tree["b"].weak_type
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pinned, "reserve_in_thread", lambda *args: None)  # (only the compile here)
  checkpointer = Checkpointer(tmp_path / "c", keep=1)
  checkpointer.reserve_host_memory(tree)
  assert checkpointer._compiling
  checkpointer.wait_reserved()
  roomy = lambda device: {"bytes_limit": 1 << 30, "peak_bytes_in_use": 0}

  def compiling(*args, **kwargs):
    raise AssertionError("the save's copy was compiled at the save")
  with monkeypatch.context() as m:
    m.setattr(jax, "jit", compiling)
    copy = manager.device_copy(tree, roomy)
  assert copy["step"] == 7
  for name in ("a", "b", "scale"):
    new, old = copy[name], tree[name]
    np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    assert (new.sharding, new.dtype, new.weak_type) == (old.sharding, old.dtype, old.weak_type)
    assert new.addressable_shards[0].data.unsafe_buffer_pointer() != (
        old.addressable_shards[0].data.unsafe_buffer_pointer())
  with monkeypatch.context() as m:  # (another kind of state: compiled when first copied)
    m.setattr(jax, "jit", compiling)
    with pytest.raises(AssertionError, match="compiled at the save"):
      manager.device_copy({"c": jnp.ones(5)}, roomy)
  checkpointer.close()


def test_a_save_copies_on_the_devices_what_fits_and_puts_the_rest_in_page_locked_memory(
    tmp_path, monkeypatch, caplog):
  """Where the devices have room beside the step for part of the state's copy, the copy takes
  the arrays that fit (in order, each where it fits beside those before it) and puts the others
  in page-locked host memory, in one program compiled when the step's bytes are known (before
  the first save); the save writes both kinds and restores the state as it was after the
  originals are overwritten. Without page-locked memory, or where nothing fits, no copy."""
  import jax.numpy as jnp
  from jmoe.checkpoint import manager, pinned
  mesh = jax.make_mesh((len(jax.devices()),), ("d",))
  values = {"a": np.arange(64.0, dtype=np.float32).reshape(16, 4),  # 32 bytes a device
            "b": np.arange(3, dtype=np.float32).astype(jnp.bfloat16),  # 6 bytes, on one device
            "scale": np.float32(2.0)}  # 4 bytes
  make = lambda: {"a": jax.device_put(values["a"], NamedSharding(mesh, PartitionSpec("d"))),
                  "b": jnp.asarray(values["b"]), "scale": jnp.asarray(values["scale"]),
                  "step": 7}
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pinned, "reserve_in_thread", lambda *args: None)
  # 950 of 1,000 bytes usable, 940 the step's: room for "b" and "scale" (10 bytes), not "a"
  step_stats = lambda device: {"bytes_limit": 1000}
  at_save = lambda device: {"bytes_limit": 1000, "peak_bytes_in_use": 940}
  leaves = jax.tree.leaves(make())
  assert manager.copy_split(leaves, at_save) == frozenset({0})
  assert manager.copy_split(leaves, at_save, peak=900) == frozenset()
  assert manager.copy_split(leaves, at_save, peak=950) is None

  def compiling(*args, **kwargs):
    raise AssertionError("the save's copy was compiled at the save")
  # (whole; in parts of one array, written as they arrive; one array at a time to the host)
  for n, how in enumerate([{}, {"staging_gb": 16 / 1e9}, {"paced_transfer": True}]):
    tree = make()
    checkpointer = Checkpointer(tmp_path / f"c{n}", keep=1, **how)
    checkpointer.reserve_host_memory(tree)
    caplog.clear()
    with caplog.at_level("INFO", logger="jmoe"):
      checkpointer.expect_step(940, step_stats)
    assert "room for 0.0 of the state's 0.0 GiB beside the step" in caplog.text
    checkpointer.wait_reserved()
    with monkeypatch.context() as m:
      m.setattr(jax, "jit", compiling)
      copy = manager.device_copy(tree, at_save)
    assert {k: copy[k].sharding.memory_kind for k in values} == {
        "a": "pinned_host", "b": "device", "scale": "device"}
    assert copy["a"].sharding.is_equivalent_to(
        tree["a"].sharding.with_memory_kind("pinned_host"), 2)
    assert copy["step"] == 7
    assert manager.device_copy(tree, at_save, whole=True) is None  # (every array, or none)
    for name in values:  # (the next step overwrites the state)
      tree[name].delete()
    checkpointer.save(1, {k: copy[k] for k in values}, {"at": 1}, copied=True)
    checkpointer.wait()
    abstract = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype)
                for k, v in values.items()}
    restored, data = checkpointer.restore(1, abstract, {k: x.sharding for k, x in make().items()
                                                        if k in values})
    for name, want in values.items():
      np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(want))
      assert restored[name].sharding.memory_kind == "device"
    assert data == {"at": 1}
    checkpointer.close()
  monkeypatch.setattr(pinned, "has_pinned_host", lambda tree: False)
  assert manager.device_copy(make(), at_save) is None
  assert manager.device_copy(make(), lambda device: {"bytes_limit": 1000,
                                                     "peak_bytes_in_use": 0}) is not None


def test_a_failed_saves_directory_made_again_by_writes_still_ending_is_removed_for_good(tmp_path):
  """The writes of a failed save that were in flight make its directory again as they end (the
  full-disk test once found one after the process ended): `remove_settled` removes it each time
  it comes back until it has stayed away its quiet time, and returns once it has."""
  import threading
  from jmoe.checkpoint.disk import UNFINISHED, remove_settled
  partial = tmp_path / f"2{UNFINISHED}"
  (partial / "state.orbax-checkpoint-tmp" / "d").mkdir(parents=True)
  ends = []

  def late_writes():  # three writes ending 0.3 s apart, each making its directories again
    for _ in range(3):
      time.sleep(0.3)
      (partial / "state.orbax-checkpoint-tmp" / "d").mkdir(parents=True, exist_ok=True)
      (partial / "state.orbax-checkpoint-tmp" / "d" / "chunk").write_bytes(b"x" * 64)
      ends.append(time.monotonic())

  writer = threading.Thread(target=late_writes)
  writer.start()
  start = time.monotonic()
  assert remove_settled(partial, quiet=0.5, limit=10.0) == ""
  done = time.monotonic()
  writer.join()
  assert len(ends) == 3 and not partial.exists()
  assert done - ends[-1] >= 0.5 and done - start < 5.0
  # Nothing coming back: it returns after the quiet time; a write still ending after `limit` is
  # left for the next start to remove.
  partial.mkdir()
  start = time.monotonic()
  assert remove_settled(partial, quiet=0.2) == "" and not partial.exists()
  assert 0.2 <= time.monotonic() - start < 2.0
