"""Several processes joined into one run, the ways clusters start them. Four processes joined by
JMOE_* variables (any launcher, Kubernetes) train like one process on the same 8 devices (two
processes joined by flags: tests/test_checkpoint.py); SLURM's and MPI's variables lead to JAX's
own detection."""

import json
import pathlib
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from flags import command_env
from jmoe import distributed
from jmoe.config import ConfigError, load_config
from jmoe.train.loop import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
OVERRIDES = ["model.d_model=32", "model.d_ff=64", "moe.d_ff_expert=16", "model.num_layers=1",
             "moe.first_k_dense=0",
             "data.seq_len=32", "train.steps=3", "data.max_corpus_bytes=300000",
             "train.warmup_steps=1", "train.log_every=1", "parallel.expert.expert=4",
             "parallel.expert.data=-1", "moe.dispatcher=alltoall"]
CONFIG = ROOT / "configs" / "tiny_moe.py"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_four_processes_train_like_one(tmp_path):
  one = [r["loss"] for r in train(load_config(CONFIG, OVERRIDES), tmp_path / "one",
                                  progress=False)]
  port, procs = free_port(), []
  for i in range(4):
    env = command_env(2, JMOE_COORDINATOR=f"localhost:{port}", JMOE_NUM_PROCESSES="4",
                      JMOE_PROCESS_ID=str(i))
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "jmoe.train", "--config", str(CONFIG), "--workdir",
         str(tmp_path / "four"), "--no-progress", *[f"--config.{o}" for o in OVERRIDES]],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  errors = []
  for proc in procs:
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    errors.append(err)
  four = [json.loads(line)["loss"] for line in (tmp_path / "four" / "metrics.jsonl").open()]
  assert len(one) == 3
  np.testing.assert_allclose(four, one, rtol=1e-5)
  assert "process 0 of 4, 2 local of 8 devices" in errors[0]  # process 0 logs; the others do not
  assert not any("compiled the train step" in err for err in errors[1:])


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"SLURM_NTASKS": "1"}, None),  # a one-task SLURM job is a single process
    ({"SLURM_NTASKS": "4"}, ()),  # JAX reads the rest of SLURM's variables itself
    ({"OMPI_COMM_WORLD_SIZE": "2"}, ()),
    ({"JMOE_COORDINATOR": "h:1", "JMOE_NUM_PROCESSES": "2", "JMOE_PROCESS_ID": "1"},
     ("h:1", 2, 1)),
])
def test_how_a_process_learns_about_the_others(monkeypatch, env, expected):
  for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JMOE_COORDINATOR", "JMOE_NUM_PROCESSES",
              "JMOE_PROCESS_ID"):
    monkeypatch.delenv(key, raising=False)
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *args: calls.append(args))
  monkeypatch.setattr(distributed, "_quiet_other_processes", lambda: None)
  assert distributed.initialize() == (expected is not None)
  assert calls == ([] if expected is None else [expected])


def test_incomplete_process_settings_are_refused(monkeypatch):
  monkeypatch.setenv("JMOE_COORDINATOR", "h:1")
  monkeypatch.delenv("JMOE_NUM_PROCESSES", raising=False)
  with pytest.raises(ConfigError, match="JMOE_NUM_PROCESSES"):
    distributed.initialize()
  with pytest.raises(ConfigError, match="needs the coordinator address"):
    distributed.initialize(coordinator="h:1")


def in_two_processes(args: list[str], env: dict | None = None) -> list[tuple[int, str, str]]:
  """(exit code, stdout, stderr) of `python -m jmoe.convert ARGS` run as 2 processes x 4
  devices."""
  port, procs = free_port(), []
  for i in range(2):
    environ = command_env(4, JMOE_COORDINATOR=f"localhost:{port}", JMOE_NUM_PROCESSES="2",
                          JMOE_PROCESS_ID=str(i), **(env or {}))
    procs.append(subprocess.Popen([sys.executable, "-m", "jmoe.convert", *args], cwd=ROOT,
                                  env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True))
  return [(proc.returncode, *outs) for proc, outs in
          zip(procs, [proc.communicate(timeout=300) for proc in procs])]


def test_conversion_spread_over_two_processes_writes_what_one_process_writes(tmp_path):
  """export-hf in 2 processes, each reading and writing its share of the parts, writes the
  tensors (and config.json) one process writes; import-hf in 2 processes, each writing its share
  of the layers, writes the checkpoint the model came from, value for value."""
  from flax import nnx
  from jmoe.hf.convert import export_hf
  from jmoe.hf.files import SafetensorsReader
  from jmoe.checkpoint.params import read_variables, save_model
  from jmoe.model.factory import model_factory
  from helpers import build
  config = load_config(ROOT / "configs" / "tiny_qwen3_moe.py", ["model.d_model=32", "model.d_ff=64",
                                                                 "moe.d_ff_expert=16"])
  model = nnx.state(build(config))
  save_model(tmp_path / "ckpt", model, config)
  export_hf(tmp_path / "ckpt", tmp_path / "one", shard_bytes=60_000)
  two = in_two_processes(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out",
                          str(tmp_path / "two"), "--shard-gb", str(60_000 / 2**30)])
  for code, _, err in two:
    assert code == 0, err[-3000:]
  assert "wrote" in two[0][1] and "wrote" not in two[1][1]  # the first process reports
  reference = SafetensorsReader(tmp_path / "one")
  other = SafetensorsReader(tmp_path / "two")
  shares = re.search(r"by process: (\d+) (\d+)\n", two[0][2])  # each wrote its own share
  assert shares and min(int(shares[1]), int(shares[2])) > 0, two[0][2][-2000:]
  assert int(shares[1]) + int(shares[2]) == len(other.weight_map)
  assert len(set(reference.weight_map.values())) > 1  # several shards, with an index
  assert set(other.weight_map) == set(reference.weight_map)
  for key in reference.weight_map:
    np.testing.assert_array_equal(other(key), reference(key), err_msg=key)
  assert (tmp_path / "two" / "config.json").read_text() == (tmp_path / "one" /
                                                            "config.json").read_text()
  assert not list((tmp_path / "two").glob(".parts-*"))
  for code, _, err in in_two_processes(["import-hf", "--hf-dir", str(tmp_path / "two"), "--out",
                                        str(tmp_path / "back")]):
    assert code == 0, err[-3000:]
  abstract = nnx.state(nnx.eval_shape(model_factory(config)))
  one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  back = read_variables(tmp_path / "back", abstract, jax.tree.map(lambda _: one_device, abstract))
  for (path, want), (_, got) in zip(nnx.to_flat_state(model), nnx.to_flat_state(back)):
    np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want[...]), err_msg=str(path))
  assert not list(tmp_path.glob(".back.writing-*"))
