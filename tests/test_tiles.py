"""Tile configs of the Mosaic-GPU grouped GEMMs: the default for every shape, the tuning sweep's
candidates and shapes, and the padded path, all without a GPU (the kernels stand in as plain
ragged dots that check what the kernels require)."""

import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmoe.config import load_config
from jmoe.ops import mosaic_gemm
from jmoe.ops.mosaic_gemm import KINDS, Tiles, default_tiles, tiles_for

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import tune_gemm  # noqa: E402

ODD_SHAPES = [(96, 80), (2048, 16), (16, 1536), (100, 300), (1, 1), (2880, 2880), (192, 4096),
              (4160, 1000), (5760, 2880), (64, 64), (28672, 4096), (1408, 2816)]


def preset_gemms():
  configs = [(str(p.relative_to(ROOT)), load_config(p)) for p in tune_gemm.preset_paths()]
  return [g for _, c in configs if tune_gemm.has_experts(c) for g in tune_gemm.gemm_shapes(c)]


PRESET_GEMMS = preset_gemms()


def test_presets_are_found():
  names = [p.name for p in tune_gemm.preset_paths()]
  assert "qwen3_235b_a22b.py" in names and "qwen3_30b_a3b_1gpu.py" in names
  assert not any(n.startswith(("tiny_", "sft_")) for n in names)
  assert "qwen3_30b_a3b_8gpu.py" not in names  # a multi-GPU bench layout
  assert len(PRESET_GEMMS) >= 6 * 5


def _extra_work(kind, k, n, tiles):
  k_pad, n_pad = tiles.padded(kind, k, n)
  return k_pad * n_pad / (k * n) - 1


@pytest.mark.parametrize("kind", KINDS)
def test_default_runs_on_every_preset_shape_with_little_padding(kind):
  for gemm in (g for g in PRESET_GEMMS if g.kind == kind):
    t = default_tiles(kind, gemm.k, gemm.n)
    assert t.runs(kind), (gemm, t)
    assert t.fits(kind, *t.padded(kind, gemm.k, gemm.n))
    # Every preset width is a multiple of 64: the forward and input gradient never pad (padding
    # would copy the weights), and the weight gradient pads at most 2880 -> 2944 on each side.
    assert t.fits(kind, gemm.k, gemm.n) or (kind == "drhs" and
                                            _extra_work(kind, gemm.k, gemm.n, t) < 0.05), (gemm, t)
    assert t.block_m * t.block_n >= 128 * 128, (gemm, t)  # no 64-wide cliff on a preset


def test_default_picks_the_measured_blocks():
  assert default_tiles("fwd", 2048, 1536) == Tiles(128, 192, 64, 4, 4)  # the measured best
  assert default_tiles("dlhs", 2048, 768) == Tiles(128, 192, 64, 4, 4)
  assert default_tiles("dlhs", 1536, 2048) == Tiles(128, 128, 64, 4, 4)
  assert default_tiles("drhs", 2048, 1536) == Tiles(128, 128, 64, 4, 1)
  # GPT-OSS: 2880 = 15 x 192 takes no band of 2 or 4 (a narrower band before a smaller block),
  # and its weight gradient pads to 2944 rather than drop to 64 x 64 tiles.
  assert default_tiles("fwd", 2880, 2880) == Tiles(128, 192, 64, 4, 1)
  assert default_tiles("fwd", 2880, 5760) == Tiles(128, 192, 64, 4, 2)
  gpt_oss = default_tiles("drhs", 2880, 2880)
  assert (gpt_oss.block_m, gpt_oss.block_n) == (128, 128)
  assert gpt_oss.padded("drhs", 2880, 2880) == (2944, 2944)
  # A LoRA factor of rank 16: padded to 64, not 128.
  assert default_tiles("drhs", 2048, 16).padded("drhs", 2048, 16) == (2048, 64)


@pytest.mark.parametrize("kind", KINDS)
def test_default_for_odd_shapes_pads_to_what_it_fits(kind):
  for k, n in ODD_SHAPES:
    t = default_tiles(kind, k, n)
    k_pad, n_pad = t.padded(kind, k, n)
    assert t.runs(kind) and t.fits(kind, k_pad, n_pad) and k_pad >= k and n_pad >= n
    if kind != "drhs":  # only to multiples of 64: more would pad the weights
      assert (k_pad, n_pad) == (math.ceil(k / 64) * 64, math.ceil(n / 64) * 64), (k, n, t)


def test_shared_memory_estimate_agrees_with_what_ran():
  assert Tiles(64, 256, 64, 5, 4).runs("fwd")  # 200 KiB of tiles: ran, and was the best
  assert Tiles(128, 128, 128, 3).runs("drhs")
  assert not Tiles(128, 128, 128, 4).runs("drhs")  # 256 KiB: Mosaic refused it
  assert not Tiles(128, 256, 64, 5).runs("fwd")  # 240 KiB
  assert not Tiles(128, 256, 64, 3, 2).runs("fwd")  # fits, but spills the accumulator


@pytest.mark.parametrize("kind", KINDS)
def test_candidates_fit_exactly_and_fit_the_sm(kind):
  shapes = {(g.k, g.n) for g in PRESET_GEMMS if g.kind == kind} | set(ODD_SHAPES)
  for k, n in shapes:
    found = tune_gemm.candidates(kind, k, n)
    assert len(set(found)) == len(found)
    for t in found:
      assert t.fits(kind, k, n) and t.runs(kind), (k, n, t)
      assert t.smem_bytes(kind) <= mosaic_gemm.SMEM_BYTES
    for limit in (1, 5, 12):
      plans = tune_gemm.plans(kind, k, n, limit)
      assert plans[0] == default_tiles(kind, k, n) and len(plans) <= limit
      assert len(set(plans)) == len(plans)
      assert all(t.fits(kind, k, n) for t in plans[1:])


def test_candidates_start_near_the_measured_best():
  assert tune_gemm.candidates("fwd", 2048, 1536)[0] == Tiles(128, 192, 64, 4, 4)
  assert tune_gemm.candidates("drhs", 2048, 1536)[:2] == [Tiles(128, 128, 64, 4),
                                                          Tiles(128, 128, 128, 3)]
  assert len(tune_gemm.plans("fwd", 2048, 1536, 12)) == 12


def test_shapes_follow_the_layout_and_deduplicate():
  qwen = load_config(ROOT / "configs/qwen3_30b_a3b.py")
  gemms = {g.name: g for g in tune_gemm.gemm_shapes(qwen, tokens=8192)}
  assert gemms["up_fwd"] == tune_gemm.Gemm("up_fwd", "fwd", 65536, 2048, 1536, 128)
  assert gemms["down_drhs"].key == "drhs:768x2048"
  # Expert parallelism changes the local experts, not the key; expert-tensor parallelism both.
  ep8 = load_config(ROOT / "configs/qwen3_30b_a3b.py",
                    ["parallel.expert.expert=8", "parallel.expert.data=1"])
  assert {g.experts for g in tune_gemm.gemm_shapes(ep8)} == {16}
  etp2 = load_config(ROOT / "configs/qwen3_30b_a3b.py", ["parallel.expert.tensor=2"])
  etp_gemms = {g.name: g for g in tune_gemm.gemm_shapes(etp2)}
  assert etp_gemms["down_fwd"].key == "fwd:384x2048" and etp_gemms["down_fwd"].rows == 131072
  gpt = load_config(ROOT / "configs/gpt_oss_20b.py")
  gpt_wide = load_config(ROOT / "configs/gpt_oss_20b.py", ["moe.num_experts=128"])
  bench = load_config(ROOT / "configs/bench/qwen3_30b_a3b_1gpu.py")
  shapes = tune_gemm.collect([("qwen", qwen), ("bench", bench), ("ep8", ep8), ("gpt", gpt),
                              ("gpt_wide", gpt_wide)])
  assert len(shapes) == 12  # six keys each for d_model 2048 / 768 and 2880 / 2880
  assert shapes["fwd:2880x2880"][1] == ["gpt:down_fwd", "gpt_wide:down_fwd"]
  assert shapes["dlhs:1536x2048"][1] == ["qwen:up_dlhs", "bench:up_dlhs", "ep8:up_dlhs"]
  assert shapes["fwd:2048x1536"][0].experts == 128  # the first met


def test_a_zero_budget_writes_nothing(tmp_path, capsys):
  out = tmp_path / "tiles.json"
  assert tune_gemm.main(["--config", str(ROOT / "configs/tiny_moe.py"), "--config",
                         str(ROOT / "configs/tiny_dense.py"), "--budget-s", "0",
                         "--out", str(out)]) == 0
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert not out.exists() and summary["wrote"] is None and summary["tuned"] == []
  assert len(summary["not_run"]) == summary["shapes"] == 6
  assert summary["skipped_configs"] == ["configs/tiny_dense.py"]  # no expert layers
  # A config named twice counts once; a dry run lists what would be timed.
  assert tune_gemm.main(["--config", str(ROOT / "configs/tiny_moe.py"), "--config",
                         "configs/../configs/tiny_moe.py", "--dry-run", "--candidates", "3",
                         "--out", str(out)]) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
  assert [len(line["from"]) for line in lines[:-1]] == [1] * 6 and not out.exists()
  assert lines[-1]["configs_timed"] == sum(len(line["plans"]) for line in lines[:-1]) <= 18


def test_the_table_keeps_stats_apart_and_drops_keys_the_default_won(tmp_path, monkeypatch):
  out = tmp_path / "tiles.json"
  best = Tiles(64, 256, 64, 5, 1).__dict__
  tune_gemm.write_table(out, {"date": "d"}, {"fwd:768x2048": best, "drhs:2880x2880": best},
                        {"fwd:768x2048": {"tflops": 274.0, "from": ["a.py:down_fwd"]}})
  tune_gemm.write_table(out, {"date": "e"}, {"drhs:2880x2880": None},
                        {"drhs:2880x2880": {"tflops": 1.0}})
  table = json.loads(out.read_text())
  assert set(table["tiles"]) == {"fwd:768x2048"} and table["measured"] == {"date": "e"}
  assert set(table["stats"]) == {"fwd:768x2048", "drhs:2880x2880"}
  table["tiles"]["fwd:768x2048"]["note"] = "not a tile field"
  out.write_text(json.dumps(table))
  monkeypatch.setattr(mosaic_gemm, "TILES_FILE", out)
  mosaic_gemm._table.cache_clear()
  try:
    assert tiles_for("fwd", 768, 2048) == Tiles(**best)
    assert tiles_for("fwd", 768, 4096) == default_tiles("fwd", 768, 4096)
  finally:
    mosaic_gemm._table.cache_clear()


def _fake_ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps,
                     grid_block_n, transpose_rhs=False):
  """What ragged_dot computes, refusing what its callers must not hand it."""
  k, n = lhs.shape[1], rhs.shape[1] if transpose_rhs else rhs.shape[2]
  assert k % block_k == 0 and n % (block_n * grid_block_n) == 0, (k, n, block_k, block_n)
  return jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, group_sizes)


def _fake_transposed_ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k,
                                max_concurrent_steps, grid_block_n):
  assert lhs.shape[1] % block_m == 0 and rhs.shape[1] % (block_n * grid_block_n) == 0
  ends = jnp.cumsum(group_sizes)
  group_X = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")
  one_hot_XG = jax.nn.one_hot(group_X, group_sizes.shape[0], dtype=lhs.dtype)
  return jnp.einsum("xg,xm,xn->gmn", one_hot_XG, lhs, rhs)


@pytest.fixture
def fake_kernels(monkeypatch):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
  monkeypatch.setattr(ragged_dot_mgpu, "ragged_dot", _fake_ragged_dot)
  monkeypatch.setattr(transposed_ragged_dot_mgpu, "transposed_ragged_dot",
                      _fake_transposed_ragged_dot)


def test_a_sweep_writes_its_winners_and_figures(tmp_path, capsys, fake_kernels):
  """The sweep's whole path, with the kernels' stand-ins timed instead of the kernels."""
  out = tmp_path / "tiles.json"
  assert tune_gemm.main(["--config", str(ROOT / "configs/tiny_moe.py"), "--tokens", "128",
                         "--candidates", "2", "--reps", "1", "--only", "up_fwd,down_drhs",
                         "--out", str(out)]) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
  summary, results = lines[-1], lines[:-1]
  assert [r["key"] for r in results] == ["fwd:128x256", "drhs:128x128"]
  assert all(r["configs"] == 2 and r["tflops"] > 0 and r["dense_tflops"] > 0 for r in results)
  assert results[0]["from"] == ["configs/tiny_moe.py:up_fwd"] and results[0]["rows"] == 256
  table = json.loads(out.read_text())
  assert set(table["stats"]) == {"fwd:128x256", "drhs:128x128"} == set(table["tiles"])
  assert summary["tuned"] == ["fwd:128x256", "drhs:128x128"] and summary["wrote"] == str(out)


@pytest.mark.parametrize("d,f,tiles", [(100, 300, None), (2880, 200, None),
                                       (128, 2880, Tiles(128, 192, 64, 4, 4))])
def test_padded_path_is_exact(fake_kernels, d, f, tiles):
  keys = jax.random.split(jax.random.key(0), 3)
  sizes_E = jnp.asarray([20, 0, 24], jnp.int32)  # and 4 rows past the groups
  x_XD = jax.random.normal(keys[0], (48, d))
  w_EDF = jax.random.normal(keys[1], (3, d, f))
  dy_XF = jax.random.normal(keys[2], (48, f))
  y = mosaic_gemm.ragged(x_XD, w_EDF, sizes_E, False, tiles)
  dx = mosaic_gemm.ragged(dy_XF, w_EDF, sizes_E, True, tiles)
  dw = mosaic_gemm.ragged_contract(x_XD, dy_XF, sizes_E)
  starts = np.concatenate([[0], np.cumsum(sizes_E)])
  x, w, dy = np.asarray(x_XD), np.asarray(w_EDF), np.asarray(dy_XF)
  for e in range(3):
    rows = slice(starts[e], starts[e + 1])
    np.testing.assert_allclose(y[rows], x[rows] @ w[e], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dx[rows], dy[rows] @ w[e].T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dw[e], x[rows].T @ dy[rows], rtol=1e-5, atol=1e-4)
  assert y.shape == (48, f) and dx.shape == (48, d) and dw.shape == (3, d, f)
