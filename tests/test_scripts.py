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
       "--config.model.num_layers=2", "--loop", "3", "--config.checkpoint.every=2",
       "--settle", "0.5"],
      cwd=ROOT, capture_output=True, text=True, timeout=240,
      env=command_env())
  assert result.returncode == 0, result.stderr[-3000:]
  record = json.loads(result.stdout.strip().splitlines()[-1])
  assert record["routing"] == "balanced" and record["expert_load_max_over_mean"] == 1.0
  assert record["gemm"] == "ragged_dot" and record["tokens_per_s_per_device"] > 0
  assert 0 < record["mfu_measured_gemm"] and record["tflops_per_device"] > 0
  # untimed steps for half a second between the warm-up and the timed steps
  assert record["settle_s"] >= 0.5 and record["settle_steps"] >= 1
  # jmoe.train's loop as train.steps=3 runs it, timed after 1 warm-up step: a checkpoint at
  # step 2 and the last at step 3
  assert record["loop_steps"] == 3 and record["loop_timed_steps"] == 2
  assert record["loop_checkpoints"] == 2
  assert record["loop_tokens_per_s"] > 0 and record["loop_vs_step"] > 0
  # the last save split into its call (checks, the copy to the host) and the wait for the rest
  # (the last save returns written: its parts go to the host as the write goes on)
  assert record["loop_last_save_call_s"] > 0 and record["loop_last_save_wait_s"] >= 0
  assert record["loop_last_save_written_s"] <= record["loop_last_save_call_s"] + 0.01
  assert [step for step, _ in record["loop_intervals"]] == [3]  # logged past the warm-up
  assert isinstance(record["loop_loader_wait_s"], float)
  # the bare step again on the loop's last state, and the loop's steps against it
  assert record["loop_end_bare_step_ms"] > 0 and record["loop_steps_vs_end_step"] > 0
  # and in the middle of the timed run's thirds (after its steps 1, 1 and 2 of 2: one before
  # its end), on a copy of the state
  assert record["loop_probe_steps"] == [2] and record["loop_probe_bare_step_ms"][0] > 0
  assert record["loop_steps_vs_mean_step"] > 0 and record["loop_vs_mean_step"] > 0


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
  from jmoe.hf.families import FAMILIES, check_exportable
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


# ---- the torchtitan peer (scripts/titan_peer.py) and benchmark.py's --peer choices ----

def scripts_module(name):
  sys.path.insert(0, str(ROOT / "scripts"))
  try:
    return __import__(name)
  finally:
    sys.path.remove(str(ROOT / "scripts"))


# What titan_peer.titan_args must give for the tiny configs: torchtitan 0.2.2's ModelArgs and
# MoEArgs keyword arguments, written out from the configs' values.
TINY_MOE = dict(num_experts=8, top_k=2, score_func="softmax", route_norm=True, route_scale=1.0,
                num_expert_groups=None, num_limited_groups=None, score_before_experts=False,
                use_grouped_mm=True, load_balance_coeff=None, _debug_force_load_balance=False)
TINY_TITAN = {
    "tiny_qwen3_moe": {
        "model": "Qwen3Model",
        "args": dict(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=16, vocab_size=264,
                     hidden_dim=512, norm_eps=1e-6, rope_theta=10_000.0, qk_norm=True,
                     enable_weight_tying=False, moe_enabled=True, moe_inter_dim=128,
                     max_seq_len=128, attn_type="sdpa", attn_mask_type="causal"),
        "moe_args": dict(TINY_MOE, num_shared_experts=0, gate_bias=False)},
    "tiny_deepseek_v3": {
        "model": "DeepSeekV3Model",
        "args": dict(dim=128, n_layers=4, n_dense_layers=1, n_heads=8, vocab_size=264,
                     inter_dim=512, moe_inter_dim=128, norm_eps=1e-6, q_lora_rank=64,
                     kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     rope_theta=10_000.0, rope_factor=1.0, original_seq_len=4096,
                     beta_fast=32.0, beta_slow=1.0, mscale=0.0, max_seq_len=128,
                     attn_type="flex", attn_mask_type="causal"),
        "moe_args": dict(TINY_MOE, num_shared_experts=1, gate_bias=False, score_func="sigmoid",
                         route_scale=2.5, num_expert_groups=4, num_limited_groups=2,
                         load_balance_coeff=0.001)},
    "tiny_gpt_oss": {
        "model": "GptOssModel",
        "args": dict(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=16, vocab_size=264,
                     moe_inter_dim=128, norm_eps=1e-6, swiglu_limit=7.0, sliding_window_size=32,
                     rope_theta=10_000.0, rope_factor=1.0, original_seq_len=4096, ntk_alpha=1.0,
                     ntk_beta=32.0, max_seq_len=128, attn_type="flex", attn_mask_type="causal"),
        # softmax over the chosen logits: torchtitan's softmax, renormalised over the chosen
        "moe_args": dict(TINY_MOE, num_shared_experts=0, gate_bias=True)},
}


def torchtitan_params(spec: dict) -> int:
  """Parameters of torchtitan 0.2.2's model of `spec`, from its modules' shapes (weights
  [out, in]; its tiny models built under torch 2.11 have 1,842,432 (Qwen3), 1,796,608
  (DeepSeek-V3) and 1,856,192 (GPT-OSS))."""
  a, m = spec["args"], spec["moe_args"]
  D, V, E, F = a["dim"], a["vocab_size"], m["num_experts"], a["moe_inter_dim"]
  total = V * D * (1 if a.get("enable_weight_tying") else 2) + D  # embedding, head, final norm
  moe = E * D + E * m["gate_bias"] + 3 * E * F * D + 3 * D * F * m["num_shared_experts"]
  for layer in range(a["n_layers"]):
    total += 2 * D  # the two norms
    if spec["model"] == "DeepSeekV3Model":
      H, q, kv = a["n_heads"], a["q_lora_rank"], a["kv_lora_rank"]
      qk = a["qk_nope_head_dim"] + a["qk_rope_head_dim"]
      total += (D * q + q + q * H * qk) if q else D * H * qk  # queries (through their latent)
      total += D * (kv + a["qk_rope_head_dim"]) + kv  # the key-value latent and its norm
      total += kv * H * (a["qk_nope_head_dim"] + a["v_head_dim"]) + H * a["v_head_dim"] * D
      total += 3 * D * a["inter_dim"] if layer < a["n_dense_layers"] else moe
      continue
    H, KV, hd = a["n_heads"], a["n_kv_heads"], a["head_dim"]
    total += 2 * D * H * hd + 2 * D * KV * hd  # query, output, key, value projections
    if spec["model"] == "Qwen3Model":
      total += 2 * hd * a["qk_norm"] + moe
    else:  # GPT-OSS: projection biases, sinks, experts with their biases (gate and up fused)
      total += H * hd + 2 * KV * hd + D + H + moe + 2 * E * F + E * D
  return total


def test_titan_peer_maps_each_family_onto_torchtitans_arguments():
  """jmoe's tiny Qwen3-MoE, DeepSeek-V3 and GPT-OSS configs become torchtitan's model arguments
  as written out above, and the model those arguments build has jmoe's parameter count."""
  from jmoe.config import load_config
  peer = scripts_module("titan_peer")
  for name, expected in TINY_TITAN.items():
    config = load_config(ROOT / "configs" / f"{name}.py")
    spec = peer.titan_args(config)
    assert spec == expected, name
    assert torchtitan_params(spec) == peer.jmoe_params(config), name
  config = load_config(ROOT / "configs" / "tiny_qwen3_moe.py")
  spec = peer.titan_args(config, attention="flex", balanced=True)
  assert spec["args"]["attn_type"] == "flex" and spec["moe_args"]["_debug_force_load_balance"]
  peer.check_params(1_000_999, 1_000_000)
  with pytest.raises(ValueError, match=r"1,002,000 parameters, jmoe's 1,000,000 \(\+2,000\)"):
    peer.check_params(1_002_000, 1_000_000)


@pytest.mark.parametrize("name, overrides, attention, message", [
    ("tiny_mixtral", [], "auto", "model.family='mixtral': torchtitan has no Mixtral model"),
    ("tiny_moe", [], "auto", "model.family (for the torchtitan peer) must be one of"),
    ("tiny_qwen3_moe", ["--config.model.attention_bias=true"], "auto",
     "model.attention_bias=True: torchtitan's Qwen3 model runs model.attention_bias=False only; "
     "set --config.model.attention_bias=False"),
    ("tiny_qwen3_moe", ["--config.moe.first_k_dense=1"], "auto", "moe.first_k_dense=1"),
    ("tiny_deepseek_v3", ["--config.model.mtp_depth=1"], "auto", "set --config.model.mtp_depth=0"),
    ("tiny_deepseek_v3", ["--config.moe.capacity_factor=1.25"], "auto", "moe.capacity_factor"),
    ("tiny_gpt_oss", ["--config.moe.swiglu_alpha=1.5"], "auto", "moe.swiglu_alpha=1.5"),
    ("tiny_gpt_oss", [], "sdpa", "--attention sdpa: torchtitan's GptOssModel runs ['flex']"),
])
def test_titan_peer_refuses_what_torchtitans_model_cannot_run(name, overrides, attention, message):
  from jmoe.config import ConfigError, load_config
  peer = scripts_module("titan_peer")
  with pytest.raises(ConfigError) as refused:
    peer.titan_args(load_config(ROOT / "configs" / f"{name}.py", overrides), attention)
  assert message in str(refused.value)


def test_titan_peer_builds_torchtitans_model_with_jmoes_parameter_count():
  """Where torch and torchtitan 0.2.2 are installed beside jmoe (the GPU image with the carried
  wheels): torchtitan's own model of each tiny config, built on the meta device, has jmoe's
  parameter count and the count `torchtitan_params` reads from its arguments."""
  pytest.importorskip("torch", reason="torch is not installed here (not a jmoe dependency); "
                      "the mapping test covers the arguments and their parameter count")
  pytest.importorskip("torchtitan", reason="torchtitan is not installed here (not a jmoe "
                      "dependency); the mapping test covers the arguments and their count")
  from jmoe.config import load_config
  peer = scripts_module("titan_peer")
  titan = peer.import_torchtitan()
  for name in TINY_TITAN:
    config = load_config(ROOT / "configs" / f"{name}.py")
    spec = peer.titan_args(config)
    model = peer.build_model(titan, spec)
    count = sum(p.numel() for p in model.parameters())
    assert count == peer.jmoe_params(config) == torchtitan_params(spec), name


def test_benchmark_peer_choices_keep_their_fields_apart():
  """--peer's value leaves the child command (and --record's); each peer's figures land under
  its own prefix, the transformers peer's under the names earlier records have."""
  bench = scripts_module("benchmark")
  choices = (*bench.PEERS, "all")
  argv = ["--config", "c.py", "--peer", "torchtitan", "--steps", "2", "--record", "r.jsonl",
          "--balanced"]
  child = bench.without_flag(bench.without_flag(argv, "--peer", choices), "--record")
  assert child == ["--config", "c.py", "--steps", "2", "--balanced"]
  assert bench.without_flag(["--peer", "--steps", "2"], "--peer", choices) == ["--steps", "2"]
  assert bench.without_flag(["--peer=all", "--record=r"], "--peer", choices) == ["--record=r"]
  figures = {"peer": "p", "experts_implementation": "grouped_mm", "attention": "sdpa",
             "step_ms": 10.0, "tokens_per_s_per_device": 100, "tflops_per_device": 50.0,
             "peak_memory_gib": 1.0}
  old = bench.peer_fields(figures, 100.0, "peer")
  assert old == {"peer": "p", "peer_experts": "grouped_mm", "peer_attention": "sdpa",
                 "peer_step_ms": 10.0, "peer_tokens_per_s_per_device": 100,
                 "peer_tflops_per_device": 50.0, "peer_peak_memory_gib": 1.0, "vs_peer": 2.0}
  titan = bench.peer_fields(dict(figures, compile="per block", params=7), 100.0,
                            bench.PEERS["torchtitan"][1])
  assert titan["peer_torchtitan"] == "p" and titan["vs_peer_torchtitan"] == 2.0
  assert titan["peer_torchtitan_compile"] == "per block" and titan["peer_torchtitan_params"] == 7
  assert not set(titan) & set(old)
  # a peer's settling and clocks under its own prefix
  clocked = bench.peer_fields(dict(figures, settle_s=30.1, settle_steps=12, gpu_sm_clock_mhz=1700,
                                   gpu_power_w=690.0, gpu_power_capped=1.0), 100.0, "peer")
  assert {k: v for k, v in clocked.items() if k not in old} == {
      "peer_settle_s": 30.1, "peer_settle_steps": 12, "peer_gpu_sm_clock_mhz": 1700,
      "peer_gpu_power_w": 690.0, "peer_gpu_power_capped": 1.0}


def test_benchmark_settles_its_peers_as_long_as_itself(monkeypatch, capsys):
  """--settle S reaches each peer's command (and only when S is above 0); a bad S is refused
  before anything runs."""
  bench = scripts_module("benchmark")
  commands = []

  def last_json(command):
    commands.append(command)
    return ({"tflops_per_device": 100.0} if command[1].endswith("benchmark.py") else
            {"peer": "p", "experts_implementation": "e", "attention": "a", "step_ms": 1.0,
             "tokens_per_s_per_device": 1, "tflops_per_device": 50.0, "peak_memory_gib": 1.0},
            "")
  monkeypatch.setattr(bench, "last_json", last_json)
  for settle, expected in ((["--settle", "2.5"], ["--settle", "2.5"]), ([], [])):
    commands.clear()
    assert bench.main(["--config", "c.py", "--peer", "all", *settle, "--config.a.b=1"]) == 0
    jmoe, *peers = commands
    assert jmoe[2:] == ["--config", "c.py", *settle, "--config.a.b=1"]
    assert [c[1].rsplit("/", 1)[-1] for c in peers] == ["hf_peer.py", "titan_peer.py"]
    assert all(c[2:] == ["--config", "c.py", *expected, "--config.a.b=1"] for c in peers)
  peers = [scripts_module(name).main for name in ("hf_peer", "titan_peer")]
  for main in (bench.main, *peers):  # each refuses before it builds anything
    for bad in ("-1", "nan", "inf", "soon"):
      with pytest.raises(SystemExit):
        main(["--config", "c.py", "--settle", bad])
      assert f"--settle: '{bad}': give a number of seconds" in capsys.readouterr().err


def test_settle_runs_synced_steps_until_its_time_has_passed():
  import time
  gpu_clocks = scripts_module("gpu_clocks")
  calls = []
  figures = gpu_clocks.settle(lambda: (calls.append("step"), time.sleep(0.01)),
                              lambda: calls.append("sync"), 0.05)
  assert calls == ["step", "sync"] * figures["settle_steps"]  # each step synced
  assert 1 <= figures["settle_steps"] <= 6 and figures["settle_s"] >= 0.05
  calls.clear()
  assert gpu_clocks.settle(lambda: calls.append("step"), lambda: None, 0) == {
      "settle_s": 0.0, "settle_steps": 0} and not calls


def test_save_cost_times_the_steps_beside_each_kind_of_save(tmp_path):
  target = tmp_path / "cost"
  result = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "save_cost.py"), "--config", "configs/tiny_moe.py",
       "--dir", str(target), "--variants", "default,nc-2", "--steps", "6",
       "--config.train.batch_size=4", "--config.data.seq_len=32", "--config.model.num_layers=2"],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=command_env(1))
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
  assert [line["variant"] for line in lines[:-1]] == ["default", "nc-2"]
  assert lines[0]["write_threads"] is None and lines[0]["compressed"]
  assert lines[1]["write_threads"] == 2 and not lines[1]["compressed"]
  assert all(line["write_s"] > 0 and line["on_disk_gib"] >= 0 for line in lines[:-1])
  assert lines[-1]["no_save"][0] == 6 and not target.exists()
  for argument, why in ((tmp_path, "exists"), (target, "'seven' is not default")):
    refused = subprocess.run([sys.executable, str(ROOT / "scripts" / "save_cost.py"), "--dir",
                              str(argument), "--variants", "7,seven"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and why in refused.stderr, refused.stderr
  assert tmp_path.exists() and not target.exists()


def test_save_rate_times_each_data_file_size_and_leaves_nothing(tmp_path):
  target = tmp_path / "saves"
  result = subprocess.run([sys.executable, str(ROOT / "scripts" / "save_rate.py"), str(target),
                           "--gib", "0.01", "--file-mib", "64,1", "--threads", "default,2",
                           "--raw-threads", "0,3", "--staging-gb", "0,0.002", "--parts-gb",
                           "0,0.001", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300, env=command_env())
  assert result.returncode == 0, result.stderr
  lines = [json.loads(line) for line in result.stdout.splitlines()]
  removals = [r for r in lines if "removed" in r]
  lines = [r for r in lines if "removed" not in r]
  runs = [(mib, threads, staging, parts) for mib in (64, 1) for threads in ("default", 2)
          for staging, parts in ((0, 0), (0, 0.001), (0.002, None))]
  assert [(r["file_mib"], r["threads"], r["staging_gb"], r["parts_gb"]) for r in lines] == runs
  assert [(r["file_mib"], r["threads"], r["staging_gb"], r["parts_gb"], r["removed"])
          for r in removals] == [(*run, 1) for run in runs]
  # (the save's phases; not staged and not in parts, `save` returns with the state on the host)
  assert all(0 <= r["on_host_s"] <= r["written_s"] <= r["finished_s"] <= r["seconds"]
             for r in lines), lines
  assert all(r["to_host_s"] < r["written_s"] for r in lines if not r["staging_gb"]
             and not r["parts_gb"]), lines
  assert all(r["to_host_s"] >= r["written_s"] for r in lines if r["staging_gb"]
             or r["parts_gb"]), lines
  assert all(r["remove_s"] > 0 and r["removed_gib"] > 0.004 for r in removals), removals
  cores = str(len(os.sched_getaffinity(0)))
  assert all(r["seconds"] > 0 and 0.005 <= r["state_gib"] <= 0.02 and r["on_disk_gib"] > 0.004
             and 0 <= r["to_host_s"] <= r["seconds"]
             and (r["write_gb_per_s"] is None) == bool(r["staging_gb"] or r["parts_gb"])
             and (r["write_gb_per_s"] is None or r["write_gb_per_s"] > 0)
             and set(r["raw_gb_per_s"]) == {cores, "3"} and min(r["raw_gb_per_s"].values()) > 0
             for r in lines), lines
  assert not target.exists()
  for argument, why in (([str(tmp_path)], "exists"),
                        ([str(target), "--threads", "4,all"], "--threads: each is a whole number"),
                        ([str(target), "--staging-gb", "1,-2"], "--staging-gb: each is a number"),
                        ([str(target), "--parts-gb", "inf"], "--parts-gb: each is a number"),
                        ([str(target), "--repeats", "0"], "--repeats: 1 or more")):
    refused = subprocess.run([sys.executable, str(ROOT / "scripts" / "save_rate.py"), *argument],
                             capture_output=True, text=True, timeout=120, env=command_env())
    assert refused.returncode == 2 and why in refused.stderr, refused.stderr
  assert not target.exists()


def test_chunk_rate_writes_the_array_by_each_chunk_shape_and_leaves_nothing(tmp_path):
  """scripts/chunk_rate.py times a plain write and, per chunk shape, a TensorStore write by
  reference and one without; what it writes reads back whole, chunked as asked; bad shapes are
  refused before anything is written."""
  target = tmp_path / "writes"
  result = subprocess.run([sys.executable, str(ROOT / "scripts" / "chunk_rate.py"), str(target),
                           "--shape", "4,6,128,64", "--chunks", "1,1,128,64:2,6,128,64",
                           "--threads", "2", "--repeats", "2"],
                          capture_output=True, text=True, timeout=120, env=command_env())
  assert result.returncode == 0, result.stderr
  lines = [json.loads(line) for line in result.stdout.splitlines()]
  assert [(r["repeat"], r.get("chunk"), r.get("by_reference")) for r in lines] == [
      (repeat, chunk, by_reference) for repeat in (0, 1)
      for chunk, by_reference in ((None, None), ([1, 1, 128, 64], True), ([1, 1, 128, 64], False),
                                  ([2, 6, 128, 64], True), ([2, 6, 128, 64], False))]
  assert all(r["shape"] == [4, 6, 128, 64] and r["threads"] == 2 and r["seconds"] > 0
             and r["gb_per_s"] > 0 for r in lines), lines
  assert [r.get("plain") for r in lines].count(True) == 2 and not target.exists()

  import numpy as np
  import tensorstore as ts
  sys.path.insert(0, str(ROOT / "scripts"))
  from chunk_rate import spec, tensorstore_write
  array = np.arange(4 * 6 * 16 * 8, dtype=np.uint16).reshape(4, 6, 16, 8)
  for chunk in ((1, 1, 16, 8), (2, 6, 16, 8)):
    assert tensorstore_write(array, target, chunk, 2, by_reference=True) > 0
    written = spec(target, array.shape, chunk, 2**20)
    stored = ts.open({"driver": written["driver"], "kvstore": written["kvstore"]},
                     open=True).result()
    assert stored.chunk_layout.read_chunk.shape == chunk
    np.testing.assert_array_equal(stored.read().result(), array)

  for argument, why in (([str(tmp_path)], "exists"),
                        ([str(target), "--shape", "4,0"], "--shape: each is a whole number"),
                        ([str(target), "--shape", "4,6", "--chunks", "1,6,1"], "not a chunk"),
                        ([str(target), "--shape", "4,6", "--chunks", "1,7"], "not a chunk"),
                        ([str(target), "--repeats", "0"], "--repeats: 1 or more")):
    refused = subprocess.run([sys.executable, str(ROOT / "scripts" / "chunk_rate.py"), *argument],
                             capture_output=True, text=True, timeout=120, env=command_env())
    assert refused.returncode == 2 and why in refused.stderr, refused.stderr


def test_benchmark_reads_the_gpu_clocks_nvidia_smi_samples():
  """nvidia-smi's samples ("MHz, W, throttle reasons" per GPU and sample, as `GpuClocks` asks
  for them) give the mean clock and power and the share held at the power cap (reason 0x4);
  unreadable lines are skipped, and no samples give no figures."""
  sys.path.insert(0, str(ROOT / "scripts"))
  import gpu_clocks
  samples = ("1980, 136.28, 0x0000000000000000\n1725, 688.40, 0x0000000000000004\n"
             "[N/A], [N/A], [N/A]\n1455, 695.22, 0x0000000000000005\n1500, 69")
  assert gpu_clocks.clock_figures(samples) == {
      "gpu_sm_clock_mhz": 1720, "gpu_power_w": 506.6, "gpu_power_capped": 0.67}
  assert gpu_clocks.clock_figures("") == {}
  import shutil
  if shutil.which("nvidia-smi") is None:  # (as on CI) nothing sampled, nothing reported
    with gpu_clocks.GpuClocks() as clocks:
      pass
    assert clocks.figures() == {}


def test_loss_compare_trains_each_variant_from_the_same_start(tmp_path):
  small = ["--set", "train.warmup_steps=1", "--set", "model.num_layers=1", "--set",
           "train.batch_size=4", "--set", "data.seq_len=32"]
  result = subprocess.run(
      [sys.executable, "scripts/loss_compare.py", "--config", "configs/tiny_moe.py", "--steps",
       "4", *small, "--seeds", "2", "--variant", "base=", "--variant", "again=train.lr=0.003",
       "--variant", "bad=train.lr=-1", "--record", str(tmp_path / "r.jsonl")],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=command_env())
  # the failed variant is reported and the rest still run; the exit says one failed
  assert result.returncode == 1, result.stderr[-3000:]
  assert "train.lr" in result.stderr
  lines = [json.loads(l) for l in result.stdout.strip().splitlines()]
  runs = [l for l in lines if "eval_loss" in l]
  assert [(r["variant"], r["seed"], r["overrides"][0]) for r in runs] == [
      ("base", 0, "train.seed=0"), ("again", 0, "train.seed=0"), ("base", 1, "train.seed=1"),
      ("again", 1, "train.seed=1")]
  assert [(l["variant"], l["seed"]) for l in lines if l.get("failed")] == [("bad", 0), ("bad", 1)]
  # the same settings (lr 3e-3 is the config's own) from the same start: the same loss; another
  # seed, another run
  assert runs[1]["eval_loss"] == runs[0]["eval_loss"] and runs[1]["vs_first"] == 1.0
  assert runs[3]["eval_loss"] == runs[2]["eval_loss"] != runs[0]["eval_loss"]
  summaries = {l["variant"]: l for l in lines if l.get("summary")}
  assert set(summaries) == {"base", "again"} and summaries["again"]["runs"] == 2
  assert summaries["again"]["vs_first_mean"] == 1.0
  assert summaries["base"]["min_eval_loss"] < summaries["base"]["max_eval_loss"]
  records = [json.loads(l) for l in (tmp_path / "r.jsonl").read_text().splitlines()]
  assert len(records) == 6 and {r["kind"] for r in records} == {"loss_4_steps"}
  assert all(r["devices"] == 1 for r in records if "eval_loss" in r)
  bad = subprocess.run([sys.executable, "scripts/loss_compare.py", "--config",
                        "configs/tiny_moe.py", "--variant", "noequals"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env=command_env())
  assert bad.returncode != 0 and "NAME=OVERRIDES" in bad.stderr
  (tmp_path / "file").write_text("")
  bad = subprocess.run([sys.executable, "scripts/loss_compare.py", "--config",
                        "configs/tiny_moe.py", "--variant", "base=", "--record",
                        str(tmp_path / "file" / "r.jsonl")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env=command_env())
  assert bad.returncode != 0 and "is a file, so nothing can be written" in bad.stderr
  assert "RESULT" not in bad.stdout and not bad.stdout.strip()  # refused before any run


def test_benchmark_profile_breakdown_names_each_kernels_kind_scope_and_pass(tmp_path):
  """A profiled step's kernels (a trace's GPU events, summed by name) are split by kind, and
  by kind and the model scope and pass the compiled program's metadata names; every kernel is
  written to kernels.tsv with its time, launches and output shape, the program beside it; events
  of the host's threads are not counted."""
  import gzip
  profile = scripts_module("profile_kernels")
  meta = lambda op: f'metadata={{op_name="{op}" source_file="/x/jmoe/moe/layer.py" source_line=9}}'
  hlo = "\n".join([
      f"  %loop_convert_fusion.3 = bf16[8,4]{{1,0}} fusion(f32[8,4]{{1,0}} %p), kind=kLoop, "
      f"{meta('jit(train_step)/jvp()/experts/cvt')}",
      f"  %input_reduce_fusion = (f32[8]{{0}}, f8e4m3fn[8,2]{{1,0}}) fusion(), "
      f"{meta('jit(train_step)/transpose(jvp())/eval_jaxpr/experts/reduce_max')}",
      f"  ROOT %loop_concatenate_fusion = f32[8] fusion(), "
      f"{meta('jit(train_step)/optimizer/convert_element_type')}"])
  gpu, host = 1, 2
  events = [{"ph": "M", "name": "process_name", "pid": gpu, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": host, "args": {"name": "/host:CPU"}}]
  for name, pid, us in [("loop_convert_fusion.3", gpu, 100), ("input_reduce_fusion", gpu, 300),
                        ("loop_concatenate_fusion", gpu, 400), ("nvjet_sm90_tss", gpu, 200),
                        ("loop_convert_fusion.3", gpu, 100), ("body_mosaic_gpu_kernel", host, 999)]:
    events.append({"ph": "X", "name": name, "pid": pid, "dur": us})
  trace = tmp_path / "plugins" / "profile" / "run"
  trace.mkdir(parents=True)
  with gzip.open(trace / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)

  found = profile.kernel_breakdown(str(tmp_path), hlo)
  assert found["device_ms"] == 1.1
  assert found["share"] == {"other": 0.8182, "gemm": 0.1818}
  assert found["by_scope"] == {"other | optimizer": 0.3636, "other | experts, backward": 0.2727,
                               "gemm | unknown": 0.1818, "other | experts, forward": 0.1818}
  assert found["top_kernels"][0] == ["loop_concatenate_fusion", 0.3636,
                                     "jit(train_step)/optimizer/convert_element_type @ "
                                     "moe/layer.py:9"]
  rows = (tmp_path / "kernels.tsv").read_text().splitlines()
  assert rows[0].split("\t") == ["ms", "launches", "share", "kind", "kernel", "output",
                                  "source"]
  assert [r.split("\t")[5] for r in rows[1:]] == [
      "f32[8]", "(f32[8], f8e4m3fn[8,2])", "bf16[8,4]", ""]
  assert (tmp_path / "step.hlo.txt").read_text() == hlo
  assert [r.split("\t")[:5:4] for r in rows[1:]] == [
      ["0.400", "loop_concatenate_fusion"], ["0.300", "input_reduce_fusion"],
      ["0.200", "loop_convert_fusion.3"], ["0.200", "nvjet_sm90_tss"]]
  assert [r.split("\t")[1] for r in rows[1:]] == ["1", "1", "2", "1"]
  assert profile.scope_of("jit(train_step)/jvp()/while/body/eval_jaxpr/dot_general") == (
      "rest, forward")
  assert profile.scope_of("jit(train_step)/transpose(jvp(experts))/mul") == "experts, backward"
  # a tuple of six or more outputs carries XLA's index comments
  six = ", ".join(["f32[8]{0}"] * 5 + ["/*index=5*/bf16[2,2]{1,0}"])
  assert profile.kernel_outputs(f"  %input_add_fusion.7 = ({six}) fusion(f32[8]{{0}} %a)") == {
      "input_add_fusion_7": "(" + ", ".join(["f32[8]"] * 5 + ["bf16[2,2]"]) + ")"}


@pytest.mark.parametrize("sizes, block", [([0, 39, 39, 0, 360, 0], 512),
                                         ([0, 39, 39, 0, 360, 0], 16), ([7, 1, 2], 4),
                                         ([0, 0, 0], 8)])
def test_the_gpu_checks_reference_is_each_experts_own_float32_product(sizes, block):
  """scripts/check_gpu.py's reference (on the device, `block` rows of one expert at a time) is
  numpy's float32 products expert by expert, on the bf16 inputs, whether an expert's rows take
  one block or several: rows past the groups and experts without rows exactly zero."""
  check_gpu = scripts_module("check_gpu")
  import jax
  import jax.numpy as jnp
  sizes = np.asarray(sizes)
  rows, (experts, d, f) = int(sizes.sum()) + 13, (len(sizes), 24, 40)
  keys = jax.random.split(jax.random.key(0), 3)
  x, w, dy = (jax.random.normal(k, s, jnp.bfloat16)
              for k, s in zip(keys, [(rows, d), (experts, d, f), (rows, f)]))
  got = check_gpu.reference(x, w, dy, sizes, block)
  x, w, dy = (np.asarray(a, np.float32) for a in (x, w, dy))
  want = np.zeros((rows, f), np.float32), np.zeros((rows, d), np.float32), np.zeros_like(w)
  ends = np.cumsum(sizes)
  for e, (start, end) in enumerate(zip(ends - sizes, ends)):
    want[0][start:end], want[1][start:end] = x[start:end] @ w[e], dy[start:end] @ w[e].T
    want[2][e] = x[start:end].T @ dy[start:end]
  for a, b in zip(got, want):
    assert a.dtype == np.float32 and a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert not got[0][ends[-1]:].any() and not got[1][ends[-1]:].any()
  assert all(not got[2][e].any() for e in range(experts) if not sizes[e])


def test_the_gpu_checks_attention_cases_load_apart_from_the_gemm_checks():
  """scripts/check_gpu.py's attention checks live in check_gpu_attention.py (run by check_gpu.py
  on the GPU): it imports here, its quick cases are among its cases, and each makes a job."""
  attention = scripts_module("check_gpu_attention")
  assert set(attention.QUICK_ATTENTION) <= set(attention.ATTENTION_CASES)
  assert len(attention.attention_jobs(attention.ATTENTION_CASES)) == len(attention.ATTENTION_CASES)


@pytest.mark.parametrize("room", [True, False, "part"])
def test_the_loops_bare_step_probe_leaves_the_trainer_where_it_was(tmp_path, monkeypatch, room):
  """scripts/loop_timing.py's probe (`keep=False`) times steps on a copy of the trainer's state,
  on the devices where they have room for all of it, else (no room, or room for part of it
  only) on the state itself while a copy waits in host memory: either way the trainer's state
  after it is the one before, bit for bit, on the same devices, and the loop goes on from it."""
  sys.path.insert(0, str(ROOT / "scripts"))
  import jax
  import loop_timing
  from helpers import tiny_config
  from jmoe.checkpoint import manager
  from jmoe.train.loop import Trainer
  real_copy = manager.device_copy
  copies = []

  def copied(tree, *_, **how):
    copies.append(tree)
    if not room:
      return None
    state = max(manager.bytes_per_device(jax.tree.leaves(tree)).values())
    half = state / 2 / 0.95 if room == "part" else 1 << 40  # (room for half the state)
    stats = lambda device: {"bytes_limit": half, "peak_bytes_in_use": 0}
    assert bool(manager.copy_split(jax.tree.leaves(tree), stats)) == (room == "part")
    return real_copy(tree, stats, **how)

  monkeypatch.setattr(manager, "device_copy", copied)
  config = tiny_config(train=dict(steps=4, log_every=1))
  with Trainer(config, tmp_path, progress=False) as trainer:
    trainer.train(2)
    before = jax.tree.leaves(trainer.state)
    values = [np.asarray(x) for x in before]
    seconds, _ = loop_timing.bare_step_s(trainer, 1, keep=False, repeats=2)
    after = jax.tree.leaves(trainer.state)
    assert seconds > 0 and len(copies) == 1
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(values, after))
    assert [x.sharding for x in after] == [x.sharding for x in before]
    # where the copy was the probe's, the loop's own arrays were never touched
    assert all(a is b for a, b in zip(before, after)) == (room is True)
    trainer.train(1)
    assert trainer.step == 3


def test_the_loops_step_after_each_probe_runs_untimed_unless_it_saves(tmp_path):
  """scripts/loop_timing.py: the loop's first step after a probe (slowed by the probe, not by
  the loop) is left out of the timed steps, except where it is a checkpoint's step (a save's
  cost is the loop's) or its part has no other step; the run still takes all its steps."""
  sys.path.insert(0, str(ROOT / "scripts"))
  import loop_timing
  from helpers import tiny_config
  config = tiny_config(train=dict(steps=9, log_every=1), checkpoint=dict(every=6, keep=5))
  # 8 timed steps after 1: probes after timed steps 1, 4 and 7 (steps 2, 5 and 8); after the
  # first, step 3 runs untimed; after the second, step 6 saves (timed); after the third, 9 is
  # alone in its part (timed)
  figures = loop_timing.loop_figures(config, steps=9, warmup=1, probes=3)
  assert figures["loop_probe_steps"] == [2, 5, 8]
  assert figures["loop_untimed_after_probes"] == 1 and figures["loop_timed_steps"] == 7
  assert figures["loop_checkpoints"] == 2  # (steps 6 and 9: every step was taken)
  # (the last save's phases, from its call: within the time the loop gives it)
  phases = [figures[f"loop_last_save_{k}_s"] for k in ("on_host", "written", "finished")]
  assert 0 <= phases[0] <= phases[1] <= phases[2] <= figures["loop_last_write_s"] + 0.05
  assert figures["loop_last_save_removing_s"] == 0.0  # (keep=5: nothing removed)
  logged = [step for step, _ in figures["loop_intervals"]]
  assert 3 not in logged and {4, 5, 6, 7, 8, 9} <= set(logged), logged


def test_save_timeline_finds_the_devices_idle_gaps_and_what_the_host_did_in_them():
  """`scripts/save_timeline.py`'s reading of a trace: the device's gaps over 1 ms (the largest
  first, from the save call), the host thread's innermost frames in them, the busy shares before,
  while the state goes to the host and after, and the copies to the host."""
  sys.path.insert(0, str(ROOT / "scripts"))
  from save_timeline import SAVE_CALL, TO_HOST, timeline
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
  span = lambda name, pid, tid, ts, dur, **args: dict(ph="X", name=name, pid=pid, tid=tid, ts=ts,
                                                       dur=dur, args=args)
  kernels = [span("gemm", 1, 7, 0, 100), span("fusion", 1, 7, 100, 100),
             span("gemm", 1, 7, 2400, 1600), span("gemm", 1, 7, 5200, 2800)]
  copies = [span("MemcpyDtoH", 1, 9, 2500, 1500, bytes=2**30),
            span("MemcpyDtoH", 1, 9, 4500, 1500, bytes=2**30),
            span("MemcpyDtoH", 1, 7, 7900, 10, bytes=4)]  # (the step's loss: not the save's)
  host = [span("train", 2, 3, 0, 8000), span(SAVE_CALL, 2, 3, 210, 2090),
          span("all_finite", 2, 3, 220, 1280), span("device_copy", 2, 3, 1500, 800),
          span("_log", 2, 3, 4100, 1000), span(TO_HOST, 2, 4, 2300, 3700)]
  figures = timeline(meta + kernels + copies + host)
  assert figures["window_ms"] == 8.0 and figures["device_idle_ms"] == 3.4
  assert figures["idle_before_save_ms"] == 0.01 and figures["idle_after_save_ms"] == 3.39
  assert figures["gaps"] == [[-0.01, 2.2, ["all_finite (1.3 ms)", "device_copy (0.8 ms)"]],
                             [3.79, 1.2, ["_log (1.0 ms)"]]]
  assert figures["busy_before"] == round(200 / 210, 4)
  assert figures["busy_while_to_host"] == round(2300 / 3500, 4) and figures["busy_after"] == 1.0
  assert figures["d2h_copies"] == 3 and figures["d2h_large"] == 2 and figures["d2h_gib"] == 2.0
  assert figures["d2h_ms"] == [2.29, 5.79] and figures["to_host_ms"] == [2.09, 5.79]
  assert "error" in timeline(meta + kernels + host[:1])  # no save in the window
  assert "error" in timeline(meta + host)  # no device kernels
  for arguments, why in ((["--variants", "pinned,fast"], "each is pinned, paced, lead or pageable"),
                         (["--save-at", "6", "--after", "3"], "--after from 1 to --save-at - 4"),
                         (["--variants", "pinned,lead", "--after", "5", "--lead", "5"],
                          "--lead must be from 1 to --after - 1")):
    refused = subprocess.run([sys.executable, str(ROOT / "scripts" / "save_timeline.py"),
                              *arguments], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and why in refused.stderr, refused.stderr
