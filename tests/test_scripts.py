"""The helper scripts run on what a training run writes."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from flags import command_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
HF_PYTHON = ROOT / ".venv-hf" / "bin" / "python"  # the reference Python: torch and transformers


def write_metrics(workdir, steps=(1, 10, 20), layers=3, experts=8):
  rng = np.random.default_rng(0)
  with open(workdir / "metrics.jsonl", "w") as f:
    for step in steps:
      load = rng.dirichlet(np.ones(experts), size=layers)
      f.write(json.dumps({"step": step, "loss": 5.0 / step, "lm_loss": 4.9 / step,
                          "expert_load": load.tolist(),
                          "expert_load_max_over_mean": float(load.max() * experts)}) + "\n")


def run_plot(*args):
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_expert_load.py"), *args],
                        capture_output=True, text=True, timeout=120)


def test_plot_expert_load_draws_a_png(tmp_path):
  write_metrics(tmp_path)
  result = run_plot("--workdir", str(tmp_path), "--step", "10")
  assert result.returncode == 0, result.stderr
  png = tmp_path / "expert_load.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_expert_load_explains_bad_input(tmp_path):
  result = run_plot("--workdir", str(tmp_path))
  assert result.returncode != 0 and "metrics.jsonl does not exist" in result.stderr
  write_metrics(tmp_path)
  result = run_plot("--workdir", str(tmp_path), "--step", "7")
  assert result.returncode != 0 and "step 7 was not logged" in result.stderr


def test_benchmark_prints_its_figures(tmp_path):
  result = subprocess.run(
      [sys.executable, "scripts/benchmark.py", "--config", "configs/tiny_moe.py", "--steps", "2",
       "--warmup", "1", "--balanced", "--config.train.batch_size=4", "--config.data.seq_len=32",
       "--config.model.num_layers=2", "--loop", "3", "--config.checkpoint.every=2"],
      cwd=ROOT, capture_output=True, text=True, timeout=240,
      env=command_env())
  assert result.returncode == 0, result.stderr[-3000:]
  record = json.loads(result.stdout.strip().splitlines()[-1])
  assert record["routing"] == "balanced" and record["expert_load_max_over_mean"] == 1.0
  assert record["gemm"] == "ragged_dot" and record["tokens_per_s_per_device"] > 0
  assert 0 < record["mfu_measured_gemm"] and record["tflops_per_device"] > 0
  # jmoe.train's loop after 3 warm-up steps: a checkpoint at step 4 and the last at step 6
  assert record["loop_steps"] == 3 and record["loop_checkpoints"] == 2
  assert record["loop_tokens_per_s"] > 0 and record["loop_vs_step"] > 0


def test_conversion_memory_measures_both_commands(tmp_path):
  done = subprocess.run([sys.executable, "scripts/conversion_memory.py", "--config",
                         "configs/tiny_qwen3_moe.py", "--work", str(tmp_path / "conv")],
                        cwd=ROOT, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr[-2000:]
  record = json.loads(done.stdout.strip().splitlines()[-1])
  assert 0 < record["largest_tensor_gb"] <= record["checkpoint_gb"]
  for step in ("import", "export"):
    assert record[f"{step}_peak_rss_gb"] >= record["jax_process_rss_gb"] > 0
  assert (tmp_path / "conv" / "back" / "model.safetensors").is_file()


def test_exchange_bench_checks_and_times_the_fixed_exchange(tmp_path):
  """On 4 simulated CPU devices: the fixed-size exchange delivers every copy (balanced, and with
  70% of the copies to one device, in the rounds the blocks need) and is timed; XLA:CPU has no
  ragged all-to-all, which the line says. The delivery check fails on a wrong delivery."""
  for hot, rounds in ((None, 1), ("0.7", 3)):
    done = subprocess.run([sys.executable, "scripts/exchange_bench.py", "--config",
                           "configs/tiny_qwen3_moe.py", "--devices", "4", "--iters", "2",
                           *(["--hot", hot] if hot else [])], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["devices"] == 4 and record["rounds"] == rounds, record
    assert record["fixed"]["ms"] > 0 and "not supported on cpu" in record["ragged"]
  sys.path.insert(0, str(ROOT / "scripts"))
  from exchange_bench import check_received, send_counts
  counts = send_counts(6, 2, 0.5)  # 3 copies each way
  x = np.arange(12 * 2, dtype=np.float32).reshape(12, 2)
  # What the ragged exchange delivers: for each receiver, sender 0's rows, then sender 1's.
  delivered = np.concatenate([x[0:3], x[6:9], x[3:6], x[9:12]])
  check_received("ragged", delivered, x, counts, block=3)
  delivered[4, 0] += 1
  try:
    check_received("ragged", delivered, x, counts, block=3)
  except AssertionError as e:
    assert "device 0 did not receive device 1's rows" in str(e)
  else:
    raise AssertionError("a wrong delivery passed the check")


def test_hf_peer_asks_each_family_for_an_attention_transformers_accepts(tmp_path):
  """The peer's attention table against transformers itself (the reference Python, on the CPU):
  every family jmoe exports has an entry, its first choice is one transformers accepts for the
  tiny model's config.json, so `auto` runs it; GPT-OSS's sinks rule out sdpa."""
  if not HF_PYTHON.exists():
    pytest.skip("no reference Python: run scripts/hf_reference_env.sh")
  from jmoe.checkpoint.hf_families import FAMILIES, check_exportable
  from jmoe.config import load_config
  hf_configs = []
  for name in ("tiny_qwen3_moe", "tiny_mixtral", "tiny_deepseek_v3", "tiny_gpt_oss"):
    config = load_config(ROOT / "configs" / f"{name}.py")
    hf_configs.append(check_exportable(config.model, config.moe).to_hf(config.model, config.moe))
  (tmp_path / "configs.json").write_text(json.dumps(hf_configs))
  subprocess.run([HF_PYTHON, ROOT / "tests" / "hf_reference.py", "attention",
                  str(tmp_path / "configs.json"), str(tmp_path / "out.json")],
                 check=True, capture_output=True, timeout=300)
  found = json.loads((tmp_path / "out.json").read_text())
  sys.path.insert(0, str(ROOT / "scripts"))
  from hf_peer import ATTENTION
  assert set(found) == set(ATTENTION) == {f.architecture for f in FAMILIES.values()}
  for name, choice in found.items():
    assert choice["auto"] == ATTENTION[name][0] in choice["accepts"], (name, choice)
  assert "sdpa" not in found["GptOssForCausalLM"]["accepts"]
