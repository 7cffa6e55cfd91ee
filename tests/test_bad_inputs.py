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
  before = hashes(workdir)
  refused(again(workdir, "--config.train.steps=4"),
          r"no checkpoint in .* can be read \(steps \[2\]\).*To start this workdir over")
  assert hashes(workdir) == before  # the history is kept, and nothing moved: it was refused
  assert not (workdir / "corrupt_checkpoints").exists()
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


# ---- training workdir, resume checks and saves ----

def tree(*roots: pathlib.Path) -> dict[str, str]:
  """Every file's hash and every directory under `roots`: what a refused run leaves as it was."""
  found = hashes(*roots)
  for root in roots:
    if root.is_dir():
      found.update({str(p): "directory" for p in root.rglob("*") if p.is_dir()})
  return found


@pytest.mark.parametrize("damaged", [False, True])
def test_a_resume_refused_after_its_checkpoint_is_read_writes_nothing(workdir, damaged):
  """The input position is checked once the checkpoint is read: refused there, the run leaves
  config.json, metrics.jsonl and every checkpoint as they were, and moves no unreadable
  checkpoint aside."""
  import shutil
  if damaged:  # a newer step that cannot be read, passed over for step 2
    shutil.copytree(workdir / "checkpoints" / "2", workdir / "checkpoints" / "3")
    (workdir / "checkpoints" / "3" / "state" / "manifest.ocdbt").unlink()
  before = tree(workdir)
  result = again(workdir, "--config.train.batch_size=16", "--config.train.steps=4")
  refused(result, r"train\.batch_size")
  assert ("checkpoints/3 cannot be read" in result.err) == damaged
  assert tree(workdir) == before


LORA = ["--config.lora.rank=4", "--config.lora.alpha=8.0"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> pathlib.Path:
  """Two models of the tiny config (`base`, `other`: other random weights), and `run`: LoRA
  adapters trained 2 steps on `base`."""
  from flax import nnx
  from jmoe.checkpoint.params import save_model
  from jmoe.config import load_config
  from helpers import build
  root = tmp_path_factory.mktemp("lora")
  config = load_config(CONFIG, [o.removeprefix("--config.") for o in TINY])
  for name, seed in (("base", 0), ("other", 1)):
    save_model(root / name, nnx.state(build(config, seed)), config)
  result = train("--config", CONFIG, "--workdir", str(root / "run"), *TINY, *LORA,
                 f"--config.checkpoint.load_params={root / 'base'}")
  assert result.code == 0, result.err[-2000:]
  return root


def test_lora_adapters_resume_only_on_the_model_they_were_trained_on(lora_run, tmp_path):
  """Another checkpoint.load_params, or the same path holding other weights, is refused by
  name and writes nothing; the same weights moved to another path resume. Scoring the run
  refuses other weights at its base's path too."""
  import shutil
  run = pathlib.Path(shutil.copytree(lora_run / "run", tmp_path / "run"))
  resume = lambda base, *more: train("--config", CONFIG, "--workdir", str(run), *TINY, *LORA,
                                     f"--config.checkpoint.load_params={base}", *more)
  message = (r"the LoRA adapters in .*checkpoints/2 were trained on the model in .*/base "
             r"\(fingerprint \w+\), but checkpoint.load_params, .*/{}, holds other weights")
  before = tree(run)
  refused(resume(lora_run / "other", "--config.train.steps=3"), message.format("other"))
  assert tree(run) == before
  changed = pathlib.Path(shutil.copytree(lora_run / "other", tmp_path / "base"))
  refused(resume(changed, "--config.train.steps=3"), message.format("base"))
  assert tree(run) == before
  shutil.rmtree(changed)
  moved = shutil.copytree(lora_run / "base", tmp_path / "moved")
  result = resume(moved)  # (nothing left to do: 2 steps)
  assert result.code == 0, result.err[-2000:]
  assert "it was" in result.err and "the same weights" in result.err
  assert json.loads((run / "config.json").read_text())["checkpoint"]["load_params"] == str(moved)
  # What reads the adapted model (score, generate, load_params) holds it to the same check.
  assert score("--checkpoint", str(run), "--tokens-file", str(tokens_file(tmp_path))).code == 0
  shutil.rmtree(moved)
  shutil.copytree(lora_run / "other", moved)
  before = tree(run)
  refused(score("--checkpoint", str(run), "--tokens-file", str(tokens_file(tmp_path))),
          r"holds LoRA adapters trained on the model in .*/base \(fingerprint \w+\), but "
          r".*/moved holds other weights now")
  assert tree(run) == before


def hf_like(directory: pathlib.Path) -> pathlib.Path:
  """What a Hugging Face model's directory holds, as far as a run can tell."""
  write(directory / "config.json", json.dumps({"architectures": ["Qwen3MoeForCausalLM"],
                                               "model_type": "qwen3_moe"}))
  write(directory / "model.safetensors", b"weights")
  return directory


def not_a_run(name: str, tmp_path: pathlib.Path, trained: pathlib.Path):
  """(--workdir, the directory to start in, the message) for each directory that is no run's."""
  if name == "empty (an unset variable), in a Hugging Face model's directory":
    return "", hf_like(tmp_path / "hf"), r"--workdir is empty \(an unset shell variable\?\)"
  if name == "., in a Hugging Face model's directory":
    return ".", hf_like(tmp_path / "hf"), \
        r"--workdir \. \(.*/hf\) is not a jmoe workdir: its config.json is a Hugging Face model's"
  if name == "., in a directory of other files":
    write(tmp_path / "project" / "notes.txt", "mine")
    return ".", write(tmp_path / "project" / "README.md", "mine").parent, \
        r"--workdir \. \(.*/project\) is not empty and is not a jmoe workdir \(it holds README.md"
  if name == "a model checkpoint":
    write(tmp_path / "model" / "model" / "_METADATA", "{}")
    write(tmp_path / "model" / "config.json", (trained / "config.json").read_text())
    return str(tmp_path / "model"), tmp_path, \
        "is a model checkpoint .* give it as --config.checkpoint.load_params"
  if name == "a config.json that is not JSON":
    write(tmp_path / "w" / "config.json", "{'not': json")
    return str(tmp_path / "w"), tmp_path, "its config.json cannot be read as JSON"
  raise KeyError(name)


@pytest.mark.parametrize("name", [
    "empty (an unset variable), in a Hugging Face model's directory",
    "., in a Hugging Face model's directory", "., in a directory of other files",
    "a model checkpoint", "a config.json that is not JSON"])
def test_a_workdir_that_is_not_a_runs_is_refused(name, tmp_path, trained, monkeypatch):
  """A run writes config.json, metrics and checkpoints in its workdir: never in a directory
  that holds something else, nor in the current one for an empty --workdir."""
  arg, start, message = not_a_run(name, tmp_path, trained)
  monkeypatch.chdir(start)
  before = tree(tmp_path)
  refused(train("--config", CONFIG, "--workdir", arg, *TINY), message)
  assert tree(tmp_path) == before


def make_unwritable(directory: pathlib.Path, unwritable: bool = True) -> bool:
  """Makes `directory` unwritable (or writable again): by its mode, or for root, whom modes do
  not stop, by the immutable attribute. False where that cannot be done."""
  import subprocess
  if os.geteuid():
    directory.chmod(0o555 if unwritable else 0o755)
    return True
  try:
    return subprocess.run(["chattr", "+i" if unwritable else "-i", str(directory)],
                          capture_output=True).returncode == 0
  except OSError:  # no chattr
    return False


@contextlib.contextmanager
def unwritable(directory: pathlib.Path):
  if not make_unwritable(directory):
    pytest.skip("root's writes cannot be refused here (no chattr +i)")
  try:
    yield directory
  finally:
    make_unwritable(directory, False)


def bad_place(name: str, tmp_path: pathlib.Path, workdir: pathlib.Path):
  """(--workdir, the directory made unwritable or None, the message) for each place a run
  cannot write in."""
  import shutil
  if name == "a file":
    return write(tmp_path / "file", "mine"), None, r"--workdir .*/file is a file"
  if name == "under a file":
    return write(tmp_path / "file", "mine") / "run", None, \
        r"--workdir .*/file/run lies under .*/file, which is a file"
  if name == "checkpoints is a file":
    shutil.rmtree(workdir / "checkpoints")
    write(workdir / "checkpoints", "mine")
    return workdir, None, \
        r"run/checkpoints is not a directory, where the run writes its checkpoints"
  if name == "tensorboard is a file":
    shutil.rmtree(workdir / "tensorboard")
    write(workdir / "tensorboard", "mine")
    return workdir, None, "run/tensorboard is not a directory"
  if name == "metrics.jsonl is a directory":
    (workdir / "metrics.jsonl").unlink()
    write(workdir / "metrics.jsonl" / "x", "mine")
    return workdir, None, "run/metrics.jsonl is a directory"
  if name == "read-only":
    return workdir, workdir, r"--workdir .*/run cannot be written \(.*\): make it writable"
  if name == "checkpoints read-only":
    return workdir, workdir / "checkpoints", r"run/checkpoints cannot be written \(.*\)"
  if name == "new, in a read-only directory":
    (tmp_path / "parent").mkdir()
    return tmp_path / "parent" / "run", tmp_path / "parent", \
        r"--workdir .*/parent/run cannot be created in .*/parent \(.*\)"
  raise KeyError(name)


@pytest.mark.parametrize("name", [
    "a file", "under a file", "checkpoints is a file", "tensorboard is a file",
    "metrics.jsonl is a directory", "read-only", "checkpoints read-only",
    "new, in a read-only directory"])
def test_where_a_run_cannot_write_is_found_before_it_starts(name, tmp_path, workdir):
  """Found before anything is built or written, not at the first save after the training."""
  path, locked, message = bad_place(name, tmp_path, workdir)
  before = tree(tmp_path)
  with unwritable(locked) if locked else contextlib.nullcontext():
    result = train("--config", CONFIG, "--workdir", str(path), *TINY, "--config.train.steps=3")
  refused(result, message)
  assert "compiled the train step" not in result.err
  assert tree(tmp_path) == before


FAILING_SAVES = '''
import os, pathlib, shutil, signal, subprocess, sys
from jmoe.checkpoint import manager
from jmoe.train import preemption

save, stop_requested = manager.Checkpointer.save, preemption.StopSignals.stop_requested

def breaking_save(self, step, *args):
    """Before the save of step BREAK_AT: the checkpoints path replaced by a file, or made
    unwritable, once the saves before it are written."""
    if step == int(os.environ["BREAK_AT"]):
        self.wait()
        if os.environ["BREAK"] == "unwritable":
            if os.geteuid():
                self.directory.chmod(0o555)
            else:
                subprocess.run(["chattr", "+i", str(self.directory)], check=True)
        else:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory.write_text("in the way")
    return save(self, step, *args)

def signalled(self, step):
    if step == int(os.environ.get("SIGNAL_AT", 0)):
        os.kill(os.getpid(), signal.SIGTERM)
    return stop_requested(self, step)

manager.Checkpointer.save = breaking_save
preemption.StopSignals.stop_requested = signalled
sys.argv[0] = "jmoe.train"
from jmoe.train.__main__ import main
sys.exit(main(sys.argv[1:]))
'''


def train_process(tmp_path, workdir, *overrides, script=None, **env):
  """`python -m jmoe.train` (or `script`, with its arguments) in its own process, which must end
  within 5 minutes (a save that failed in the background once kept it alive for 20)."""
  import subprocess
  args = ([str(write(tmp_path / "failing_saves.py", script))] if script else ["-m", "jmoe.train"])
  done = subprocess.run(
      [sys.executable, *args, "--config", CONFIG, "--workdir", str(workdir), "--no-progress",
       *TINY, *overrides], cwd=ROOT, env=command_env(8, PYTHONPATH=str(ROOT), **env),
      capture_output=True, text=True, timeout=300)
  return Result(done.returncode, done.stderr)


@pytest.mark.parametrize("overrides, env, message", [
    pytest.param(
        ["--config.train.steps=4", "--config.checkpoint.every=1",
         "--config.checkpoint.async_save=true"],
        dict(BREAK="file", BREAK_AT="2"),
        r"saving the checkpoint of step 2 in .*/checkpoints failed \(NotADirectoryError: .*\), "
        r"so training stopped; no earlier checkpoint is left",
        id="in the background, a periodic save"),
    pytest.param(
        ["--config.train.steps=50", "--config.checkpoint.async_save=true"],
        dict(BREAK="file", BREAK_AT="2", SIGNAL_AT="2"),
        r"saving the checkpoint of step 2 in .*/checkpoints failed \(NotADirectoryError",
        id="in the background, the save on SIGTERM"),
    pytest.param(
        ["--config.train.steps=3", "--config.checkpoint.every=2"],
        dict(BREAK="unwritable", BREAK_AT="3"),
        r"saving the checkpoint of step 3 in .*/checkpoints failed \(PermissionError: .*\), so "
        r"training stopped; the checkpoint of step 2 is kept: once .*/checkpoints is a writable "
        r"directory again, the same command resumes from it",
        id="unwritable, the final save"),
])
def test_a_save_that_fails_stops_the_run_with_a_message(tmp_path, overrides, env, message):
  """Whether the save is in the background or not, periodic, final or on a signal: one line,
  exit 2, the process ends, and what was on disk stays (the earlier checkpoint, the file in the
  way)."""
  workdir, probe = tmp_path / "run", tmp_path / "probe"
  if env["BREAK"] == "unwritable":
    probe.mkdir()
    if not make_unwritable(probe):
      pytest.skip("root's writes cannot be refused here (no chattr +i)")
    make_unwritable(probe, False)
  try:
    result = train_process(tmp_path, workdir, *overrides, script=FAILING_SAVES, **env)
  finally:
    if env["BREAK"] == "unwritable" and (workdir / "checkpoints").is_dir():
      make_unwritable(workdir / "checkpoints", False)
  refused(result, message)
  assert result.err.count("error:") == 1
  if env["BREAK"] == "file":
    assert (workdir / "checkpoints").read_text() == "in the way"
  else:
    from jmoe.checkpoint import Checkpointer
    checkpointer = Checkpointer(workdir / "checkpoints", keep=3)
    assert checkpointer.all_steps() == [2] and checkpointer.run_record(2) is None
    checkpointer.close()
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"]


def test_a_disk_that_fills_up_in_a_background_save_stops_the_run(tmp_path):
  """A real failure of the background write: a 300 kB file system fills up during the first
  save. One line, exit 2, and the process ends."""
  import subprocess
  workdir = tmp_path / "small"
  workdir.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(workdir)],
                           capture_output=True)
  if mounted.returncode:
    pytest.skip("cannot mount a small file system here")
  try:
    result = train_process(tmp_path, workdir, "--config.train.steps=4",
                           "--config.checkpoint.every=1", "--config.checkpoint.async_save=true")
  finally:
    subprocess.run(["umount", str(workdir)], check=True)
  refused(result,
          r"saving the checkpoint of step 1 in .*/checkpoints failed \(.*RESOURCE_EXHAUSTED")
