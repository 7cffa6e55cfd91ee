"""Muon (train.optimizer = "muon"): the orthogonalisation against float64, per expert; which
parameters it takes; sharded runs equal to one device; exact resume; refusal to resume another
optimizer's state; and the loss it reaches against AdamW's."""

import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmoe.config import ConfigError, load_config
from jmoe.ops.params import matrix_roles
from jmoe.parallel import make_layout
from jmoe.train.loop import train
from jmoe.train.muon import NS_COEFFS, NS_STEPS, RMS_MATCH, newton_schulz, orthogonalised
from jmoe.train.optimizer import MuonState, make_optimizer
from jmoe.train.state import state_spec
from helpers import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def newton_schulz_float64(x_MN: np.ndarray) -> np.ndarray:
  """The quintic iteration written out for one matrix, in float64."""
  a, b, c = NS_COEFFS
  x = x_MN.astype(np.float64).T if x_MN.shape[0] > x_MN.shape[1] else x_MN.astype(np.float64)
  x = x / (np.linalg.norm(x) + 1e-7)
  for _ in range(NS_STEPS):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if x_MN.shape[0] > x_MN.shape[1] else x


@pytest.mark.parametrize("shape", [(16, 16), (12, 40), (48, 20), (64, 8)])
def test_newton_schulz_matches_float64(shape):
  x = np.random.default_rng(sum(shape)).normal(size=shape).astype(np.float32)
  got = np.asarray(newton_schulz(jnp.asarray(x)))
  want = newton_schulz_float64(x)
  np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())
  # What it is for: every singular value brought near 1 (the quintic leaves them in ~[0.7, 1.2]).
  s = np.linalg.svd(want, compute_uv=False)
  assert s.min() > 0.6 and s.max() < 1.25, s


def test_expert_stack_is_each_experts_matrix_on_its_own():
  """A layer stack of experts' gate/up weights [L, E, D, 2, F]: every (layer, expert, gate or up)
  matrix D x F alone, as a loop over them computes it; attention's W_q [D, H, A] as one D x HA."""
  x = jax.random.normal(jax.random.key(0), (2, 4, 12, 2, 20))
  got = np.asarray(orthogonalised(x, "bbibo"))
  scale = RMS_MATCH * np.sqrt(20)
  for l in range(2):
    for e in range(4):
      for j in range(2):
        want = newton_schulz_float64(np.asarray(x[l, e, :, j, :])) * scale
        np.testing.assert_allclose(got[l, e, :, j, :], want, atol=1e-5)
  q = jax.random.normal(jax.random.key(1), (16, 4, 6))
  want = newton_schulz_float64(np.asarray(q).reshape(16, 24)) * RMS_MATCH * np.sqrt(24)
  np.testing.assert_allclose(np.asarray(orthogonalised(q, "ioo")).reshape(16, 24), want,
                             atol=1e-5)


def test_which_parameters_muon_takes_and_its_state():
  config = tiny_config(model=dict(mtp_depth=1), moe=dict(num_shared_experts=1),
                       train=dict(optimizer="muon"))
  spec = state_spec(config, make_layout(config.parallel, jax.devices()[:1]),
                    make_optimizer(config.train, "bfloat16"))
  params = spec.abstract.params
  name = lambda path: jax.tree_util.keystr(path, simple=True, separator="/")
  roles = {name(p): matrix_roles(v) for p, v in jax.tree.leaves_with_path(
      params, is_leaf=lambda x: isinstance(x, nnx.Variable))}
  assert roles["moe_blocks/mlp/w_in_ED2F"] == "bbibo"  # layers, experts, gate/up
  assert roles["moe_blocks/mlp/w_out_EFD"] == "bbio"
  assert roles["moe_blocks/mlp/shared/w_in_D2F"] == "bibo"
  assert roles["moe_blocks/attn/w_q_DHA"] == "bioo"
  assert roles["dense_blocks/attn/w_o_HAD"] == "biio"
  assert roles["mtp/0/w_proj_2DD"] == "io"
  for adamw in ("embed/table", "head_DV", "moe_blocks/mlp/router_DE", "final_norm/scale"):
    assert roles[adamw] is None, adamw
  state = spec.abstract.opt_state
  assert isinstance(state, MuonState)
  # One bfloat16 momentum per parameter; second moments only for those AdamW keeps.
  assert {x.dtype for x in jax.tree.leaves((state.mu, state.nu))} == {np.dtype(jnp.bfloat16)}
  nu = {name(p).removesuffix("/value") for p, _ in jax.tree.leaves_with_path(state.nu)}
  assert nu == {n for n, r in roles.items() if r is None}


LAYOUT = dict(dense=dict(data=2, fsdp=4), expert=dict(data=2, expert=4))  # EP 4 x FSDP 4


def losses(records):
  return {r["step"]: r["loss"] for r in records}


def muon_config(**train_overrides):
  return tiny_config(train=dict(optimizer="muon", steps=6, log_every=1, **train_overrides),
                     checkpoint=dict(every=3), parallel=LAYOUT)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
  """6 Muon steps on EP 4 x EDP 2 and FSDP 4 x DP 2, checkpoints at 3 and 6."""
  workdir = tmp_path_factory.mktemp("muon")
  return workdir, losses(train(muon_config(), workdir, progress=False))


def test_sharded_run_equals_one_device(sharded_run, tmp_path):
  config = tiny_config(train=dict(optimizer="muon", steps=6, log_every=1),
                       checkpoint=dict(every=0))
  single = losses(train(config, tmp_path, progress=False, devices=jax.devices()[:1]))
  sharded = sharded_run[1]
  assert sharded[6] < sharded[1] - 0.05  # it trains
  for step in range(1, 7):
    np.testing.assert_allclose(sharded[step], single[step], rtol=1e-5)


def test_resume_is_exact(sharded_run, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(sharded_run[0], workdir)
  shutil.rmtree(workdir / "checkpoints" / "6")
  resumed = losses(train(muon_config(), workdir, progress=False))
  assert resumed == {s: sharded_run[1][s] for s in (4, 5, 6)}


def test_resuming_with_the_other_optimizer_is_refused(sharded_run, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(sharded_run[0], workdir)
  shutil.rmtree(workdir / "checkpoints" / "6")
  config = tiny_config(train=dict(steps=6, log_every=1), checkpoint=dict(every=3),
                       parallel=LAYOUT)
  with pytest.raises(ConfigError, match=r"was saved with train.optimizer 'muon', but this "
                                        r"config has 'adamw': its optimizer state is another"):
    train(config, workdir, progress=False)


def test_an_unknown_optimizer_is_refused():
  with pytest.raises(ConfigError, match=r"train.optimizer.*adamw.*muon"):
    tiny_config(train=dict(optimizer="sgd"))


def test_muon_trains_the_tiny_moe_further_than_adamw(tmp_path):
  """configs/tiny_moe.py on the stdlib corpus, 80 steps of 8 x 64 tokens on one device, at the
  config's own learning rate (AdamW's; Muon's update is scaled to AdamW's RMS). Measured: mean
  loss of steps 71-80, AdamW 3.005, Muon 2.622 (docs/OPTIMIZER.md has other learning rates)."""
  final = {}
  for optimizer in ("adamw", "muon"):
    config = load_config(ROOT / "configs" / "tiny_moe.py", [f"train.optimizer={optimizer}", "train.steps=80",
                                  "train.warmup_steps=10", "train.batch_size=8",
                                  "data.seq_len=64", "train.log_every=1", "checkpoint.every=0"])
    records = train(config, tmp_path / optimizer, progress=False, devices=jax.devices()[:1])
    final[optimizer] = float(np.mean([r["loss"] for r in records[-10:]]))
  assert final["muon"] < final["adamw"], final


def test_memory_estimate_counts_muons_state():
  """One moment per hidden matrix instead of two: the estimate's optimizer state shrinks by the
  matrices' second moments, and the update (its Newton-Schulz included) is traced with the step."""
  from jmoe.memory.estimate import estimate
  state = {}
  for optimizer in ("adamw", "muon"):
    config = tiny_config(train=dict(optimizer=optimizer), parallel=LAYOUT)
    spec = state_spec(config, make_layout(config.parallel), make_optimizer(config.train))
    matrices = sum(v.size * 4 for v in jax.tree.leaves(
        spec.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        if matrix_roles(v) is not None)
    state[optimizer] = estimate(config, make_layout(config.parallel)).by_category[
        "optimizer state"]
  assert state["adamw"] - state["muon"] > 0.9 * matrices / 8  # float32 moments over 8 devices


def test_newton_schulz_placement_keeps_experts_and_lends_freed_axes_to_the_stack():
  """EP 4 x EDP 2, FSDP 4 x DP 2: an expert stack keeps its experts where they are and takes the
  expert-data axis its matrices free on its layer axis; a dense stack of 4 layers takes the FSDP
  axis; one of 2 layers (FSDP 4 does not divide it) is gathered whole."""
  from jax.sharding import PartitionSpec as P
  layout = make_layout(tiny_config(parallel=LAYOUT).parallel)
  experts = ("layers", "expert", "expert_embed", None, "expert_mlp")
  assert layout.param_spec(experts, (2, 8, 32, 2, 16)) == P(None, "fsdp/expert", "data/data",
                                                            None, None)
  assert layout.whole_matrix_spec(experts, (2, 8, 32, 2, 16), [0, 0, 1, 0, 1]) == P(
      "data/data", "fsdp/expert", None, None, None)
  q = ("layers", "embed", "heads", "head_dim")
  assert layout.whole_matrix_spec(q, (4, 32, 4, 8), [0, 1, 1, 1]) == P("fsdp/expert", None,
                                                                       None, None)
  assert layout.whole_matrix_spec(q, (2, 32, 4, 8), [0, 1, 1, 1]) == P(None, None, None, None)
