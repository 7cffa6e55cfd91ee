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
    ("precision.gemm=fp8 precision.fp8_dense=false precision.fp8_experts=false",
     "leaves every GEMM in bf16"),
    ("precision.gemm=fp8 precision.fp8_dense=false precision.fp8_recipe=delayed",
     r"fp8_dense=false \(the default\) leaves in bf16"),
    ("precision.gemm=fp8 precision.fp8_weight_gradient=fp16",
     r"precision.fp8_weight_gradient must be one of \['auto', 'bf16', 'fp8'\]"),
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
        "has no text field 'text' \\(set data.text_key, or prepare's --text-key\\)"
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
    ("--config.model.d_model=48", "was saved with model.d_model 32, but this config has 48"),
    ("--config.model.vocab_size=300", "with model.vocab_size 264, but this config has 300"),
    ("--config.moe.num_experts=16", "was saved with moe.num_experts 8, but this config has 16"),
    ("--config.precision.moments=bfloat16", "was saved by a different model or optimizer: "
                                            ".* is float32.* there but bfloat16"),
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
  from jmoe.hf.convert import export_hf
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


# ---- imported weights, HF config fields, config ranges ----

def edit_tensor(directory: pathlib.Path, name: str, make: Callable[[np.ndarray], np.ndarray]):
  """Replaces tensor `name` of a (sharded) Hugging Face directory by make(tensor)."""
  from safetensors.numpy import load_file, save_file
  index = json.loads((directory / "model.safetensors.index.json").read_text())
  shard = directory / index["weight_map"][name]
  tensors = load_file(shard)
  tensors[name] = make(tensors[name])
  save_file(tensors, shard, metadata={"format": "pt"})


def with_nan(t):
  t = t.copy()
  t.flat[3] = np.nan
  return t


QPROJ, EXPERT = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.experts.5.up_proj.weight"


@pytest.mark.parametrize("name, make, message", [
    (QPROJ, lambda t: (t * 100).astype(np.int8), r"tensor '.*q_proj.weight' in .* is I8; jmoe "
     r"imports weights of F32, BF16, F16, F64 \(a quantized checkpoint"),
    (EXPERT, lambda t: t > 0, r"tensor '.*experts.5.up_proj.weight' in .* is BOOL"),
    (QPROJ, lambda t: t.view(np.uint32), "is U32"),
    (QPROJ, with_nan, r"tensor '.*q_proj.weight' in .* holds 1 non-finite value\(s\)"),
    (EXPERT, with_nan, r"tensor '.*experts.5.up_proj.weight' in .* holds 1 non-finite"),
    ("model.norm.weight", lambda t: np.full_like(t, np.inf).astype(np.float16), "non-finite"),
    (QPROJ, lambda t: t.astype(np.float64) * 1e300, "past float32's range"),
])
def test_import_hf_refuses_weights_it_cannot_take(hf_dir, tmp_path, name, make, message):
  """Each tensor's stored dtype is checked before it is read, and its values as it is
  converted: an integer, boolean or quantized tensor, or a NaN or inf anywhere, is named."""
  directory = hf_copy(hf_dir, tmp_path)
  edit_tensor(directory, name, make)
  before = hashes(directory)
  refused(convert("import-hf", "--hf-dir", str(directory), "--out", str(tmp_path / "out")),
          message)
  assert hashes(directory) == before and not (tmp_path / "out").exists()
  assert not list(tmp_path.glob(".out.writing-*"))


def test_import_hf_converts_half_precision_weights_and_names_unknown_fields(hf_dir, tmp_path):
  """float16 and bfloat16 tensors are converted to the parameters' dtype; a config.json field
  jmoe does not know is named in a warning."""
  import ml_dtypes
  directory = hf_copy(hf_dir, tmp_path)
  edit_tensor(directory, QPROJ, lambda t: t.astype(np.float16))
  edit_tensor(directory, EXPERT, lambda t: t.astype(ml_dtypes.bfloat16))
  hf = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**hf, "frobnicate_layers": 3}))
  result = convert("import-hf", "--hf-dir", str(directory), "--out", str(tmp_path / "out"))
  assert result.code == 0, result.err[-2000:]
  assert "jmoe does not know the field(s) frobnicate_layers" in result.err
  from jmoe.hf.files import SafetensorsReader
  import jmoe
  from flax import nnx
  _, model = jmoe.load_model(tmp_path / "out")
  state = nnx.to_pure_dict(nnx.state(model))
  q = np.asarray(state["moe_blocks"]["attn"]["w_q_DHA"])[1]
  expected = SafetensorsReader(directory)(QPROJ).astype(np.float32).T.reshape(q.shape)
  np.testing.assert_array_equal(q, expected)


DEEPSEEK = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
            "num_key_value_heads": 4}
GPT_OSS = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": "32"}, r"config.json: hidden_size must be an integer in \[1, 2147483647\], "
     r"got '32'"),
    ({"hidden_size": 32.0}, r"hidden_size must be an integer in \[1, 2147483647\], got 32.0"),
    ({"num_hidden_layers": -2}, r"num_hidden_layers must be an integer in .*got -2"),
    ({"vocab_size": 10**10}, r"vocab_size must be an integer in \[1, 2147483647\], got 10000000000"),
    ({"num_experts": 0}, r"num_experts must be an integer in \[1, "),
    ({"head_dim": True}, "head_dim must be an integer"),
    ({"rms_norm_eps": "1e-6"}, r"rms_norm_eps must be a number > 0, got '1e-6'"),
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps must be a number > 0, got -1e-06"),
    ({"initializer_range": 0}, r"initializer_range must be a number > 0"),
    ({"max_position_embeddings": "long"}, "max_position_embeddings must be an integer"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false, got 'yes'"),
    ({"norm_topk_prob": 1}, "norm_topk_prob must be true or false, got 1"),
    ({"router_aux_loss_coef": -0.1}, r"router_aux_loss_coef must be a number >= 0"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; jmoe's gated MLPs use silu"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     r"rope_parameters: rope type 'linear' is not supported"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     r"rope_scaling: rope type 'dynamic' is not supported"),
    ({"rope_parameters": "yarn"}, "rope_parameters must be a JSON object, got 'yarn'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.5}},
     "attention_factor is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": "4"}},
     r"rope_parameters: factor must be a number >= 1, got '4'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                          "mscale_all_dim": 1.0}}, "mscale_all_dim is not supported for this"),
    ({"rope_parameters": {"rope_theta": 0.5}}, r"rope_theta must be a number > 1, got 0.5"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}},
     "rotary parameters per kind of layer are not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}},
     r"quantization_config \(quant_method 'fp8'\) is not supported"),
    ({"mlp_only_layers": [1]}, r"dense layers \[1\] .* are not the first k layers"),
    ({"mlp_only_layers": [5]}, "mlp_only_layers names layer 5; the model has layers 0 to 1"),
    ({"mlp_only_layers": "0"}, "mlp_only_layers must be a list of integers"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step must be an integer in \[1,"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
     "max_window_layers below num_hidden_layers with a sliding window is not supported"),
    ({"num_key_value_heads": 3}, r"describes a model jmoe cannot hold: .*model.num_heads \(4\) "
     r"must be a multiple of model.num_kv_heads \(3\)"),
    ({"num_experts_per_tok": 9}, r"cannot hold: .*moe.top_k \(9\) is larger than"),
    ({**DEEPSEEK, "num_key_value_heads": 2},
     r"num_key_value_heads \(2\) must equal num_attention_heads \(4\)"),
    ({**DEEPSEEK, "scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ({**DEEPSEEK, "topk_method": "greedy"}, "topk_method='greedy' is not supported"),
    ({**DEEPSEEK, "moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
    ({**DEEPSEEK, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}},
     "mscale_all_dim without mscale is not supported"),
    ({**GPT_OSS, "swiglu_limit": 8.0}, r"swiglu_limit=8.0 is not supported: transformers' "),
    ({**GPT_OSS, "layer_types": ["full_attention", "sliding_attention"]},
     "is not a pattern jmoe has"),
    ({**GPT_OSS, "layer_types": ["sliding_attention"]},
     "layer_types must list sliding_attention or full_attention for each of the 2 layers"),
    ({**GPT_OSS, "quantization_config": {"quant_method": "bitsandbytes"}},
     r"quant_method 'bitsandbytes'\) is not supported: .* \(or MXFP4 experts\)"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
      "router_jitter_noise": 1.5}, "router_jitter_noise must be below 1, got 1.5"),
])
def test_import_hf_refuses_config_fields_by_name(hf_dir, tmp_path, change, message):
  """Each config.json field that changes what the model computes is read with its type and
  range, and mapped or refused by name, before any tensor is read."""
  directory = hf_copy(hf_dir, tmp_path)
  hf = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**hf, **change}))
  before = hashes(directory)
  refused(convert("import-hf", "--hf-dir", str(directory), "--out", str(tmp_path / "out")),
          message)
  assert hashes(directory) == before and not (tmp_path / "out").exists()
  assert not list(tmp_path.glob(".out.writing-*"))


def test_fields_config_json_leaves_out_take_transformers_defaults():
  """A field config.json leaves out means what it means to transformers' config class."""
  from jmoe.hf.families import FAMILIES
  from jmoe.hf.fields import HFFields
  sizes = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
               intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
  family = FAMILIES["gpt_oss"]
  model, moe, _ = family.to_jmoe(HFFields(sizes, "config.json", family.defaults))
  assert (model.sliding_window, model.full_attention_every, model.head_dim) == (128, 2, 64)
  assert (model.rope_theta, model.yarn.factor, model.yarn.truncate) == (150_000.0, 32.0, False)
  assert (model.num_kv_heads, model.norm_eps, model.attention_bias) == (8, 1e-5, True)
  family = FAMILIES["mixtral"]
  model, moe, _ = family.to_jmoe(HFFields(sizes, "config.json", family.defaults))
  assert (model.rope_theta, model.norm_eps, model.num_kv_heads, model.head_dim) == (1e6, 1e-5, 4, 8)
  family = FAMILIES["deepseek_v3"]
  model, moe, interleaved = family.to_jmoe(HFFields(
      dict(sizes, moe_intermediate_size=8, n_routed_experts=16), "config.json", family.defaults))
  assert interleaved and model.mtp_depth == 1 and model.mla.q_lora_rank == 1536
  assert (moe.router.num_groups, moe.router.topk_groups, moe.first_k_dense) == (8, 4, 3)
  assert (moe.router.scaling_factor, moe.num_shared_experts) == (2.5, 1)


def test_gpt_oss_layer_types_that_export_writes_import_back():
  """Any window pattern jmoe has (every k-th layer full) goes out as layer_types and back."""
  from jmoe.hf.families import FAMILIES
  from jmoe.hf.fields import HFFields
  from jmoe.config import load_config
  family = FAMILIES["gpt_oss"]
  for every in (0, 2, 3, 6):
    config = load_config(str(ROOT / "configs" / "tiny_gpt_oss.py"),
                         ["model.num_layers=6", f"model.full_attention_every={every}"])
    hf = family.to_hf(config.model, config.moe)
    model, _, _ = family.to_jmoe(HFFields(hf, "config.json", family.defaults))
    assert [model.windowed(i) for i in range(6)] == [config.model.windowed(i) for i in range(6)]
    assert model.sliding_window == config.model.sliding_window


def saved_config(tmp_path, config_file: str, *overrides: str) -> pathlib.Path:
  """A directory holding only the config.json of a checkpoint (export reads it first)."""
  from jmoe.config import load_config, to_dict
  config = load_config(config_file, [*(o.removeprefix("--config.") for o in TINY), *overrides])
  write(tmp_path / "ckpt" / "config.json", json.dumps(to_dict(config)))
  return tmp_path / "ckpt"


@pytest.mark.parametrize("config_file, overrides, message", [
    (QWEN, ["model.sliding_window=8", "model.full_attention_every=2"],
     r"model.family=qwen3_moe needs model.full_attention_every=0"),
    (str(ROOT / "configs" / "tiny_mixtral.py"), ["model.yarn.factor=4.0",
                                                 "model.yarn.mscale_all_dim=1.0"],
     r"needs model.yarn.mscale_all_dim=0 \(transformers scales the attention logits by it for "
     r"DeepSeek-V3 only\)"),
    (str(ROOT / "configs" / "tiny_deepseek_v3.py"), ["model.yarn.factor=4.0", "model.yarn.mscale=0.0",
                                                     "model.yarn.mscale_all_dim=1.0"],
     r"needs model.yarn.mscale > 0 with model.yarn.mscale_all_dim"),
    (str(ROOT / "configs" / "tiny_gpt_oss.py"), ["moe.swiglu_limit=5.0"],
     r"needs moe.swiglu_limit=7"),
    (str(ROOT / "configs" / "tiny_gpt_oss.py"), ["moe.router.scaling_factor=2.0"],
     r"needs moe.router.scaling_factor=1"),
])
def test_export_hf_refuses_what_transformers_would_run_otherwise(tmp_path, config_file,
                                                                  overrides, message):
  checkpoint = saved_config(tmp_path, config_file, *overrides)
  before = hashes(checkpoint)
  refused(convert("export-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")),
          message)
  assert hashes(checkpoint) == before and not (tmp_path / "hf").exists()


def test_export_hf_gives_latent_attention_a_key_value_head_per_query_head(tmp_path):
  """jmoe's latent attention does not read model.num_kv_heads; transformers' DeepSeek-V3 runs
  only with num_key_value_heads = num_attention_heads, which export writes."""
  from jmoe.hf.families import check_exportable
  from jmoe.config import load_config
  config = load_config(str(ROOT / "configs" / "tiny_deepseek_v3.py"),
                       ["model.num_heads=8", "model.num_kv_heads=2"])
  hf = check_exportable(config.model, config.moe).to_hf(config.model, config.moe)
  assert hf["num_key_value_heads"] == hf["num_attention_heads"] == 8
  shipped = load_config(str(ROOT / "configs" / "tiny_deepseek_v3.py"))
  assert shipped.model.num_kv_heads == shipped.model.num_heads


def test_every_number_of_the_schema_has_a_range():
  from jmoe.config import Config
  from jmoe.config.validate import RANGES, numbers
  defaults = dict(numbers(Config()))
  assert set(defaults) | {"moe.capacity_factor", "train.qk_clip"} == set(RANGES)
  assert all(value in RANGES[key] for key, value in defaults.items())


def outside(key: str) -> list:
  """Values just outside the range of config key `key`."""
  from jmoe.config import Config
  from jmoe.config.validate import RANGES, numbers
  r = RANGES[key]
  low, high = r.bounds()
  is_int = isinstance(dict(numbers(Config())).get(key), int)
  step = 1 if is_int else 0.5
  values = [low if r.text[0] == "(" else low - step]
  if high != float("inf"):
    values.append(high if r.text[-1] == ")" else high + step)
  return [int(v) if is_int else float(v) for v in values]


def range_cases():
  from jmoe.config.validate import RANGES
  return [(key, value) for key in sorted(RANGES) for value in outside(key)]


@pytest.mark.parametrize("key, value", range_cases())
def test_numbers_outside_their_range_are_refused_by_name(tmp_path, key, value):
  import re
  from jmoe.config.validate import RANGES
  before = hashes(tmp_path)
  result = train("--config", CONFIG, "--workdir", str(tmp_path / "run"), *TINY,
                 f"--config.{key}={value}")
  interval = RANGES[key].text.replace("INT", "2147483647")
  refused(result, f"{key} must be (None or )?(positive, )?in {re.escape(interval)}.*, got "
                  f"{re.escape(str(value))}")
  assert hashes(tmp_path) == before


@pytest.mark.parametrize("override, message", [
    ("model.vocab_size=10000000000",
     r"model.vocab_size must be positive, in \[1, 2147483647\], got 10000000000"),
    ("train.b2=1.0", r"train.b2 must be in \[0, 1\), got 1.0"),
    ("train.eps=0", r"train.eps must be positive, in \(0, inf\), got 0.0"),
    ("train.weight_decay=-0.01", r"train.weight_decay must be in \[0, inf\), got -0.01"),
    ("moe.capacity_factor=-0.5", r"moe.capacity_factor must be None or in \[0, inf\) \(None or 0: "
     r"dropless\), got -0.5"),
    ("train.warmup_steps=5", r"train.warmup_steps \(5\) must be in \[0, train.steps\) = \[0, 2\)"),
])
def test_config_ranges_the_issue_names(tmp_path, override, message):
  before = hashes(tmp_path)
  refused(train("--config", CONFIG, "--workdir", str(tmp_path / "run"), *TINY,
                f"--config.{override}"), message)
  assert hashes(tmp_path) == before


def nan_checkpoint(workdir: pathlib.Path, path: pathlib.Path) -> None:
  """The workdir's model saved to `path` with token 5's embedding NaN."""
  import jmoe
  from flax import nnx
  from jmoe.checkpoint.params import save_model
  config, model = jmoe.load_model(workdir)
  state = nnx.state(model)
  table = state["embed"]["table"]
  table[...] = table[...].at[5].set(np.nan)
  save_model(path, state, config)


@pytest.mark.parametrize("cache", [True, False])
def test_generate_refuses_tokens_from_non_finite_logits(workdir, tmp_path, cache):
  """Greedy decoding picks some id from NaN logits (argmax gave 0): generate names the prompt
  and the new token whose logits were not finite, and stops before printing."""
  from jmoe.generate import main
  nan_checkpoint(workdir, tmp_path / "ckpt")
  tokens = tokens_file(tmp_path, "1 2 3\n4 5 6 7\n")
  before = hashes(tmp_path)
  refused(run(main, "--checkpoint", str(tmp_path / "ckpt"), "--tokens-file", str(tokens),
              "--max-new-tokens", "3", *([] if cache else ["--no-cache"])),
          r"the model's logits for new token 1 of prompt 2 are not finite .*nothing was generated")
  assert hashes(tmp_path) == before


def test_score_refuses_to_print_non_finite_log_probabilities(workdir, tmp_path):
  """A model whose parameters are not finite gives NaN log-probabilities, which JSON cannot
  hold: score names the sequence and writes nothing."""
  nan_checkpoint(workdir, tmp_path / "ckpt")
  tokens = tokens_file(tmp_path, "1 2 3\n4 5 6 7\n")
  before = hashes(tmp_path / "ckpt", tokens)
  refused(score("--checkpoint", str(tmp_path / "ckpt"), "--tokens-file", str(tokens), "--out",
                str(tmp_path / "scores.json")),
          r"ckpt gives token \d \(from 0\) of sequence 2 in .*tokens.txt the log-probability nan "
          r"\(\d such in that sequence\).*nothing is written")
  assert hashes(tmp_path / "ckpt", tokens) == before and not (tmp_path / "scores.json").exists()
# ---- outputs of conversions, prepare and score ----
# Every command that writes where a user says checks the place before any work, writes under a
# temporary name of its own beside it, and moves that into place only if the place is still what
# it checked (jmoe/outputs.py). The races below are made deterministic: the concurrent change is
# done from inside the command, through a patched step of its work.

def no_temporaries(*directories: pathlib.Path) -> bool:
  return not [p for d in directories for p in d.glob(".*") if ".writing-" in p.name
              or ".replaced-" in p.name]


def docs(tmp_path) -> pathlib.Path:
  for i in range(3):
    write(tmp_path / "docs" / f"{i}.txt", f"document {i} " * 50)
  return tmp_path / "docs"


def output_case(name, tmp_path, hf_dir, workdir) -> tuple[list[str], Callable, str]:
  """(argv, command, expected message) of each output that is refused before any work."""
  afile = write(tmp_path / "afile", "mine")
  tokens = tokens_file(tmp_path)
  score_args = ["--checkpoint", str(workdir), "--tokens-file", str(tokens)]
  under = "afile is a file, so nothing can be written under it; choose another --out"
  cases = {
      "import-hf --out under a file": (
          ["import-hf", "--hf-dir", str(hf_dir), "--out", str(afile / "ckpt")], convert, under),
      "export-hf --out under a file": (
          ["export-hf", "--checkpoint", str(workdir), "--out", str(afile / "x" / "hf")], convert,
          under),
      "upcycle --out under a file": (
          ["upcycle", "--checkpoint", str(workdir), "--config", CONFIG, "--out",
           str(afile / "up")], convert, under),
      "prepare --out under a file": (
          ["--source", str(docs(tmp_path)), "--out", str(afile / "tokens")], prepare, under),
      "score --out under a file": (score_args + ["--out", str(afile / "s.json")], score, under),
      "score --out a directory": (
          score_args + ["--out", str(docs(tmp_path)), "--overwrite"], score,
          "docs is a directory; this command writes a file there"),
      "import-hf --out a file": (
          ["import-hf", "--hf-dir", str(hf_dir), "--out", str(afile), "--overwrite"], convert,
          "afile is a file; this command writes a directory there"),
      "score --out its --tokens-file": (
          score_args + ["--out", str(tokens), "--overwrite"], score,
          "tokens.txt is the --tokens-file input"),
      "score --out a file of its --checkpoint": (
          score_args + ["--out", str(workdir / "config.json"), "--overwrite"], score,
          "config.json is part of the --checkpoint input"),
      "score --out a link to its --tokens-file": (
          score_args + ["--out", str(tmp_path / "link.txt"), "--overwrite"], score,
          "link.txt is the --tokens-file input"),
      "import-hf --out its --hf-dir": (
          ["import-hf", "--hf-dir", str(hf_dir), "--out", str(hf_dir), "--overwrite"], convert,
          "is the --hf-dir input"),
      "import-hf --out above its --hf-dir": (
          ["import-hf", "--hf-dir", str(hf_dir), "--out", str(hf_dir.parent), "--overwrite"],
          convert, "holds the --hf-dir input"),
      "export-hf --out its --checkpoint": (
          ["export-hf", "--checkpoint", str(workdir), "--out", str(workdir), "--overwrite"],
          convert, "is the --checkpoint input"),
      "prepare --out its --source": (
          ["--source", str(docs(tmp_path)), "--out", str(docs(tmp_path))], prepare,
          "holds the --source input"),
      "prepare --out its --tokenizer": (
          ["--source", str(docs(tmp_path)), "--out", str(afile), "--tokenizer", str(afile)],
          prepare, "afile is the --tokenizer input"),
      "import-hf --out '' (an unset variable)": (
          ["import-hf", "--hf-dir", str(hf_dir), "--out", "", "--overwrite"], convert,
          "--out is empty (an unset shell variable?)"),
      "score --out ''": (score_args + ["--out", ""], score, "--out is empty"),
  }
  (tmp_path / "link.txt").symlink_to(tokens)
  return cases[name]


@pytest.mark.parametrize("name", [
    "import-hf --out under a file", "export-hf --out under a file", "upcycle --out under a file",
    "prepare --out under a file", "score --out under a file", "score --out a directory",
    "import-hf --out a file", "score --out its --tokens-file",
    "score --out a file of its --checkpoint", "score --out a link to its --tokens-file",
    "import-hf --out its --hf-dir", "import-hf --out above its --hf-dir",
    "export-hf --out its --checkpoint", "prepare --out its --source",
    "prepare --out its --tokenizer", "import-hf --out '' (an unset variable)", "score --out ''"])
def test_outputs_that_cannot_be_written_are_refused_before_any_work(hf_dir, workdir, tmp_path,
                                                                    monkeypatch, name):
  argv, command, message = output_case(name, tmp_path, hf_dir, workdir)
  monkeypatch.chdir(tmp_path)
  before = hashes(tmp_path, hf_dir)
  result = command(*argv)
  refused(result, message)
  assert "compiled" not in result.err and "wrote" not in result.err
  assert hashes(tmp_path, hf_dir) == before and no_temporaries(tmp_path, hf_dir.parent)


@pytest.fixture
def unwritable(tmp_path, monkeypatch) -> pathlib.Path:
  """A directory this process may not write in: by its mode, or, for root (whom modes do not
  stop), by what os.access and the creation of a file or directory there say."""
  directory = tmp_path / "locked"
  directory.mkdir()
  directory.chmod(0o555)
  if os.access(directory, os.W_OK):
    access, mkdir, open_ = os.access, os.mkdir, os.open
    monkeypatch.setattr(os, "access", lambda path, mode, **kwargs: not (
        pathlib.Path(path) == directory and mode & os.W_OK) and access(path, mode, **kwargs))

    def refuse(make):
      def made(path, *args, **kwargs):
        if pathlib.Path(path).parent == directory:
          raise PermissionError(13, "Permission denied", str(path))
        return make(path, *args, **kwargs)
      return made

    monkeypatch.setattr(os, "mkdir", refuse(mkdir))
    monkeypatch.setattr(os, "open", refuse(open_))
  yield directory
  directory.chmod(0o755)


def test_an_unwritable_output_directory_is_named(hf_dir, workdir, tmp_path, unwritable):
  source, tokens = docs(tmp_path), tokens_file(tmp_path)
  before = hashes(tmp_path, hf_dir)
  message = f"cannot write in {unwritable} (no permission, or a read-only file system)"
  refused(convert("import-hf", "--hf-dir", str(hf_dir), "--out", str(unwritable / "ckpt")),
          message)
  refused(convert("export-hf", "--checkpoint", str(workdir), "--out", str(unwritable / "hf")),
          message)
  refused(prepare("--source", str(source), "--out", str(unwritable / "new" / "tokens")), message)
  refused(score("--checkpoint", str(workdir), "--tokens-file", str(tokens), "--out",
                str(unwritable / "s.json")), message)
  assert hashes(tmp_path, hf_dir) == before and not list(unwritable.iterdir())


def test_a_file_system_error_while_writing_is_named_and_leaves_nothing(tmp_path, monkeypatch):
  """Creating the temporary (the check said yes: the file system then said no), and a full disk
  while writing: one line naming the path and what to do; no temporary, no output."""
  import errno
  from jmoe.data.prepare import ShardWriter
  source, out = str(docs(tmp_path)), tmp_path / "new" / "tokens"
  mkdir = os.mkdir

  def refused_here(path, *args, **kwargs):
    if ".writing-" in str(path):
      raise PermissionError(errno.EACCES, "Permission denied", str(path))
    return mkdir(path, *args, **kwargs)

  monkeypatch.setattr(os, "mkdir", refused_here)
  refused(prepare("--source", source, "--out", str(out)),
          r"\.tokens\.writing-[\w-]+: Permission denied while writing --out .*tokens, which is "
          r"left as it was; choose a place you can write")
  monkeypatch.setattr(os, "mkdir", mkdir)
  assert not (tmp_path / "new").exists()  # the directory made for it is gone too

  def full(self, ids):
    raise OSError(errno.ENOSPC, "No space left on device", str(self.directory / "tokens.bin"))

  monkeypatch.setattr(ShardWriter, "add", full)
  refused(prepare("--source", source, "--out", str(out)),
          r"tokens.bin: No space left on device while writing --out .*tokens, which is left as it "
          r"was; free some space")
  assert not (tmp_path / "new").exists()


def during(monkeypatch, owner, name: str, change: Callable[[], None]) -> None:
  """Patches `owner.name` to call `change()` after it first returns: a concurrent change made
  while the command works, at a set point."""
  real = getattr(owner, name)
  pending = [change]

  def patched(*args, **kwargs):
    value = real(*args, **kwargs)
    if pending:
      pending.pop()()
    return value

  monkeypatch.setattr(owner, name, patched)


def kept_output(result: Result, out: pathlib.Path) -> pathlib.Path:
  """The command's own output, which it kept (and named) when --out changed under it."""
  refused(result, f"--out {out} changed while this command ran (something else wrote there) "
                  f"and is left as it is; this command's output is in")
  kept = pathlib.Path(result.err.split("this command's output is in ")[1].split(": move it")[0])
  assert kept.parent == out.parent and kept.name.startswith(f".{out.name}.writing-")
  return kept


def test_import_hf_keeps_what_another_writes_to_its_out_meanwhile(hf_dir, tmp_path, monkeypatch):
  import jmoe.hf.convert as hf
  out = tmp_path / "ckpt"
  second = []
  during(monkeypatch, hf, "save_streamed", lambda: second.append(
      (convert("import-hf", "--hf-dir", str(hf_dir), "--out", str(out)), hashes(out))))
  result = convert("import-hf", "--hf-dir", str(hf_dir), "--out", str(out))
  (done, theirs), = second
  assert done.code == 0 and theirs, done.err[-2000:]  # the second finished first
  kept = kept_output(result, out)
  assert hashes(out) == theirs and (kept / "config.json").is_file()
  # A file a user puts there meanwhile stays, as does the directory an --overwrite checked and
  # something else replaced.
  user = tmp_path / "user"
  during(monkeypatch, hf, "save_streamed", lambda: write(user / "mine.txt", "mine"))
  kept_output(convert("import-hf", "--hf-dir", str(hf_dir), "--out", str(user)), user)
  assert (user / "mine.txt").read_text() == "mine" and len(list(user.iterdir())) == 1

  def replace():
    import shutil
    shutil.rmtree(out)
    write(out / "theirs.txt", "theirs")

  during(monkeypatch, hf, "save_streamed", replace)
  kept_output(convert("import-hf", "--hf-dir", str(hf_dir), "--out", str(out), "--overwrite"), out)
  assert [p.name for p in out.iterdir()] == ["theirs.txt"]


def test_export_hf_overwrite_replaces_only_what_it_checked(hf_dir, tmp_path, monkeypatch):
  import jmoe.hf.convert as hf
  checkpoint = tmp_path / "ckpt"
  assert convert("import-hf", "--hf-dir", str(hf_dir), "--out", str(checkpoint)).code == 0
  out = write(tmp_path / "hf" / "old.txt", "old").parent
  before = hashes(checkpoint)
  with monkeypatch.context() as patch:
    during(patch, hf, "_export", lambda: write(out / "added.txt", "added meanwhile"))
    kept_output(convert("export-hf", "--checkpoint", str(checkpoint), "--out", str(out),
                        "--overwrite"), out)
  assert sorted(p.name for p in out.iterdir()) == ["added.txt", "old.txt"]
  result = convert("export-hf", "--checkpoint", str(checkpoint), "--out", str(out), "--overwrite")
  assert result.code == 0, result.err[-2000:]
  assert (out / "config.json").is_file() and not (out / "old.txt").exists()
  assert hashes(checkpoint) == before
  assert not list(tmp_path.glob(".hf.replaced-*"))  # what it replaced is gone


def test_two_prepares_on_one_out_never_share_files(tmp_path, monkeypatch):
  """The second of two `prepare` runs on one --out to finish is refused (exit 2), keeping its
  own complete output aside; the first's output is whole and untouched."""
  from jmoe.data.prepare import ShardWriter
  source, out = str(docs(tmp_path)), tmp_path / "tokens"
  inner = []
  during(monkeypatch, ShardWriter, "finish", lambda: inner.append(
      (prepare("--source", source, "--out", str(out)), hashes(out))))
  result = prepare("--source", source, "--out", str(out))
  (done, first), = inner
  assert done.code == 0 and first, done.err[-2000:]
  kept = kept_output(result, out)
  index = json.loads((out / "index.json").read_text())
  assert hashes(out) == first and all((out / s["file"]).is_file() for s in index["shards"])
  assert {p.name for p in kept.iterdir()} == {p.name for p in out.iterdir()}
  # A file put at --out meanwhile stays as it is.
  taken = tmp_path / "taken"
  during(monkeypatch, ShardWriter, "finish", lambda: write(taken, "mine"))
  kept_output(prepare("--source", source, "--out", str(taken)), taken)
  assert taken.read_text() == "mine"


def test_an_interrupted_prepare_or_import_leaves_the_target_as_it_was(hf_dir, tmp_path,
                                                                      monkeypatch):
  import jmoe.hf.convert as hf
  from jmoe.data.prepare import ShardWriter, prepare as prepare_tokens

  def interrupt(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(ShardWriter, "add", interrupt)
  with pytest.raises(KeyboardInterrupt):
    prepare_tokens(str(docs(tmp_path)), tmp_path / "tokens")
  assert not (tmp_path / "tokens").exists() and no_temporaries(tmp_path)
  out = write(tmp_path / "ckpt" / "old.txt", "old").parent
  before = hashes(out)
  monkeypatch.setattr(hf, "save_streamed", interrupt)
  with pytest.raises(KeyboardInterrupt):
    hf.import_hf(hf_dir, out, overwrite=True)
  assert hashes(out) == before and no_temporaries(tmp_path)


def test_score_writes_a_new_out_and_replaces_one_only_when_asked(workdir, tmp_path, monkeypatch):
  import jmoe.inference.score as inference
  args = ["--checkpoint", str(workdir), "--tokens-file", str(tokens_file(tmp_path))]
  out = write(tmp_path / "scores.json", "precious")
  before = hashes(out)
  refused(score(*args, "--out", str(out)), "scores.json exists; give a new --out, or --overwrite")
  assert hashes(out) == before
  during(monkeypatch, inference, "score", lambda: write(out, "changed meanwhile"))
  kept = kept_output(score(*args, "--out", str(out), "--overwrite"), out)
  assert out.read_text() == "changed meanwhile" and len(json.loads(kept.read_text())) == 2
  monkeypatch.undo()
  result = score(*args, "--out", str(out), "--overwrite")
  assert result.code == 0, result.err[-2000:]
  assert [len(r["logprobs"]) for r in json.loads(out.read_text())] == [4, 2]
  assert [p.name for p in tmp_path.glob(".scores.json.*")] == [kept.name]  # only the one named


def test_publish_puts_back_what_was_replaced_between_its_look_and_its_move(tmp_path,
                                                                           monkeypatch):
  """The last moment: the checked file is swapped just before it is moved aside."""
  from jmoe import outputs
  out = write(tmp_path / "out.json", "checked")
  checked = outputs.check(out, directory=False, overwrite=True)
  rename = os.rename

  def swap_first(src, dst):
    if pathlib.Path(src) == out and ".replaced-" in str(dst):
      out.unlink()
      write(out, "someone else's")
    return rename(src, dst)

  with pytest.raises(outputs.ConfigError, match="changed while this command ran"):
    with outputs.written(checked) as tmp:
      tmp.write_text("ours")
      monkeypatch.setattr(os, "rename", swap_first)
  assert out.read_text() == "someone else's" and not list(tmp_path.glob(".out.json.replaced-*"))


def test_scripts_check_their_outputs_first(tmp_path):
  import benchmark
  import plot_expert_load
  import tiny_chat_model
  import tune_gemm
  records = tmp_path / "run" / "metrics.jsonl"
  write(records, json.dumps({"step": 1, "loss": 1.0, "lm_loss": 1.0, "expert_load": [[0.5, 0.5]],
                             "expert_load_max_over_mean": 1.0}) + "\n")
  png = write(tmp_path / "load.png", "mine")
  before = hashes(tmp_path)
  for main, argv, message in [
      (plot_expert_load.main, ["--workdir", str(records.parent), "--out", str(png)],
       "load.png exists; give a new --out, or --overwrite"),
      (plot_expert_load.main, ["--workdir", str(records.parent), "--out", str(png / "x.png")],
       "load.png is a file, so nothing can be written under it"),
      (plot_expert_load.main, ["--workdir", str(records.parent), "--out", str(records),
                               "--overwrite"], "metrics.jsonl is the --workdir input"),
      (tiny_chat_model.main, ["--out", str(records.parent)], "run is not empty; give an empty or "
                                                             "new directory (nothing was"),
      (tiny_chat_model.main, ["--out", str(tmp_path / "hf"), "--chats", str(png)],
       "load.png exists; give a new --chats"),
      (benchmark.main, ["--config", CONFIG, "--record", str(tmp_path)],
       "--record .* is a directory; this command writes a file there"),
      (benchmark.main, ["--config", CONFIG, "--profile", str(png)],
       "--profile .*load.png is a file; this command writes a directory there"),
      (benchmark.main, ["--config", CONFIG, "--loop", "4", "--loop-probes", "-1"],
       "--loop-probes -1: give 0 or more"),
      (tune_gemm.main, ["--config", CONFIG, "--out", str(tmp_path)],
       "is a directory; this command writes a file there")]:
    refused(run(main, *argv), message)
  assert hashes(tmp_path) == before and no_temporaries(tmp_path)
  assert run(plot_expert_load.main, "--workdir", str(records.parent), "--out", str(png),
             "--overwrite").code == 0
  assert png.read_bytes()[:4] == b"\x89PNG" and no_temporaries(tmp_path)
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
  """Two models of the tiny Qwen3-MoE config (exportable; `base`, `other`: other random
  weights), and `run`: LoRA adapters trained 2 steps on `base`."""
  from flax import nnx
  from jmoe.checkpoint.params import save_model
  from jmoe.config import load_config
  from helpers import build
  root = tmp_path_factory.mktemp("lora")
  config = load_config(QWEN, [o.removeprefix("--config.") for o in TINY])
  for name, seed in (("base", 0), ("other", 1)):
    save_model(root / name, nnx.state(build(config, seed)), config)
  result = train("--config", QWEN, "--workdir", str(root / "run"), *TINY, *LORA,
                 f"--config.checkpoint.load_params={root / 'base'}")
  assert result.code == 0, result.err[-2000:]
  return root


def test_lora_adapters_resume_only_on_the_model_they_were_trained_on(lora_run, tmp_path):
  """Another checkpoint.load_params, or the same path holding other weights, is refused by
  name and writes nothing; the same weights moved to another path resume. Scoring the run
  refuses other weights at its base's path too."""
  import shutil
  run = pathlib.Path(shutil.copytree(lora_run / "run", tmp_path / "run"))
  resume = lambda base, *more: train("--config", QWEN, "--workdir", str(run), *TINY, *LORA,
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
def made_unwritable(directory: pathlib.Path):
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
  with made_unwritable(locked) if locked else contextlib.nullcontext():
    result = train("--config", CONFIG, "--workdir", str(path), *TINY, "--config.train.steps=3")
  refused(result, message)
  assert "compiled the train step" not in result.err
  assert tree(tmp_path) == before


FAILING_SAVES = '''
import os, pathlib, shutil, signal, subprocess, sys
from jmoe.checkpoint import manager
from jmoe.train import preemption

save, stop_requested = manager.Checkpointer.save, preemption.StopSignals.stop_requested

def breaking_save(self, step, *args, **kwargs):
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
    return save(self, step, *args, **kwargs)

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
        r"so training stopped; no earlier checkpoint is left in \S+/checkpoints$",
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
    assert checkpointer.all_steps() == [2] and "settings" in checkpointer.run_record(2)
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


# ---- numbers given as command flags ----

@pytest.mark.parametrize("command, argv, message", [
    ("convert", ["export-hf", "--checkpoint", "C", "--out", "O", "--shard-gb=nan"],
     r"argument --shard-gb: nan is outside \(0, inf\]"),
    ("convert", ["export-hf", "--checkpoint", "C", "--out", "O", "--shard-gb=0"],
     r"argument --shard-gb: 0 is outside \(0, inf\]"),
    ("convert", ["export-hf", "--checkpoint", "C", "--out", "O", "--shard-gb=inf"],
     r"argument --shard-gb: inf is outside"),
    ("convert", ["upcycle", "--checkpoint", "C", "--config", CONFIG, "--out", "O",
                 "--router-std=nan"], r"argument --router-std: nan is outside \[0, inf\]"),
    ("convert", ["upcycle", "--checkpoint", "C", "--config", CONFIG, "--out", "O",
                 "--router-std=-1"], r"argument --router-std: -1 is outside"),
    ("prepare", ["--source", "stdlib", "--out", "O", "--shard-tokens=0"],
     r"argument --shard-tokens: 0 is outside \[1, inf\]"),
    ("prepare", ["--source", "stdlib", "--out", "O", "--max-corpus-bytes=-1"],
     r"argument --max-corpus-bytes: -1 is outside"),
    ("prepare", ["--source", "stdlib", "--out", "O", "--shard-tokens=2.5"],
     r"argument --shard-tokens: '2.5' is not an integer"),
    ("generate", ["--checkpoint", "C", "--tokens-file", "T", "--temperature=nan"],
     r"argument --temperature: nan is outside \[0, inf\]"),
    ("generate", ["--checkpoint", "C", "--tokens-file", "T", "--top-p=0"],
     r"argument --top-p: 0 is outside \(0, 1\]"),
    ("generate", ["--checkpoint", "C", "--tokens-file", "T", "--max-new-tokens=0"],
     r"argument --max-new-tokens: 0 is outside \[1, inf\]"),
    ("train", ["--config", CONFIG, "--workdir", "W", "--num-processes=0"],
     r"argument --num-processes: 0 is outside \[1, inf\]"),
])
def test_number_flags_are_refused_outside_their_range(tmp_path, monkeypatch, command, argv,
                                                      message):
  """Every number a command takes as a flag is finite and in its range, or refused by name
  before anything is read or written (`--shard-gb=nan` was a traceback, `=0` one file per
  tensor, `--temperature=nan` token 0 every time)."""
  from jmoe.generate import main as generate_main
  monkeypatch.chdir(tmp_path)
  mains = {"convert": convert, "prepare": prepare, "train": train,
           "generate": lambda *a: run(generate_main, *a)}
  refused(mains[command](*argv), message)
  assert not list(tmp_path.iterdir())


def test_a_lock_that_cannot_be_written_is_removed_and_named(workdir, monkeypatch):
  """On a full disk the lock file is made but its record cannot be written: the run stops in one
  line naming the lock, and leaves no empty lock that a later run would take for a live one."""
  from jmoe.train import workdir as workdir_module
  before = hashes(workdir)
  real = os.fdopen

  def full(fd, *args, **kwargs):
    f = real(fd, *args, **kwargs)
    f.write = lambda *_: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    return f

  monkeypatch.setattr(workdir_module.os, "fdopen", full)
  refused(again(workdir), r"could not write the lock .*run\.lock \(No space left on device\): "
                          r"free some space there")
  monkeypatch.setattr(workdir_module.os, "fdopen", real)
  assert hashes(workdir) == before and not (workdir / "run.lock").exists()


# ---- resuming under other model settings ----

MODEL_SAVED = r"the checkpoint of step 2 in .*run was saved with "
KEEP_MODEL = (r": its weights would compute something else. Set it back to resume, or train on "
              r"from its model with the new value in a new --workdir "
              r"\(--config.checkpoint.load_params=.*run\)")


@pytest.mark.parametrize("override, message", [
    ("moe.top_k=4", "moe.top_k 2, but this config has 4"),
    ("moe.router.score=sigmoid", "moe.router.score 'softmax', but this config has 'sigmoid'"),
    ("moe.router.norm_topk_prob=false", "moe.router.norm_topk_prob True, but this config has "
                                        "False"),
    ("moe.router.force_balanced=true", "moe.router.force_balanced False, but this config has True"),
    ("model.rope_theta=500000.0", "model.rope_theta 10000.0, but this config has 500000.0"),
    ("model.norm_eps=1e-5", "model.norm_eps 1e-06, but this config has 1e-05"),
    ("moe.capacity_factor=1.25", "moe.capacity_factor None, but this config has 1.25"),
    ("moe.drop_policy=position", "moe.drop_policy 'probability', but this config has 'position'"),
    ("moe.activation=clamped_swiglu", "moe.activation 'swiglu', but this config has "
                                      "'clamped_swiglu'"),
    ("model.sliding_window=16", "model.sliding_window 0, but this config has 16"),
    ("model.yarn.factor=4.0", "model.yarn.factor 1.0, but this config has 4.0"),
    ("moe.router.scaling_factor=2.5", "moe.router.scaling_factor 1.0, but this config has 2.5"),
])
def test_resuming_under_other_model_settings_is_refused_by_name(workdir, override, message):
  """A model setting whose change leaves every array's shape as it was would make the saved
  weights compute something else: refused by name before the arrays are read or anything is
  compiled or written."""
  before = tree(workdir)
  result = again(workdir, "--config.train.steps=3", f"--config.{override}")
  refused(result, MODEL_SAVED + message.replace("(", r"\(").replace(")", r"\)") + KEEP_MODEL)
  assert "compiled the train step" not in result.err and "resuming from" not in result.err
  assert tree(workdir) == before


def test_resuming_under_several_other_model_settings_names_each(workdir):
  before = tree(workdir)
  refused(again(workdir, "--config.moe.top_k=4", "--config.model.rope_theta=500000.0",
                "--config.model.d_model=48"),
          MODEL_SAVED + r"other settings than this config's: model.d_model 32 \(now 48\), "
          r"model.rope_theta 10000.0 \(now 500000.0\), moe.top_k 2 \(now 4\): its weights would "
          r"compute something else. Set them back to resume, or train on from its model with the "
          r"new values in a new --workdir")
  assert tree(workdir) == before


def test_a_lora_run_resumed_under_another_adapter_setting_is_refused(lora_run, tmp_path):
  import shutil
  run = pathlib.Path(shutil.copytree(lora_run / "run", tmp_path / "run"))
  before = tree(run)
  result = train("--config", QWEN, "--workdir", str(run), *TINY, "--config.lora.rank=4",
                 "--config.lora.alpha=16.0", f"--config.checkpoint.load_params={lora_run / 'base'}",
                 "--config.train.steps=3")
  refused(result, MODEL_SAVED + r"lora.alpha 8.0, but this config has 16.0" + KEEP_MODEL)
  assert tree(run) == before


def test_a_model_setting_is_checked_before_the_arrays_are_read(workdir):
  """The settings are read from the checkpoint's record first: arrays that cannot be read do
  not hide the setting, and nothing is moved aside."""
  for f in (workdir / "checkpoints" / "2" / "state").rglob("*"):
    if f.is_file() and f.parent.name == "d":
      f.write_bytes(b"\0" * 64)
  before = tree(workdir)
  refused(again(workdir, "--config.train.steps=3", "--config.moe.top_k=4"),
          MODEL_SAVED + "moe.top_k 2, but this config has 4")
  assert tree(workdir) == before


def test_a_checkpoint_without_its_model_settings_resumes_with_a_warning(workdir):
  """A checkpoint saved before its model settings were recorded: resumed as if they were this
  config's, with a warning that names where the workdir's config.json differs."""
  import re
  import shutil
  shutil.rmtree(workdir / "checkpoints" / "2" / "run")
  before = tree(workdir)
  result = again(workdir, "--config.moe.top_k=4", "--config.train.batch_size=16")
  refused(result, r"was saved with train.batch_size 8, but this config has 16")  # (data: after)
  assert re.search(r"the checkpoint of step 2 in .*run does not record the model settings it "
                   r"was trained with \(an earlier jmoe saved it\): resuming as if they were this "
                   r"config's \(its config.json has moe.top_k 2 \(now 4\)\)", result.err)
  assert tree(workdir) == before


def test_settings_that_change_no_model_math_still_resume(workdir):
  """Kernels, remat, layout, balancing and run length may change on resume: the run goes on,
  and config.json records the new settings."""
  result = again(workdir, "--config.train.steps=3", "--config.moe.gemm=dense",
                 "--config.train.remat=full", "--config.model.scan_unroll=2",
                 "--config.moe.dispatcher=alltoall", "--config.parallel.expert.expert=4",
                 "--config.parallel.expert.data=2", "--config.model.attention_kernel=xla",
                 "--config.moe.balance.aux_loss_coef=0.02", "--config.train.lr=1e-3",
                 "--config.checkpoint.every=1")
  assert result.code == 0, result.err[-2000:]
  metrics = (workdir / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in metrics][-1] == 3
  saved = json.loads((workdir / "config.json").read_text())
  assert (saved["moe"]["gemm"], saved["train"]["remat"], saved["parallel"]["expert"]["expert"]) \
      == ("dense", "full", 4)
  record = json.loads((workdir / "checkpoints" / "3" / "run" / "metadata").read_text())
  assert record["settings"]["moe.top_k"] == 2 and "moe.gemm" not in record["settings"]


# ---- LoRA workdirs read as models: their frozen model checked, their adapters folded in ----

def lora_copy(lora_run: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
  """A copy of the LoRA run whose frozen model is a copy of its own, tmp_path / "base" (the
  same weights: its fingerprint holds), which a test may change."""
  import shutil
  shutil.copytree(lora_run / "base", tmp_path / "base")
  run = pathlib.Path(shutil.copytree(lora_run / "run", tmp_path / "run"))
  saved = json.loads((run / "config.json").read_text())
  saved["checkpoint"]["load_params"] = str(tmp_path / "base")
  (run / "config.json").write_text(json.dumps(saved, indent=2))
  return run


def generate(*argv):
  from jmoe.generate import main
  return run(main, *argv)


def test_every_reader_of_a_lora_workdir_refuses_a_changed_frozen_model(lora_run, tmp_path):
  """The frozen model under the adapters replaced by other weights at its path: export-hf (which
  had written a model of other weights), score, generate, and runs that start from the workdir
  (full or LoRA) refuse it by name before writing anything; a frozen model gone is named too."""
  import shutil
  run = lora_copy(lora_run, tmp_path)
  shutil.rmtree(tmp_path / "base")
  shutil.copytree(lora_run / "other", tmp_path / "base")
  tokens = tokens_file(tmp_path / "in")
  starting = lambda name, *more: train("--config", QWEN, "--workdir", str(tmp_path / name),
                                       *TINY, f"--config.checkpoint.load_params={run}", *more)
  readers = {
      "export-hf": lambda: convert("export-hf", "--checkpoint", str(run), "--out",
                                   str(tmp_path / "hf")),
      "score": lambda: score("--checkpoint", str(run), "--tokens-file", str(tokens), "--out",
                             str(tmp_path / "scores.json")),
      "generate": lambda: generate("--checkpoint", str(run), "--tokens-file", str(tokens),
                                   "--max-new-tokens", "2"),
      "a full run": lambda: starting("full"),
      "a LoRA run": lambda: starting("stacked", *LORA),
  }
  message = (r"/run holds LoRA adapters trained on the model in .*/base \(fingerprint \w+\), "
             r"but .*/base holds other weights now: put the model they were trained on back")
  before = hashes(tmp_path)
  for name, read in readers.items():
    refused(read(), message)
    assert hashes(tmp_path) == before, name
  assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "in", "run"]
  saved = json.loads((run / "config.json").read_text())  # its frozen model: the run itself
  (run / "config.json").write_text(json.dumps(
      dict(saved, checkpoint=dict(saved["checkpoint"], load_params=str(run)))))
  before = hashes(tmp_path)
  refused(readers["score"](), r"the models under the LoRA adapters in .*/run lead back to it "
                              r"\(checkpoint.load_params: .*/run -> .*/run\)")
  assert hashes(tmp_path) == before
  (run / "config.json").write_text(json.dumps(saved))
  shutil.rmtree(tmp_path / "base")
  before = hashes(tmp_path)
  refused(readers["export-hf"](), r"/run holds LoRA adapters trained on the model in .*/base, "
                                  r"which is gone; the adapters need it: put it back there")
  assert hashes(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["in", "run"]


def test_runs_start_from_a_lora_workdir_as_its_adapted_model(lora_run, tmp_path):
  """checkpoint.load_params of a LoRA workdir: the adapters folded into their weights (W +
  (alpha / r) A B in float32, as export-hf writes them), the same bits on any layout. A full run
  starts from that model, and so does a LoRA run on top (its frozen model), which resumes on
  another layout and refuses, as its readers do, a changed model under the first adapters."""
  import shutil
  import jax.numpy as jnp
  from flax import nnx
  from jmoe.checkpoint.params import load_model
  from jmoe.config import DenseLayout, ExpertLayout, ParallelConfig
  from jmoe.ops.lora import merged
  from jmoe.parallel import make_layout
  run = lora_copy(lora_run, tmp_path)
  one = make_layout(ParallelConfig(), jax.devices()[:1])
  config, adapted = load_model(run, one)
  _, base = load_model(tmp_path / "base", one)
  folded = merged(jax.device_get(nnx.to_pure_dict(nnx.state(adapted))), config.lora.scale)
  sharded = ParallelConfig(dense=DenseLayout(data=2, fsdp=2, tensor=2),
                           expert=ExpertLayout(data=1, expert=4, tensor=2))
  for layout in (make_layout(sharded), one):  # what load_params of another run reads
    plain_config, plain = load_model(run, layout, merge_adapters=True)
    assert plain_config.lora.rank == 0
    jax.tree.map(np.testing.assert_array_equal,
                 jax.device_get(nnx.to_pure_dict(nnx.state(plain))), folded)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 264, (2, 16)))
  logits = np.asarray(adapted(tokens)[0])
  assert np.abs(logits - np.asarray(base(tokens)[0])).max() > 1e-3  # the adapters changed it
  np.testing.assert_allclose(np.asarray(plain(tokens)[0]), logits, rtol=0, atol=1e-5)

  layouts = {"one": [], "sharded": [
      "--config.parallel.dense.data=2", "--config.parallel.dense.fsdp=2",
      "--config.parallel.dense.tensor=2", "--config.parallel.expert.data=1",
      "--config.parallel.expert.expert=4", "--config.parallel.expert.tensor=2"]}
  starting = lambda name, steps, *more: train(
      "--config", QWEN, "--workdir", str(tmp_path / name), *TINY, f"--config.train.steps={steps}",
      "--config.train.warmup_steps=0", f"--config.checkpoint.load_params={run}", *more)
  for name, more in (("full", ()), ("stacked", LORA)):
    result = starting(name, 1, *more)
    assert result.code == 0, result.err[-2000:]
  first = lambda name: json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
  assert first("stacked")["loss"] == pytest.approx(first("full")["loss"], rel=1e-6)
  assert abs(first("full")["loss"] - json.loads(
      (run / "metrics.jsonl").read_text().splitlines()[0])["loss"]) > 1e-4  # not the base's
  result = starting("stacked", 2, *LORA, *layouts["sharded"])  # the folded model found again
  assert result.code == 0 and "resuming from" in result.err, result.err[-2000:]

  # export-hf of the LoRA run on top folds both adapters: the files of its merged model.
  from jmoe.hf.files import SafetensorsReader
  from jmoe.checkpoint.params import save_model
  merged_config, model = load_model(tmp_path / "stacked", one, merge_adapters=True)
  save_model(tmp_path / "merged", nnx.state(model), merged_config)
  for name in ("stacked", "merged"):
    assert convert("export-hf", "--checkpoint", str(tmp_path / name), "--out",
                   str(tmp_path / f"{name}-hf")).code == 0
  got, want = (SafetensorsReader(tmp_path / f"{name}-hf") for name in ("stacked", "merged"))
  assert set(got.weight_map) == set(want.weight_map)
  for name in want.weight_map:
    np.testing.assert_allclose(got(name), want(name), rtol=1e-6, atol=1e-7, err_msg=name)

  shutil.rmtree(tmp_path / "base")  # the model under the first adapters, changed
  shutil.copytree(lora_run / "other", tmp_path / "base")
  before = hashes(tmp_path)
  refused(convert("export-hf", "--checkpoint", str(tmp_path / "stacked"), "--out",
                  str(tmp_path / "out")), r"/run holds LoRA adapters trained on the model in "
                                          r".*/base \(fingerprint \w+\), but .*/base holds other")
  refused(starting("stacked", 3, *LORA), r"/run holds LoRA adapters trained on the model in "
                                         r".*/base \(fingerprint \w+\), but .*/base holds other")
  assert hashes(tmp_path) == before and not (tmp_path / "out").exists()


# ---- checkpoint saves that fail part way, and saves a killed run left unfinished ----
# Orbax writes a step in <step>.orbax-checkpoint-tmp and renames it when complete. A full disk is
# made in the run's own process at the lowest writer Orbax's Python code reaches (etils' `open`:
# every file Orbax writes itself goes through it; TensorStore writes the arrays beside it) for
# the files of one step's train state, once its save has begun: what fails is the real save.

FULL_DISK = '''
import errno, hashlib, json, os, pathlib, signal, sys
from etils.epath import backend
from jmoe.train import preemption

real_open, real_stop = open, preemption.StopSignals.stop_requested
target = "/checkpoints/" + os.environ["BREAK_AT"] + ".orbax-checkpoint-tmp/state"

def finished_checkpoints():
    root = pathlib.Path(os.environ["CHECKPOINTS"])
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and ".orbax-checkpoint-tmp" not in str(p)}

def full_disk(path, mode="r", **kwargs):
    if target in str(path) and any(c in mode for c in "wax"):
        seen = pathlib.Path(os.environ["BEFORE"])
        if not seen.exists():  # the finished checkpoints as the failing save found them
            seen.write_text(json.dumps(finished_checkpoints()))
        if os.environ["BREAK"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return real_open(path, mode, **kwargs)

def signalled(self, step):
    if step == int(os.environ.get("SIGNAL_AT", 0)):
        os.kill(os.getpid(), signal.SIGTERM)
    return real_stop(self, step)

backend.open = full_disk
preemption.StopSignals.stop_requested = signalled
sys.argv[0] = "jmoe.train"
from jmoe.train.__main__ import main
sys.exit(main(sys.argv[1:]))
'''


def unfinished(workdir: pathlib.Path) -> list[str]:
  return sorted(str(p) for p in workdir.rglob("*.orbax-checkpoint-tmp*"))


def logged_steps(workdir: pathlib.Path) -> list[int]:
  return [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def full_disk_run(tmp_path, workdir, overrides, **env) -> tuple[Result, dict[str, str]]:
  """The run with `overrides` whose save of step env["BREAK_AT"] finds the disk full; its result
  and the finished checkpoints' hashes as that save found them."""
  before = tmp_path / "before.json"
  result = train_process(tmp_path, workdir, *overrides, script=FULL_DISK,
                         CHECKPOINTS=str(workdir / "checkpoints"), BEFORE=str(before), **env)
  assert before.exists(), result.err[-3000:]  # the fault was met
  return result, json.loads(before.read_text())


@pytest.mark.parametrize("overrides, env, kept", [
    pytest.param(["--config.train.steps=4", "--config.checkpoint.every=1",
                  "--config.checkpoint.keep=1"], dict(BREAK_AT="2"), 1,
                 id="in the foreground, a periodic save (keep=1)"),
    pytest.param(["--config.train.steps=4", "--config.checkpoint.every=1",
                  "--config.checkpoint.keep=1", "--config.checkpoint.async_save=true"],
                 dict(BREAK_AT="2"), 1, id="in the background, a periodic save (keep=1)"),
    pytest.param(["--config.train.steps=6", "--config.checkpoint.every=3",
                  "--config.checkpoint.async_save=true"], dict(BREAK_AT="4", SIGNAL_AT="4"), 3,
                 id="in the background, the save on SIGTERM"),
    pytest.param(["--config.train.steps=3", "--config.checkpoint.every=2"], dict(BREAK_AT="3"),
                 2, id="in the foreground, the final save"),
    pytest.param(["--config.train.steps=3", "--config.checkpoint.every=2",
                  "--config.checkpoint.staging_gb=0.00002"], dict(BREAK_AT="3"), 2,
                 id="in the foreground, the final save, staged (a part written beside the next)"),
])
def test_a_save_that_fails_part_way_removes_what_it_wrote(tmp_path, overrides, env, kept):
  """A save that fails part way (a full disk) removes its own partial files, and only those: the
  run stops in one line naming the directory and the cause, exit 2; the checkpoints saved before
  it are as they were; and the same command resumes from the last of them, as if the failed save
  had never started."""
  workdir, failing = tmp_path / "run", env["BREAK_AT"]
  overrides = [*overrides, "--config.train.log_every=1"]
  result, before = full_disk_run(tmp_path, workdir, overrides, BREAK="full", **env)
  assert unfinished(workdir) == [], result.err[-2000:]
  refused(result, rf"saving the checkpoint of step {failing} in .*/run/checkpoints failed "
                  rf"\(.*No space left on device.*\), so training stopped; the checkpoint of "
                  rf"step {kept} is kept: once there is free space in .*/run/checkpoints again, "
                  rf"the same command resumes from it$")
  assert result.err.count("error:") == 1
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [str(kept)]
  assert hashes(workdir / "checkpoints") == before
  again = train("--config", CONFIG, "--workdir", str(workdir), *TINY, *overrides)
  assert again.code == 0, again.err[-3000:]
  assert f"resuming from {workdir / 'checkpoints' / str(kept)} at step {kept}" in again.err
  steps = int(overrides[0].split("=")[1])
  assert logged_steps(workdir) == list(range(1, steps + 1))
  assert unfinished(workdir) == [] and (workdir / "checkpoints" / str(steps)).is_dir()


def test_the_first_save_failing_leaves_no_checkpoint_directory_behind(tmp_path):
  """With no checkpoint before it, the failed save leaves checkpoints/ empty and says so; the
  same command then starts over from step 0."""
  workdir = tmp_path / "run"
  overrides = ["--config.train.steps=2", "--config.checkpoint.async_save=true",
               "--config.train.log_every=1"]
  result, before = full_disk_run(tmp_path, workdir, overrides, BREAK="full", BREAK_AT="2")
  assert unfinished(workdir) == [], result.err[-2000:]
  refused(result, r"saving the checkpoint of step 2 in .*/run/checkpoints failed \(.*No space "
                  r"left on device.*\), so training stopped; no earlier checkpoint is left")
  assert before == {}
  assert not list((workdir / "checkpoints").iterdir())
  again = train("--config", CONFIG, "--workdir", str(workdir), *TINY, *overrides)
  assert again.code == 0 and "resuming" not in again.err, again.err[-3000:]
  assert logged_steps(workdir) == [1, 2]


def test_a_save_a_killed_run_left_unfinished_is_no_checkpoint_and_is_removed(tmp_path):
  """kill -9 during a save leaves <step>.orbax-checkpoint-tmp. The next start is not taken in by
  it, nor by a complete one that was never renamed, nor by an older Orbax's (<step>.orbax-
  checkpoint-tmp-<time>): it resumes from the last finished checkpoint and removes them with a
  notice, once it has found everything else in order (a refused start leaves them)."""
  import shutil
  workdir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
  overrides = ["--config.train.steps=4", "--config.checkpoint.every=1",
               "--config.checkpoint.async_save=true", "--config.train.log_every=1"]
  result, before = full_disk_run(tmp_path, workdir, overrides, BREAK="kill", BREAK_AT="3")
  assert result.code == -9, result.err[-3000:]
  assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2", "3.orbax-checkpoint-tmp"]
  shutil.copytree(checkpoints / "2", checkpoints / "7.orbax-checkpoint-tmp")  # never renamed
  shutil.copytree(checkpoints / "2", checkpoints / "5.orbax-checkpoint-tmp-1796221201")
  (checkpoints / "5.orbax-checkpoint-tmp-1796221201" / "state" / "manifest.ocdbt").unlink()
  stale = tree(checkpoints)
  refused(train("--config", CONFIG, "--workdir", str(workdir), *TINY, *overrides,
                "--config.train.batch_size=16"), r"train\.batch_size")
  assert tree(checkpoints) == stale
  again = train("--config", CONFIG, "--workdir", str(workdir), *TINY, *overrides,
                "--config.train.steps=3")
  assert again.code == 0, again.err[-3000:]
  assert f"resuming from {checkpoints / '2'} at step 2" in again.err
  for step, name in ((3, "3.orbax-checkpoint-tmp"), (5, "5.orbax-checkpoint-tmp-1796221201"),
                     (7, "7.orbax-checkpoint-tmp")):
    assert (f"removing {checkpoints / name}: the save of step {step} did not finish"
            in again.err), again.err[-3000:]
  assert unfinished(workdir) == [] and logged_steps(workdir) == [1, 2, 3]
  assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2", "3"]
  assert {k: v for k, v in hashes(checkpoints).items() if "/3/" not in k} == before


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_a_real_full_disk_leaves_no_partial_checkpoint(tmp_path, async_save):
  """A 900 kB file system that holds the checkpoint of step 1 but not that of step 2 (or, in the
  background, not always that of step 1): the failed save's files are gone when the process ends
  (TensorStore's writes in flight at the failure make their directories again: they are removed
  once Orbax is closed), and the message names the cause first."""
  import subprocess
  workdir = tmp_path / "small"
  workdir.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(workdir)],
                    capture_output=True).returncode:
    pytest.skip("cannot mount a small file system here")
  try:
    result = train_process(tmp_path, workdir / "run", "--config.train.steps=4",
                           "--config.checkpoint.every=1",
                           f"--config.checkpoint.async_save={async_save}")
    left = unfinished(workdir)
    listed = sorted(p.name for p in (workdir / "run" / "checkpoints").iterdir())
  finally:
    subprocess.run(["umount", str(workdir)], check=True)
  assert left == [] and listed in ([], ["1"]), (left, listed)
  # The disk fills in TensorStore's writes (its error says why at the end) or in a file Python
  # writes (an OSError): either way the cause comes first.
  refused(result, r"saving the checkpoint of step [12] in .*/run/checkpoints failed \((No space "
                  r"left on device: ValueError: RESOURCE_EXHAUSTED|OSError: \[Errno 28\] No space "
                  r"left on device\))")


@pytest.mark.parametrize("command", ["import-hf", "export-hf"])
def test_conversions_onto_a_full_disk_say_so_and_leave_nothing(hf_dir, tmp_path, command):
  """The arrays of import-hf are written by TensorStore and the files of export-hf by
  safetensors, each raising its own error type for a full disk: one line naming the cause and
  what to do, exit 2, and no temporary left beside the --out (a 40 kB file system)."""
  import subprocess
  small = tmp_path / "small"
  small.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40k", "tmpfs", str(small)],
                    capture_output=True).returncode:
    pytest.skip("cannot mount a small file system here")
  source = ["--hf-dir", str(hf_dir)] if command == "import-hf" else [
      "--checkpoint", str(hf_dir.parent / "ckpt")]
  before = hashes(hf_dir.parent)
  try:
    result = convert(command, *source, "--out", str(small / "out"))
    left = sorted(p.name for p in small.iterdir())
  finally:
    subprocess.run(["umount", str(small)], check=True)
  refused(result, r"error: (.*/small/\.out\.writing-[\w-]+/[\w.-]+: )?No space left on device "
                  r"while writing --out .*/small/out, which is left as it was; free some space "
                  r"there")
  assert left == [] and hashes(hf_dir.parent) == before


# ---- pipeline stages: how the MoE layers are assigned to them (3 MoE layers here)

PIPELINE = [*TINY, "--config.model.num_layers=4", "--config.parallel.pipeline=2",
            "--config.parallel.dense.data=4", "--config.parallel.expert.data=4"]


@pytest.mark.parametrize("overrides, message", [
    (["pipeline_layers=[2,2]"], r"parallel.pipeline_layers \[2, 2\] sums to 4, but the model has "
                                r"3 MoE layers"),
    (["pipeline_layers=[3,0]"], r"parallel.pipeline_layers \[3, 0\]: every group needs at least "
                                r"one layer"),
    (["pipeline_layers=[3]"], r"parallel.pipeline_layers \[3\] has 1 entries for "
                              r"parallel.pipeline x parallel.pipeline_repeats = 2 groups"),
    (["pipeline_layers=[1,2]", "pipeline_first=1"], r"leave parallel.pipeline_first and "
                                                    r"parallel.pipeline_last at 0 with it"),
    (["pipeline_layers=[1.5,1.5]"], r"'parallel.pipeline_layers' must be a list of ints"),
    (["pipeline_first=2", "pipeline_last=2"], r"parallel.pipeline_first \(2\) \+ "
                                              r"parallel.pipeline_last \(2\) is more than the 3 "
                                              r"MoE layers"),
    (["pipeline_first=1", "pipeline_last=1"], r"must sum to the 3 MoE layers: the 2 groups are "
                                              r"the first and the last"),
    (["pipeline_first=3"], r"parallel.pipeline_first \(3\) leaves 0 of the 3 MoE layers for "
                           r"the other 1 of the parallel.pipeline x parallel.pipeline_repeats = 2 "
                           r"groups, which need at least one each"),
    (["pipeline_repeats=2", "pipeline_layers=[1,1,1,1]"], r"sums to 4, but the model has 3"),
    (["pipeline_repeats=2"], r"the 3 MoE layers cannot fill parallel.pipeline x "
                             r"parallel.pipeline_repeats = 4 groups"),
    (["pipeline=1", "pipeline_layers=[3]", "dense.data=8", "expert.data=8"],
     r"pipeline_first and pipeline_last assign layers to pipeline stages: set "
     r"parallel.pipeline > 1"),
])
def test_pipeline_layer_assignments_that_cannot_work(tmp_path, overrides, message):
  before = hashes(tmp_path)
  result = train("--config", CONFIG, "--workdir", str(tmp_path / "run"), *PIPELINE,
                 *(f"--config.parallel.{o}" for o in overrides))
  refused(result, message)
  assert hashes(tmp_path) == before
