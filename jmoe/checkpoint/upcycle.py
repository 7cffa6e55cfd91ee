"""Dense-to-MoE upcycling: an MoE model that starts out computing what a dense model computes.

Every layer's dense MLP (width F) becomes experts of width F / G. With G = 1 each expert is a
copy of the MLP; with G > 1 (fine-grained) the MLP is cut into G slices along its width, expert e
holds slice e mod G, and its down projection is scaled so that the slices' weighted sum is the
MLP's output again. E / G "replicas" of the whole MLP are made.

The router starts in virtual groups: the G experts of a replica share one router column, so they
tie and are chosen together; with k a multiple of G, every token picks whole replicas. When the
chosen weights are normalised (softmax over the chosen, or norm_topk_prob) every slice's weights
add up to the same amount whichever replicas win, and the MoE layer's output equals the MLP's for
any router. Otherwise it is equal when routing is uniform (`router_std=0`: all logits zero).
Shared experts start switched off (zero down projection); attention, norms and embeddings are
copied. Capacity-based dropping, when configured, can still drop copies and so change outputs.
"""

from __future__ import annotations

import logging
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.checkpoint.params import read_config, read_variables, save_model
from jmoe.config import (Config, ConfigError, DenseLayout, ExpertLayout, ParallelConfig,
                         RouterConfig, to_dict)
from jmoe.parallel import make_layout
from jmoe.model.factory import model_factory
from jmoe.outputs import check, written

log = logging.getLogger("jmoe")


def uniform_weight(router: RouterConfig, num_experts: int, top_k: int) -> float:
  """The combine weight of each chosen expert when every router logit is zero."""
  if router.score == "softmax_topk" or router.norm_topk_prob:
    weight = 1.0 / top_k
  else:
    weight = 0.5 if router.score == "sigmoid" else 1.0 / num_experts
  return weight * router.scaling_factor


def check_upcyclable(dense: Config, moe: Config) -> int:
  """Returns G, the number of slices each dense MLP is cut into; raises on what cannot work."""
  if dense.moe.first_k_dense != dense.model.num_layers:
    raise ConfigError(f"the checkpoint to upcycle has MoE layers (moe.first_k_dense "
                      f"{dense.moe.first_k_dense} < model.num_layers {dense.model.num_layers}); "
                      f"upcycling starts from a dense model")
  if dense.model.mtp_depth or moe.model.mtp_depth:
    raise ConfigError("upcycling does not handle multi-token prediction modules: set "
                      "model.mtp_depth=0 (add them later by training)")
  a, b = to_dict(dense.model), to_dict(moe.model)
  differ = [key for key in a if key not in ("family", "attention_kernel") and a[key] != b[key]]
  if differ:
    raise ConfigError("the MoE config's model must match the dense checkpoint's except for its "
                      "MoE layers; these differ: " + ", ".join(
                          f"model.{k} ({b[k]} here, {a[k]} in the checkpoint)" for k in differ))
  m = moe.moe
  width = dense.model.d_ff
  if width % m.d_ff_expert:
    raise ConfigError(f"moe.d_ff_expert ({m.d_ff_expert}) must divide the dense MLP width "
                      f"model.d_ff ({width}): each expert is a slice of it")
  slices = width // m.d_ff_expert
  if m.num_experts % slices or m.top_k % slices:
    raise ConfigError(
        f"the dense MLP is cut into {slices} slices (model.d_ff {width} / moe.d_ff_expert "
        f"{m.d_ff_expert}); moe.num_experts ({m.num_experts}) and moe.top_k ({m.top_k}) must be "
        f"multiples of it so that tokens choose whole copies of the MLP")
  group = m.num_experts // m.router.num_groups
  if m.router.num_groups > 1 and group % slices:
    raise ConfigError(f"with group-limited routing each group's {group} experts must hold whole "
                      f"copies of the MLP ({slices} slices)")
  return slices


def upcycle_variables(dense: dict, moe_init: dict, config: Config, slices: int,
                      router_std: float, key: jax.Array) -> dict:
  """The MoE model's variables (pure dicts, layers stacked) from the dense model's."""
  m = config.moe
  out = jax.tree.map(lambda x: x, moe_init)
  for name in ("embed", "final_norm", "head_DV"):
    if name in dense:
      out[name] = dense[name]
  blocks = dense["dense_blocks"]
  k = m.first_k_dense
  if k:
    out["dense_blocks"] = jax.tree.map(lambda x: x[:k], blocks)
  tail = jax.tree.map(lambda x: x[k:], blocks)
  moe_blocks = out["moe_blocks"]
  for name in ("attn_norm", "attn", "mlp_norm"):
    moe_blocks[name] = tail[name]
  mlp = dict(moe_blocks["mlp"])
  w_in_LD2F, w_out_LFD = tail["mlp"]["w_in_D2F"], tail["mlp"]["w_out_FD"]
  layers, d_model = w_in_LD2F.shape[:2]
  f, replicas = m.d_ff_expert, m.num_experts // slices
  # Expert e = replica e // slices, slice e % slices. Letter e: the slices (a part of E); f: the
  # width of one (a part of F).
  w_in_LeD2f = jnp.moveaxis(w_in_LD2F.reshape(layers, d_model, 2, slices, f), 3, 1)
  mlp["w_in_ED2F"] = jnp.tile(w_in_LeD2f, (1, replicas, 1, 1, 1))
  scale = 1.0 / ((m.top_k // slices) * uniform_weight(m.router, m.num_experts, m.top_k))
  w_out_LefD = w_out_LFD.reshape(layers, slices, f, d_model) * scale
  mlp["w_out_EFD"] = jnp.tile(w_out_LefD, (1, replicas, 1, 1))
  # One router column per replica ([L, D, replicas]), shared by its slices.
  router = router_std * jax.random.normal(key, (layers, d_model, replicas), jnp.float32)
  mlp["router_DE"] = jnp.repeat(router, slices, axis=-1)
  for name in ("router_bias_E", "b_in_E2F", "b_out_ED", "expert_bias_E"):
    if name in mlp:
      mlp[name] = jnp.zeros_like(mlp[name])
  if "shared" in mlp:
    shared = dict(mlp["shared"])
    shared["w_out_FD"] = jnp.zeros_like(shared["w_out_FD"])
    mlp["shared"] = shared
  moe_blocks["mlp"] = mlp
  return jax.tree.map(lambda new, like: new.astype(like.dtype), out, moe_init)


def upcycle(dense_dir: str | pathlib.Path, config: Config, out: str | pathlib.Path,
            router_std: float | None = None, overwrite: bool = False) -> None:
  """Writes the upcycled model of `config` as a model checkpoint in `out` (empty or new, unless
  `overwrite`). `router_std`: the spread of the initial router (default: model.init_std; 0 gives
  uniform routing)."""
  output = check(out, directory=True, overwrite=overwrite, inputs={"--checkpoint": dense_dir})
  dense_config = read_config(dense_dir)
  slices = check_upcyclable(dense_config, config)
  router_std = config.model.init_std if router_std is None else router_std
  normalised = config.moe.router.score == "softmax_topk" or config.moe.router.norm_topk_prob
  if router_std and not normalised:
    log.warning("the routing weights are not normalised (moe.router.norm_topk_prob=False), so "
                "the upcycled model equals the dense one only under uniform routing; pass "
                "--router-std 0 for that")
  # Parameters sharded over every device (FSDP), so a model larger than one device fits.
  layout = make_layout(ParallelConfig(dense=DenseLayout(data=1, fsdp=-1),
                                      expert=ExpertLayout(data=-1)))
  dense_abstract = nnx.state(nnx.eval_shape(model_factory(dense_config)))
  dense_state = read_variables(dense_dir, dense_abstract, layout.shardings(dense_abstract))

  build = model_factory(config)
  moe_abstract = nnx.state(nnx.eval_shape(build))
  shardings = nnx.to_pure_dict(layout.shardings(moe_abstract))

  @jax.jit
  def make(dense_pure):
    moe_init = nnx.to_pure_dict(nnx.state(build()))
    values = upcycle_variables(dense_pure, moe_init, config, slices, router_std,
                               jax.random.key(config.train.seed + 2))
    return jax.lax.with_sharding_constraint(values, shardings)

  with layout.active():
    values = make(nnx.to_pure_dict(dense_state))
  nnx.replace_by_pure_dict(moe_abstract, values)
  with written(output) as tmp:
    save_model(tmp, moe_abstract, config)
  log.info("upcycled %s into %d experts per layer (%d slice(s) of the dense MLP each, %d "
           "copies) in %s", dense_dir, config.moe.num_experts, slices,
           config.moe.num_experts // slices, output.path)
