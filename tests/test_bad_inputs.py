"""Bad input, as a hostile but fair user gives it: every case ends in one short message that names
what is wrong, a non-zero exit (or, where the input is merely odd, a notice), no traceback, and
leaves every file saved before it as it was (hashed before and after).

Commands run in this process through their `main(argv)` (what `python -m ...` runs), so most
cases cost no compilation: a bad input is refused before anything is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import pathlib
import sys
from typing import Callable

import jax
import numpy as np
import pytest

from flags import command_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
TINY = ["--config.model.d_model=32", "--config.model.num_layers=2", "--config.model.num_heads=4",
        "--config.model.num_kv_heads=2", "--config.model.head_dim=8", "--config.model.d_ff=64",
        "--config.moe.num_experts=8", "--config.moe.d_ff_expert=16",
        "--config.train.batch_size=8", "--config.train.steps=2", "--config.train.warmup_steps=1",
        "--config.data.seq_len=32", "--config.data.max_corpus_bytes=200000",
        "--config.precision.compute=float32", "--config.checkpoint.async_save=false"]
CONFIG = str(ROOT / "configs" / "tiny_moe.py")


@dataclasses.dataclass
class Result:
  code: int
  err: str  # standard error and jmoe's log


def run(main: Callable[[list[str]], int], *argv: str) -> Result:
  """A command's `main(argv)` in this process, its exit code and everything it told the user."""
  err = io.StringIO()
  handlers = logging.getLogger("jmoe").handlers
  streams = [h.stream for h in handlers if isinstance(h, logging.StreamHandler)]
  try:
    for h in handlers:  # not setStream: it flushes the old stream, which may be closed by now
      if isinstance(h, logging.StreamHandler):
        h.stream = err
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
      try:
        code = main(list(argv))
      except SystemExit as e:  # argparse's own usage errors
        code = e.code if isinstance(e.code, int) else 1
  finally:
    for h, stream in zip([h for h in handlers if isinstance(h, logging.StreamHandler)], streams):
      h.stream = stream
  return Result(code, err.getvalue())


def train(*argv):
  from jmoe.train.__main__ import main
  return run(main, *argv)


def convert(*argv):
  from jmoe.convert import main
  return run(main, *argv)


def score(*argv):
  from jmoe.score import main
  return run(main, *argv)


def prepare(*argv):
  from jmoe.data.prepare import main
  return run(main, *argv)


def hashes(*roots: pathlib.Path) -> dict[str, str]:
  found = {}
  for root in roots:
    paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for p in paths:
      found[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
  return found


def refused(result: Result, message: str, code: int = 2) -> None:
  """One short message matching `message`, exit `code`, no traceback."""
  assert result.code == code, (result.code, result.err[-2000:])
  assert "Traceback" not in result.err, result.err[-3000:]
  assert message in result.err or __import__("re").search(message, result.err), result.err[-2000:]


# ---- configs ----

def write(path: pathlib.Path, text: str | bytes) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
  return path


@pytest.mark.parametrize("text, message", [
    ("def get_config(:\n", r"bad\.py:1: .*syntax"),
    ("def get_config():\n  return None\n", "get_config\\(\\) returned None"),
    ("def get_config():\n  return {'model': 3}\n", "must be a group of keys"),
    ("import not_a_module\ndef get_config():\n  pass\n", "No module named 'not_a_module'"),
    ("def get_config():\n  raise RuntimeError('boom')\n", "get_config\\(\\) failed: RuntimeError: boom"),
    ("x = 1\n", "has no get_config"),
])
def test_bad_config_files(tmp_path, text, message):
  path = write(tmp_path / "bad.py", text)
  refused(train("--config", str(path), "--workdir", str(tmp_path / "run")), message)
  assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.parametrize("override, message", [
    ("train.lr=1e999", "train.lr must be a finite number, got inf"),
    ("train.lr=nan", "train.lr must be a finite number, got nan"),
    ("moe.capacity_factor=inf", "moe.capacity_factor must be a finite number"),
    ("train.steps=0", "train.steps must be positive"),
    ("train.max_bad_steps=0", "train.max_bad_steps must be positive"),
    ("moe.dispatcher=ring", r"moe.dispatcher must be one of \['allgather', 'alltoall'\]"),
    ("model.family=llama", "model.family must be one of"),
    ("moe.gemm=cublas", "moe.gemm must be one of"),
    ("train.remat=some", "train.remat must be one of"),
    ("precision.moments=float16", "precision.moments must be one of"),
    ("model.attention_kernel=flash", "model.attention_kernel must be one of"),
    ("parallel.expert.tensor=3", "multiplies to|cannot share|does not divide"),
    ("moe.d_ff_expert=15 parallel.expert.tensor=2",
     r"moe.d_ff_expert \(15\) must be a multiple of the expert-tensor size \(2,"),
    ("data.seq_len=31 train.batch_size=4 parallel.dense.data=4 parallel.dense.tensor=2",
     "choose data.seq_len or the micro-batch"),
    ("train.batch_size=4", r"must split evenly over the 8 data x fsdp devices"),
    ("model.scan_unroll=0", "model.scan_unroll must be positive"),
    ("nope.key=1", "no config group 'nope'"),
    ("train.stepz=3", "unknown key 'train.stepz'"),
    ("train.steps=three", "must be a int"),
    ("data.source=/does/not/exist", "/does/not/exist does not exist"),
])
def test_bad_overrides_are_refused_before_anything_is_built(tmp_path, override, message):
  result = train("--config", CONFIG, "--workdir", str(tmp_path / "run"), *TINY,
                 *(f"--config.{o}" for o in override.split()))
  refused(result, message)
  assert not (tmp_path / "run" / "config.json").exists()


# ---- data ----

RANDOM = np.random.default_rng(0).bytes(5000) + b"\xff\xfe"


def shards(tmp_path, vocab=264) -> pathlib.Path:
  """Token shards written by `jmoe.data.prepare` from a few text files."""
  for i in range(6):
    write(tmp_path / "docs" / f"{i}.txt", f"document {i} " * 200)
  result = prepare("--source", str(tmp_path / "docs"), "--out", str(tmp_path / "tokens"))
  assert result.code == 0, result.err
  return tmp_path / "tokens"


def data_case(tmp_path, name):
  """(data.source, expected message) for each bad source."""
  if name == "random bytes as text":
    return str(write(tmp_path / "r.txt", RANDOM)), r"r.txt is not UTF-8 text"
  if name == "a non-UTF-8 line in text":
    return str(write(tmp_path / "l.txt", "fine\n".encode() * 50 + "caf\xe9\n".encode("latin-1"))), \
        "l.txt is not UTF-8 text"
  if name == "random bytes as JSONL":
    return str(write(tmp_path / "r.jsonl", RANDOM)), "r.jsonl: the line at byte 0 is"
  if name == "a non-UTF-8 line in JSONL":
    good = json.dumps({"text": "hello " * 30}).encode() + b"\n"
    return str(write(tmp_path / "l.jsonl", b'{"text": "caf\xe9"}\n' + good * 20)), \
        "is not UTF-8 text"
  if name == "a JSONL line without the text field":
    return str(write(tmp_path / "k.jsonl", json.dumps({"body": "x " * 50}) + "\n")), \
        "has no text field 'text' \\(set data.text_key\\)"
  if name == "random bytes as Parquet":
    return str(write(tmp_path / "r.parquet", RANDOM)), "r.parquet is not a readable Parquet file"
  if name == "an empty file":
    return str(write(tmp_path / "e.txt", b"")), "e.txt is empty"
  if name == "a directory with no text files":
    write(tmp_path / "d" / "a.bin", b"x")
    return str(tmp_path / "d"), "contains no"
  if name == "a glob that matches nothing":
    return str(tmp_path / "none" / "*.jsonl"), "contains no"
  if name == "token shards without their .bin":
    directory = shards(tmp_path)
    next(directory.glob("*.bin")).unlink()
    return str(directory), r"lacks .*\.bin, which its index.json names"
  if name == "token shards with a damaged index.json":
    directory = shards(tmp_path)
    (directory / "index.json").write_text('{"shards": [')
    return str(directory), "index.json is damaged"
  if name == "token shards with ids past the vocabulary":
    directory = shards(tmp_path)
    binary = next(directory.glob("*.bin"))
    index = json.loads((directory / "index.json").read_text())
    ids = np.memmap(binary, dtype=index["dtype"], mode="r+")
    ids[:] = 300  # beyond vocab_size 264, while index.json still says max_id < 264
    ids.flush()
    return str(directory), "outside the model's vocabulary \\[0, 264\\)"
  raise KeyError(name)


@pytest.mark.parametrize("name", [
    "random bytes as text", "a non-UTF-8 line in text", "random bytes as JSONL",
    "a non-UTF-8 line in JSONL", "a JSONL line without the text field", "random bytes as Parquet",
    "an empty file", "a directory with no text files", "a glob that matches nothing",
    "token shards without their .bin", "token shards with a damaged index.json",
    "token shards with ids past the vocabulary"])
def test_bad_data_is_refused_before_compiling(tmp_path, name):
  source, message = data_case(tmp_path, name)
  before = hashes(tmp_path)
  result = train("--config", CONFIG, "--workdir", str(tmp_path / "run"), *TINY,
                 f"--config.data.source={source}", "--config.data.shuffle=false")
  refused(result, message)
  assert "compiled the train step" not in result.err
  assert {k: v for k, v in hashes(tmp_path).items() if "/run/" not in k} == before


def test_prepare_refuses_random_parquet(tmp_path):
  source = write(tmp_path / "r.parquet", RANDOM)
  refused(prepare("--source", str(source), "--out", str(tmp_path / "out")),
          "r.parquet is not a readable Parquet file")


# ---- workdirs ----

@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
  """A workdir after 2 steps, with its checkpoint; tests work on copies of it."""
  workdir = tmp_path_factory.mktemp("trained") / "run"
  result = train("--config", CONFIG, "--workdir", str(workdir), *TINY)
  assert result.code == 0, result.err[-2000:]
  return workdir


@pytest.fixture
def workdir(trained, tmp_path) -> pathlib.Path:
  import shutil
  copy = tmp_path / "run"
  shutil.copytree(trained, copy)
  return copy


def again(workdir, *overrides):
  return train("--config", CONFIG, "--workdir", str(workdir), *TINY, *overrides)


@pytest.mark.parametrize("override, message", [
    ("--config.model.d_model=48", "was saved by a different model or optimizer"),
    ("--config.model.vocab_size=300", "was saved by a different model or optimizer"),
    ("--config.moe.num_experts=16", "was saved by a different model or optimizer"),
])
def test_a_refused_resume_leaves_the_workdir_as_it_was(workdir, override, message):
  before = hashes(workdir)
  refused(again(workdir, override), message)
  assert hashes(workdir) == before  # config.json too: the refused config is not written


def test_a_second_run_on_a_workdir_is_refused_while_the_first_holds_it(workdir):
  from jmoe.train.workdir import WorkdirLock
  before = hashes(workdir)
  with WorkdirLock(workdir):
    refused(again(workdir, "--config.train.steps=4"),
            r"is in use by process \d+ on .* \(this process: close\(\) the other Trainer first\)")
    assert hashes(workdir) == {**before, **hashes(workdir / "run.lock")}
  assert not (workdir / "run.lock").exists()


def test_a_lock_left_by_a_dead_process_is_taken_over(workdir):
  import socket
  (workdir / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 7,
                                                "started": "then", "command": "gone"}))
  result = again(workdir, "--config.train.steps=3")
  assert result.code == 0, result.err[-2000:]
  assert "taking over" in result.err and not (workdir / "run.lock").exists()


def test_a_lock_of_another_host_is_respected(workdir):
  (workdir / "run.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "now",
                                                "command": "train"}))
  refused(again(workdir, "--config.train.steps=3"),
          r"in use by process 1 on elsewhere .* delete .*run.lock")


def test_no_readable_checkpoint_stops_instead_of_starting_over(workdir):
  for f in (workdir / "checkpoints").rglob("*"):
    if f.is_file() and f.stat().st_size > 100:
      f.write_bytes(b"\0" * 64)  # every array file of every step damaged
  metrics = hashes(workdir / "metrics.jsonl")
  refused(again(workdir, "--config.train.steps=4"),
          r"no checkpoint in .* can be read \(steps \[2\]\).*To start this workdir over")
  assert hashes(workdir / "metrics.jsonl") == metrics  # the history is kept
  assert (workdir / "corrupt_checkpoints").is_dir()
  refused(again(workdir, "--config.train.steps=4"), "no checkpoint in .* can be read")


def test_a_torn_last_metrics_line_is_dropped_with_a_notice(workdir):
  with open(workdir / "metrics.jsonl", "a") as f:
    f.write('{"step": 3, "loss": 4.')
  result = again(workdir, "--config.train.steps=3")
  assert result.code == 0, result.err[-2000:]
  assert "is not a whole record" in result.err
  steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3]


def test_resuming_with_nothing_left_to_do_says_so(workdir):
  result = again(workdir, "--config.train.steps=1", "--config.train.warmup_steps=0")
  assert result.code == 0
  assert "nothing left to do" in result.err


def test_divergence_stops_the_run_and_saves_nothing_non_finite(tmp_path):
  result = train("--config", CONFIG, "--workdir", str(tmp_path / "run"), *TINY,
                 "--config.train.lr=1e6", "--config.train.steps=30", "--config.train.log_every=1",
                 "--config.train.warmup_steps=0", "--config.checkpoint.every=1")
  refused(result, r"not finite at 3 steps in a row \(steps \d+-\d+\).*train.lr", code=3)
  import jax
  import jmoe
  from flax import nnx
  _, model = jmoe.load_model(tmp_path / "run")  # the latest checkpoint: saved, and finite
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model)))


# ---- Hugging Face conversion, scoring, the other commands ----

QWEN = str(ROOT / "configs" / "tiny_qwen3_moe.py")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
  """A tiny Qwen3-MoE Hugging Face directory, written by jmoe's own export (sharded in two)."""
  from flax import nnx
  from jmoe.checkpoint.hf import export_hf
  from jmoe.checkpoint.params import save_model
  from jmoe.config import load_config
  from helpers import build
  root = tmp_path_factory.mktemp("hf")
  config = load_config(QWEN, [o.removeprefix("--config.") for o in TINY])
  save_model(root / "ckpt", nnx.state(build(config)), config)
  return export_hf(root / "ckpt", root / "hf", shard_bytes=100_000)


def hf_copy(hf_dir, tmp_path) -> pathlib.Path:
  import shutil
  return pathlib.Path(shutil.copytree(hf_dir, tmp_path / "hf"))


def damage_hf(directory: pathlib.Path, how: str) -> str:
  """Damages a copy of the HF directory; returns the message expected."""
  index = directory / "model.safetensors.index.json"
  shards = sorted(directory.glob("*.safetensors"))
  if how == "no config.json":
    (directory / "config.json").unlink()
    return "config.json does not exist"
  if how == "config.json not JSON":
    (directory / "config.json").write_text("{'not': json")
    return "config.json is not valid JSON"
  if how == "another architecture":
    hf = json.loads((directory / "config.json").read_text())
    hf.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (directory / "config.json").write_text(json.dumps(hf))
    return "unsupported architecture \\['LlamaForCausalLM'\\]"
  if how == "a missing shard":
    shards[-1].unlink()
    return f"names {shards[-1].name}, which is not in"
  if how == "a truncated shard":
    shards[0].write_bytes(shards[0].read_bytes()[:1000])
    return "is not a readable safetensors file|cannot be read from"
  if how == "a tensor of the wrong shape":
    from safetensors.numpy import load_file, save_file
    tensors = load_file(shards[0])
    name = next(iter(tensors))
    tensors[name] = np.zeros((3, 5), tensors[name].dtype)
    save_file(tensors, shards[0], metadata={"format": "pt"})
    return "do not have the shapes its config.json implies"
  if how == "an index without a weight map":
    index.write_text("{}")
    return "has no weight_map"
  raise KeyError(how)


@pytest.mark.parametrize("how", ["no config.json", "config.json not JSON", "another architecture",
                                 "a missing shard", "a truncated shard",
                                 "a tensor of the wrong shape", "an index without a weight map"])
def test_import_hf_refuses_a_damaged_directory(hf_dir, tmp_path, how):
  directory = hf_copy(hf_dir, tmp_path)
  message = damage_hf(directory, how)
  before = hashes(directory)
  refused(convert("import-hf", "--hf-dir", str(directory), "--out", str(tmp_path / "out")),
          message)
  assert hashes(directory) == before and not (tmp_path / "out").exists()
  assert not list(tmp_path.glob(".out.writing-*"))  # no half-written directory left


def test_conversions_never_write_over_what_is_there(hf_dir, workdir, tmp_path):
  target = write(tmp_path / "taken" / "keep.txt", "precious").parent
  for args in (["import-hf", "--hf-dir", str(hf_dir), "--out", str(target)],
               ["import-hf", "--hf-dir", str(hf_dir), "--out", str(workdir)],
               ["export-hf", "--checkpoint", str(workdir), "--out", str(target)],
               ["upcycle", "--checkpoint", str(workdir), "--config", CONFIG, "--out",
                str(target)]):
    before = hashes(target, workdir)
    refused(convert(*args), "is not empty; give an empty or new directory, or --overwrite")
    assert hashes(target, workdir) == before
  result = convert("import-hf", "--hf-dir", str(hf_dir), "--out", str(target), "--overwrite")
  assert result.code == 0, result.err[-2000:]
  assert not (target / "keep.txt").exists() and (target / "config.json").is_file()


def test_export_hf_explains_what_cannot_be_exported(workdir, tmp_path):
  refused(convert("export-hf", "--checkpoint", str(tmp_path / "nothing"), "--out",
                  str(tmp_path / "hf")), "nothing does not exist")
  write(tmp_path / "empty" / "x.txt", "x")
  refused(convert("export-hf", "--checkpoint", str(tmp_path / "empty"), "--out",
                  str(tmp_path / "hf")), "config.json does not exist")
  refused(convert("export-hf", "--checkpoint", str(workdir), "--out", str(tmp_path / "hf")),
          "model.family is ''; set it to one of")
  assert not (tmp_path / "hf").exists()


def tokens_file(tmp_path, text="1 2 3 4 5\n7 8 9\n") -> pathlib.Path:
  return write(tmp_path / "tokens.txt", text)


@pytest.mark.parametrize("text, message", [
    ("1 2 x\n", "tokens.txt:1: token ids must be integers"),
    ("1 2 999\n", "token id 999 is outside the model's vocabulary"),
    ("\n\n", "holds no sequences"),
    (b"\xff\xfe\x00\x01", "is not text"),
])
def test_score_refuses_bad_token_files(workdir, tmp_path, text, message):
  refused(score("--checkpoint", str(workdir), "--tokens-file", str(write(tmp_path / "tokens.txt",
                                                                        text))), message)


def test_score_needs_its_inputs(workdir, tmp_path):
  refused(score("--checkpoint", str(workdir), "--tokens-file", str(tmp_path / "none.txt")),
          "--tokens-file .*none.txt does not exist")
  refused(score("--checkpoint", str(tmp_path / "none"), "--tokens-file", str(tokens_file(tmp_path))),
          "none does not exist")


def test_score_and_export_pass_over_a_damaged_latest_checkpoint(tmp_path):
  run_dir = tmp_path / "run"
  assert train("--config", QWEN, "--workdir", str(run_dir), *TINY, "--config.train.steps=4",
               "--config.checkpoint.every=2").code == 0
  healthy = score("--checkpoint", str(run_dir), "--tokens-file", str(tokens_file(tmp_path)))
  assert healthy.code == 0 and "Metadata file does not exist" not in healthy.err
  (run_dir / "checkpoints" / "4" / "state" / "manifest.ocdbt").unlink()
  before = hashes(run_dir)
  result = score("--checkpoint", str(run_dir), "--tokens-file", str(tokens_file(tmp_path)))
  assert result.code == 0, result.err[-2000:]
  assert "checkpoints/4 cannot be read" in result.err and "Event loop is closed" not in result.err
  result = convert("export-hf", "--checkpoint", str(run_dir), "--out", str(tmp_path / "hf"))
  assert result.code == 0, result.err[-2000:]
  assert hashes(run_dir) == before  # reading moves nothing


def test_a_deleted_manifest_is_set_aside_quietly_on_resume(workdir):
  import shutil
  assert again(workdir, "--config.train.steps=3", "--config.checkpoint.every=1").code == 0
  (workdir / "checkpoints" / "3" / "state" / "manifest.ocdbt").unlink()
  result = again(workdir, "--config.train.steps=4")
  assert result.code == 0, result.err[-2000:]
  assert "manifest.ocdbt is missing" in result.err and "Traceback" not in result.err
  shutil.rmtree(workdir / "corrupt_checkpoints")


def test_export_of_damaged_array_data_names_the_array_and_writes_nothing(tmp_path):
  """export-hf opens the arrays and reads them a part at a time as it writes: the largest data
  file cut in half stops it with the array and part it could not read, leaving no output."""
  from flax import nnx
  from jmoe.checkpoint.params import save_model
  from jmoe.config import load_config
  from helpers import build
  config = load_config(QWEN, [])
  save_model(tmp_path / "ckpt", nnx.state(build(config)), config)
  data = max((tmp_path / "ckpt").rglob("d/*"), key=lambda p: p.stat().st_size)
  data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
  before = hashes(tmp_path / "ckpt")
  refused(convert("export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out",
                  str(tmp_path / "hf")),
          r"[\w.]+\[[\d:, ]*\] cannot be read .* the checkpoint is damaged")
  assert hashes(tmp_path / "ckpt") == before and not (tmp_path / "hf").exists()
  assert not list(tmp_path.glob(".hf.writing-*"))


def test_a_damaged_config_json_is_named(workdir, tmp_path):
  (workdir / "config.json").write_text('{"model": ')
  refused(score("--checkpoint", str(workdir), "--tokens-file", str(tokens_file(tmp_path))),
          "config.json is not valid JSON")


def test_load_params_names_what_it_cannot_use(workdir, tmp_path):
  refused(train("--config", CONFIG, "--workdir", str(tmp_path / "new"), *TINY,
                f"--config.checkpoint.load_params={tmp_path / 'none'}"), "none does not exist")
  refused(train("--config", CONFIG, "--workdir", str(tmp_path / "new2"), *TINY,
                "--config.model.d_model=48", f"--config.checkpoint.load_params={workdir}"),
          "does not fit this config")


def test_other_commands_name_their_bad_arguments(tmp_path, monkeypatch):
  import estimate_memory
  refused(run(estimate_memory.main, "--config", CONFIG, "--devices", "0"),
          "--devices 0: give a positive number of devices")
  refused(run(estimate_memory.main, "--config", CONFIG, "--device-memory-gib", "-1"),
          "--device-memory-gib -1.0 must be >= 0")
  refused(run(estimate_memory.main, "--config", CONFIG, "--mock-gpus", "1"),
          "--mock-gpus 1: give the number of GPUs to pretend, 2 or more")
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after the test
  try:
    refused(run(estimate_memory.main, "--config", CONFIG, "--compare", "--mock-gpus", "8"),
            "--mock-gpus 8 needs a GPU (JAX mocks GPU topologies only)")
  finally:
    jax.config.update("jax_mock_gpu_topology", "")
  refused(prepare("--source", str(tmp_path / "none"), "--out", str(tmp_path / "out")),
          "none does not exist")
  refused(train("--config", str(tmp_path / "none.py"), "--workdir", str(tmp_path / "run")),
          "none.py' does not exist")
  refused(train("--config", CONFIG, "--workdir", str(tmp_path / "run"), *TINY,
                f"--config.data.tokenizer={tmp_path / 'none.json'}"), "none.json")
  monkeypatch.setenv("JMOE_NUM_PROCESSES", "two")
  refused(train("--config", CONFIG, "--workdir", str(tmp_path / "run"), *TINY),
          "JMOE_NUM_PROCESSES and JMOE_PROCESS_ID must be integers")


# ---- faults: two runs at once, a killed run ----

def test_a_second_run_is_refused_and_a_killed_run_resumes(tmp_path):
  """While a run trains, a second `python -m jmoe.train` on its workdir stops at once naming it
  and writes nothing there; once the first is killed (-9, no chance to clean up), the same
  command takes its lock over and resumes from its last checkpoint, logging each step once."""
  import signal
  import subprocess
  import time
  env = command_env(2)
  workdir, metrics = tmp_path / "run", tmp_path / "run" / "metrics.jsonl"
  command = lambda steps: [sys.executable, "-m", "jmoe.train", "--config", CONFIG, "--workdir",
                           str(workdir), "--no-progress", *TINY, f"--config.train.steps={steps}",
                           "--config.checkpoint.every=2", "--config.train.log_every=1",
                           "--config.train.batch_size=4"]
  first = subprocess.Popen(command(100_000), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 240
    while not (workdir / "checkpoints" / "4").is_dir() or len(
        metrics.read_text().splitlines()) < 5:
      assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
      time.sleep(0.2)
    second = subprocess.run(command(10), cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-2000:]
    assert f"is in use by process {first.pid} on" in second.stderr
  finally:
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
  assert (workdir / "run.lock").exists()  # left behind by the killed run
  from jmoe.checkpoint import Checkpointer
  checkpointer = Checkpointer(workdir / "checkpoints", keep=1)
  saved = checkpointer.latest_step()
  checkpointer.close()
  third = subprocess.run(command(saved + 3), cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
  assert third.returncode == 0, third.stderr[-3000:]
  assert "taking over" in third.stderr and f"resuming from {workdir / 'checkpoints'}" in third.stderr
  steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
  assert steps == list(range(1, saved + 4))  # each step once, the killed run's later ones dropped
  assert not (workdir / "run.lock").exists()


# ---- data: exact resume, data source, empty documents ----

def text_docs(directory: pathlib.Path, count: int = 8) -> pathlib.Path:
  for i in range(count):
    write(directory / f"{i}.txt", f"document {i} " * 20)
  return directory


def tokenizer_json(tmp_path) -> pathlib.Path:
  from test_data import make_tokenizer
  (tmp_path / "tok").mkdir(exist_ok=True)
  return make_tokenizer(tmp_path / "tok" / "tokenizer.json", ["document one two three"] * 20,
                        vocab=260)


SAVED = r"the checkpoint of step 2 in .*run was saved "
SET_BACK = r": resuming would read other data than the run it continues. Set it back to resume"


@pytest.mark.parametrize("override, message", [
    ("data.source=DOCS", SAVED + r"reading data.source 'stdlib', but this config reads '.*docs'"),
    ("data.source=stdlib@2,DOCS", SAVED + r"reading data.source 'stdlib', but this config reads"),
    ("data.seq_len=64", SAVED + "with data.seq_len 32, but this config has 64" + SET_BACK),
    ("data.packing=none", SAVED + "with data.packing 'concat', but this config has 'none'"),
    ("data.shuffle=false", SAVED + "with data.shuffle True, but this config has False"),
    ("train.seed=7", SAVED + "with train.seed 0, but this config has 7"),
    ("data.eval_fraction=0.1", SAVED + "with data.eval_fraction 0.0, but this config has 0.1"),
    ("data.max_corpus_bytes=100000", SAVED + "with data.max_corpus_bytes 200000, but this "
                                             "config has 100000"),
    ("data.tokenizer=TOKENIZER", SAVED + r"with data.tokenizer 'bytes', but this config has \(a "
                                         r"file of sha256 [0-9a-f]+...\)"),
    ("train.batch_size=16", SAVED + "with train.batch_size 8, but this config has 16"),
])
def test_resuming_onto_other_data_is_refused_by_name(workdir, tmp_path, override, message):
  """Settings that change which tokens come next, refused before anything is compiled or
  written; the message ends by saying how to train on the new data from this run's model."""
  override = (override.replace("DOCS", str(text_docs(tmp_path / "docs")))
              .replace("TOKENIZER", str(tokenizer_json(tmp_path)) if "TOKENIZER" in override
                       else ""))
  before = hashes(workdir)
  result = again(workdir, "--config.train.steps=3", f"--config.{override}")
  refused(result, message)
  assert f"--config.checkpoint.load_params={workdir})" in result.err
  assert "compiled the train step" not in result.err
  assert hashes(workdir) == before


@pytest.fixture(scope="module")
def trained_on_files(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
  """(workdir after 2 steps on a JSONL file, that file)."""
  root = tmp_path_factory.mktemp("on_files")
  corpus = write(root / "corpus" / "a.jsonl", "".join(
      json.dumps({"text": f"line {i} " * 30, "body": "other " * 20}) + "\n" for i in range(40)))
  result = train("--config", CONFIG, "--workdir", str(root / "run"), *TINY,
                 f"--config.data.source={corpus}")
  assert result.code == 0, result.err[-2000:]
  return root / "run", corpus


def test_resuming_when_the_files_changed_is_refused(trained_on_files, tmp_path):
  import shutil
  saved, corpus = trained_on_files
  workdir = pathlib.Path(shutil.copytree(saved, tmp_path / "run"))
  source, text = f"--config.data.source={corpus}", corpus.read_text()
  before = hashes(workdir)
  refused(again(workdir, source, "--config.train.steps=3", "--config.data.text_key=body"),
          SAVED + "with data.text_key 'text', but this config has 'body'" + SET_BACK)
  try:
    corpus.write_text(text + json.dumps({"text": "one more line"}) + "\n")
    refused(again(workdir, source, "--config.train.steps=3"),
            r"the files of data.source entry '.*a.jsonl' changed since the checkpoint of step 2 "
            r"in .*run was saved \(40 documents then, 41 now\): .* Put them back to resume")
    corpus.write_text(text.replace("line 3 ", "line 33 "))  # as many lines, another size
    refused(again(workdir, source, "--config.train.steps=3"),
            r"entry '.*a.jsonl' changed .* \(other file names or sizes\)")
  finally:
    corpus.write_text(text)
  assert hashes(workdir) == before


def test_resuming_on_the_same_files_in_another_place_says_so(trained_on_files, tmp_path):
  import re
  import shutil
  saved, corpus = trained_on_files
  workdir = pathlib.Path(shutil.copytree(saved, tmp_path / "run"))
  moved = pathlib.Path(shutil.copytree(corpus.parent, tmp_path / "moved")) / corpus.name
  result = again(workdir, f"--config.data.source={moved}", "--config.train.steps=3",
                 "--config.data.prefetch=0")  # how far ahead it reads changes no token
  assert result.code == 0, result.err[-2000:]
  assert re.search(r"data.source is '.*moved/a.jsonl', and the checkpoint of step 2 in .* was "
                   r"saved reading '.*corpus/a.jsonl': the same files \(names, sizes, documents "
                   r"and weights\), so the run resumes on them", result.err)
  steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert steps[-1] == 3


def test_a_checkpoint_without_its_data_settings_is_checked_as_far_as_it_can_be(workdir):
  """A checkpoint written before the data settings were saved with the input position: resumed
  with a notice; its rows still count, and a position that does not fit is refused."""
  position = workdir / "checkpoints" / "2" / "data" / "metadata"
  saved = json.loads(position.read_text())
  position.write_text(json.dumps({"streams": saved["streams"]}))
  before = hashes(workdir)
  result = again(workdir, "--config.train.steps=3", "--config.train.batch_size=16")
  refused(result, r"the checkpoint of step 2 in .*run was saved with train.batch_size 8, but this "
                  r"config has 16: each batch row reads its own share of the documents")
  assert "does not record the data settings of its input position" in result.err
  refused(again(workdir, "--config.train.steps=3", "--config.data.packing=none"),
          r"the input position saved with the checkpoint of step 2 in .*run does not fit this "
          r"config's data settings \(KeyError: 'next_index'\); resume with the data settings it "
          r"was saved with")
  assert hashes(workdir) == before


def empty_corpus(tmp_path: pathlib.Path, name: str) -> tuple[str, str]:
  """(data.source, the message) for a corpus with nothing to train on."""
  nothing = r"holds nothing to train on: "
  if name == "JSONL of empty texts":
    path = write(tmp_path / "e.jsonl", (json.dumps({"text": ""}) + "\n") * 20)
    return str(path), rf"data.source entry '.*e.jsonl' {nothing}only empty or whitespace " \
                      r"documents \(20 documents\); give a source with text"
  if name == "JSONL of whitespace":
    path = write(tmp_path / "w.jsonl", (json.dumps({"text": " \n\t "}) + "\n") * 7)
    return str(path), rf"'.*w.jsonl' {nothing}only empty or whitespace documents \(7 documents\)"
  if name == "text files of whitespace":
    for i in range(3):
      write(tmp_path / "ws" / f"{i}.txt", "  \n\n ")
    return str(tmp_path / "ws"), rf"'.*ws' {nothing}only empty or whitespace documents"
  if name == "Parquet of empty and null texts":
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["", None, " "]}), tmp_path / "e.parquet")
    return str(tmp_path / "e.parquet"), rf"'.*e.parquet' {nothing}only empty or whitespace"
  if name == "a mixture with one empty entry":
    path = write(tmp_path / "e.jsonl", (json.dumps({"text": ""}) + "\n") * 5)
    return f"stdlib,{path}@0.5", rf"entry '.*e.jsonl@0.5' {nothing}only empty"
  if name == "texts that tokenize to nothing":
    path = write(tmp_path / "n.jsonl", (json.dumps({"text": "\u00e9\u00e8"}) + "\n") * 4)
    return str(path), rf"'.*n.jsonl' {nothing}only empty or whitespace documents"
  if name == "token shards of end-of-document ids":
    directory = shards(tmp_path)
    for binary in directory.glob("*.bin"):
      ids = np.memmap(binary, dtype=np.uint16, mode="r+")
      ids[:] = 256
      ids.flush()
    return str(directory), rf"'.*tokens' {nothing}only end-of-document tokens \(6 documents\)"
  if name == "token shards of one-token documents":
    directory = shards(tmp_path)
    index = json.loads((directory / "index.json").read_text())
    np.full(50, 256, np.uint16).tofile(directory / index["shards"][0]["file"])
    np.save(directory / index["shards"][0]["bounds"], np.arange(51, dtype=np.int64))
    return str(directory), rf"'.*tokens' {nothing}only end-of-document tokens \(50 documents\)"
  raise KeyError(name)


EMPTY = ["JSONL of empty texts", "JSONL of whitespace", "text files of whitespace",
         "Parquet of empty and null texts", "a mixture with one empty entry",
         "texts that tokenize to nothing", "token shards of end-of-document ids",
         "token shards of one-token documents"]


@pytest.mark.parametrize("name", EMPTY)
def test_a_corpus_with_nothing_to_train_on_is_refused(tmp_path, name):
  source, message = empty_corpus(tmp_path, name)
  extra = []
  if name == "texts that tokenize to nothing":  # a tokenizer that knows no accented letter
    extra = [f"--config.data.tokenizer={ascii_tokenizer(tmp_path)}"]
  before = hashes(tmp_path)
  result = train("--config", CONFIG, "--workdir", str(tmp_path / "run"), *TINY, *extra,
                 f"--config.data.source={source}")
  refused(result, message)
  assert "compiled the train step" not in result.err
  assert {k: v for k, v in hashes(tmp_path).items() if "/run/" not in k} == before


def ascii_tokenizer(tmp_path: pathlib.Path, model: str = "BPE") -> pathlib.Path:
  """A tokenizer.json that knows only "a" and "b": BPE without an unknown token drops other
  letters (text of them tokenizes to nothing), WordLevel without one fails on them."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"a": 0, "b": 1, "<|endoftext|>": 2}
  tokenizer = Tokenizer(models.BPE(vocab, []) if model == "BPE" else models.WordLevel(vocab))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  path = tmp_path / model / "tokenizer.json"
  path.parent.mkdir(exist_ok=True)
  tokenizer.save(str(path))
  return path


def test_a_tokenizer_that_fails_on_the_text_is_named(tmp_path):
  source = write(tmp_path / "t.jsonl", json.dumps({"text": "caf\u00e9"}) + "\n")
  tokenizer = ascii_tokenizer(tmp_path, "WordLevel")
  before = hashes(tmp_path)
  refused(train("--config", CONFIG, "--workdir", str(tmp_path / "run"), *TINY,
                f"--config.data.source={source}", f"--config.data.tokenizer={tokenizer}"),
          r"data.tokenizer .*WordLevel/tokenizer.json cannot tokenize the text .*: WordLevel "
          r"error: Missing \[UNK\] token")
  refused(prepare("--source", str(source), "--out", str(tmp_path / "out"), "--tokenizer",
                  str(tokenizer)), "cannot tokenize the text")
  assert {k: v for k, v in hashes(tmp_path).items() if "/run/" not in k} == before
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", EMPTY[:6])
def test_prepare_refuses_a_corpus_with_nothing_to_train_on(tmp_path, name):
  source, message = empty_corpus(tmp_path, name)
  extra = (["--tokenizer", str(ascii_tokenizer(tmp_path))]
           if name == "texts that tokenize to nothing" else [])
  before = hashes(tmp_path)
  refused(prepare("--source", source, "--out", str(tmp_path / "out"), *extra),
          message.replace("data.source", "--source"))
  assert hashes(tmp_path) == before
  assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_corpus_shorter_than_one_row_is_noticed(tmp_path, caplog):
  from jmoe.data import first_batches
  from jmoe.config import load_config
  write(tmp_path / "hi.txt", "hi")
  config = load_config(CONFIG, [o.removeprefix("--config.") for o in TINY] +
                       [f"data.source={tmp_path / 'hi.txt'}"])
  with caplog.at_level(logging.WARNING, logger="jmoe"):
    batch = first_batches(config)[0]
  assert ("data.source holds 3 tokens in all, fewer than one row (data.seq_len + 1 = 33): every "
          "row repeats the same documents") in caplog.text
  assert (batch["tokens"][:, :3] == [ord("h"), ord("i"), 256]).all()
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jmoe"):  # one document a row: nothing to say
    first_batches(load_config(CONFIG, [o.removeprefix("--config.") for o in TINY] + [
        f"data.source={tmp_path / 'hi.txt'}", "data.packing=none"]))
  assert "fewer than one row" not in caplog.text


def test_token_shards_read_with_another_end_of_document_id_are_refused(tmp_path):
  tokenizer = tokenizer_json(tmp_path)
  text_docs(tmp_path / "docs")
  assert prepare("--source", str(tmp_path / "docs"), "--out", str(tmp_path / "tokens"),
                 "--tokenizer", str(tokenizer)).code == 0
  before = hashes(tmp_path)
  refused(train("--config", CONFIG, "--workdir", str(tmp_path / "run"), *TINY,
                f"--config.data.source={tmp_path / 'tokens'}", f"--config.data.tokenizer={tokenizer}",
                "--config.data.eod_token=<unk>"),
          r"tokens closes its documents with token id 1, but the end-of-document id of "
          r"data.tokenizer is 0 \(see data.eod_token\)")
  assert {k: v for k, v in hashes(tmp_path).items() if "/run/" not in k} == before

