"""The MoE layer: router and expert parameters, and route -> dispatch -> experts -> combine."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jmoe.config import LoRAConfig, MoEConfig
from jmoe.errors import choice
from jmoe.moe.allgather import AllGatherDispatcher
from jmoe.moe.alltoall import AllToAllDispatcher
from jmoe.moe.dispatch import Dispatcher, LocalDispatcher, Stages, on_expert_shards
from jmoe.moe.experts import ExpertCompute, ExpertLoRA, ExpertWeights
from jmoe.moe.route import RouterStats, route
from jmoe.ops.exchange import varying_like
from jmoe.ops.fp8 import Fp8Recipe, WeightAmax, stored_amax
from jmoe.ops.grouped_gemm import has_fp8_kernels
from jmoe.ops.params import lora_factors, param
from jmoe.parallel import ExpertAxes, active_layout, gathered

# How tokens reach experts on other devices: the names `moe.dispatcher` may take.
DISPATCHERS: dict[str, type[Dispatcher]] = {"allgather": AllGatherDispatcher,
                                            "alltoall": AllToAllDispatcher}


class ExpertBias(nnx.Variable):
  """Aux-loss-free balancing: a per-expert bias added to the selection scores only. Not trained by
  gradients; `update_expert_bias` moves it after each step. Lives in the train state's `rest`."""


def bias_step(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
  """bias += rate * sign(mean load - load), per layer: under-used experts become likelier."""
  return bias_E + rate * jnp.sign(jnp.mean(load_E, axis=-1, keepdims=True) - load_E)


def moe_stages(make_dispatcher: Callable[[ExpertAxes, int], Dispatcher], compute: ExpertCompute,
               chunks: int = 1) -> Stages:
  """dispatch -> experts -> overflow -> combine on one device's tokens and experts (for
  `on_expert_shards`), in `chunks` independent pieces of the tokens, so that XLA may overlap one
  piece's exchange with another's expert GEMMs. `make_dispatcher(axes, num_local)`."""

  def stages(axes: ExpertAxes, x_TD, expert_ids_TK, weights_TK, experts: ExpertWeights):
    dispatcher = make_dispatcher(axes, experts.num_experts)
    experts = varying_like(experts, x_TD)  # one gradient sum for every use below
    run_experts = lambda rows, weights: compute(rows, weights, axes)
    pieces = zip(*(jnp.split(a, chunks) for a in (x_TD, expert_ids_TK, weights_TK)))
    outputs = []
    for piece in pieces:
      with jax.named_scope("dispatch"):
        rows, context = dispatcher.dispatch(*piece, quantize=compute.quantize_rows(experts))
      with jax.named_scope("experts"):
        y_XD = run_experts(rows, experts)
      with jax.named_scope("overflow"):
        context = dispatcher.overflow(context, run_experts, experts)
      with jax.named_scope("combine"):
        y_TD = dispatcher.combine(y_XD, context)
      outputs.append((y_TD, context.dropped_fraction, context.overflow_rounds))
    y_TD, dropped, rounds = zip(*outputs)
    return (jnp.concatenate(y_TD) if chunks > 1 else y_TD[0], sum(dropped) / chunks, sum(rounds))

  return stages


class MoE(nnx.Module):
  """`make_shared` builds the always-on experts (a dense MLP of the caller's, whose output is
  summed into the layer's), after the layer's own parameters."""

  def __init__(self, d_model: int, cfg: MoEConfig, std: float, *, param_dtype, dtype,
               rngs: nnx.Rngs, fp8: Fp8Recipe | None = None, lora: LoRAConfig | None = None,
               make_shared: Callable[[], nnx.Module] | None = None):
    choice("moe.dispatcher", cfg.dispatcher, DISPATCHERS)  # config validation cannot see it
    self.cfg = cfg
    self.dtype = dtype
    self.fp8 = fp8
    e, f = cfg.num_experts, cfg.d_ff_expert
    self.router_DE = param(rngs, (d_model, e), ("embed", None), std=std, dtype=param_dtype)
    self.router_bias_E = (param(rngs, (e,), (None,), std=0, dtype=param_dtype, kind="bias")
                          if cfg.router.bias else None)
    self.expert_bias_E = (ExpertBias(jnp.zeros((e,), jnp.float32), axes=(None,))
                          if cfg.balance.bias_update_rate > 0 else None)
    self.w_in_ED2F = param(rngs, (e, d_model, 2, f), ("expert", "expert_embed", None, "expert_mlp"),
                           std=std, dtype=param_dtype, matrix="bibo")
    self.w_out_EFD = param(rngs, (e, f, d_model), ("expert", "expert_mlp", "expert_embed"), std=std,
                           dtype=param_dtype, matrix="bio")
    bias = lambda shape, axes: (param(rngs, shape, axes, std=0, dtype=param_dtype, kind="bias")
                                if cfg.expert_bias else None)
    self.b_in_E2F = bias((e, 2, f), ("expert", None, "expert_mlp"))
    self.b_out_ED = bias((e, d_model), ("expert", None))
    # FP8 on per-expert weight scales, in a train state: each weight's amax kept by the step.
    kept = (fp8 is not None and fp8.experts and fp8.kept_weight_amax and not fp8.blockwise
            and not cfg.expert_blocks and has_fp8_kernels(cfg.gemm))
    self.amax_in_E, self.amax_out_E = ((WeightAmax(a, axes=(None,)) for a in self._amaxes())
                                       if kept else (None, None))
    # LoRA on the experts: a factor pair per expert and projection, keyed by its weight's name.
    on = lora is not None and lora.applies_to("experts")
    factors = lambda w: nnx.Dict(zip("ab", lora_factors(
        rngs, w.shape, w.get_metadata()["axes"], 1, lora.rank, w.dtype, lead=1)))
    self.lora = (nnx.Dict({name: factors(getattr(self, name)) for name in ("w_in_ED2F", "w_out_EFD")})
                 if on else None)
    self.lora_scale = lora.scale if on else 0.0
    self.shared = make_shared() if make_shared is not None else None

  def __call__(self, x_BSD: jax.Array, rng: jax.Array | None = None
               ) -> tuple[jax.Array, RouterStats]:
    batch, seq, d_model = x_BSD.shape
    x_TD = checkpoint_name(x_BSD.reshape(batch * seq, d_model), "moe_input")
    layout = active_layout()
    with jax.named_scope("route"):
      routing = route(self._router_logits(x_TD, rng), self.cfg.router, self.cfg.top_k,
                      expert_bias_E=None if self.expert_bias_E is None else self.expert_bias_E[...],
                      balance_groups=self._balance_groups(batch, layout))
    fp8 = self.fp8
    experts_fp8 = fp8 is not None and fp8.experts
    compute = ExpertCompute.from_config(self.cfg, fp8.grad_format if experts_fp8 else None,
                                        experts_fp8 and fp8.blockwise,
                                        fp8.weight_gradient if experts_fp8 else "bf16",
                                        fp8.promote if experts_fp8 else "never")
    stages = moe_stages(lambda axes, num_local: self._dispatcher(axes, num_local, layout is None),
                        compute, self.cfg.dispatch_chunks)
    # Inside a pipeline stage (vmapped over the stage axis) shard_map cannot type the stage axis
    # it does not name: its varying-axes checks stay off there, as for GEMMs that drop them.
    y_TD, dropped, rounds = on_expert_shards(layout, stages, x_TD, routing.expert_ids_TK,
                                             routing.weights_TK, self._expert_weights(),
                                             check_vma=compute.grouped.keeps_varying_axes and
                                             not (layout is not None and layout.inside))
    y_BSD = y_TD.reshape(batch, seq, d_model)
    if self.shared is not None:
      y_BSD = y_BSD + self.shared(x_BSD)
    return y_BSD, routing.stats.replace(dropped_fraction=dropped,
                                        overflow_rounds=rounds.astype(jnp.float32))

  def keep_weight_amax(self) -> None:
    """Sets the kept amaxes (if the layer has them) from the expert weights as they are now: as
    the forward pass would read them from the weights in the compute dtype."""
    if self.amax_in_E is not None:
      self.amax_in_E[...], self.amax_out_E[...] = self._amaxes()

  def _amaxes(self) -> tuple[jax.Array, jax.Array]:
    """Each expert's amax of w_in and of w_out ([..., E], a stack's layers leading) in the
    compute dtype, as the forward pass finds it (`stored_amax`). First each row's (the last,
    contiguous axis), then theirs: XLA fuses the rows' maxima into the optimizer update's pass
    over the weight as a row reduction; left to itself it reduced across rows there, a kernel
    that took 54 ms a step on Mixtral-8x7B's bench (one H100), more than the update itself."""
    def of(w: nnx.Param, trailing: int) -> jax.Array:  # w [..., E, `trailing` weight axes]
      rows = stored_amax(w[...].astype(self.dtype), axis=-1)
      rows = jax.lax.optimization_barrier(rows)  # (else XLA merges the two reductions)
      return jnp.max(rows, axis=tuple(range(1 - trailing, 0)))
    return of(self.w_in_ED2F, 3), of(self.w_out_EFD, 2)

  def _dispatcher(self, axes: ExpertAxes, num_local: int, local: bool) -> Dispatcher:
    """The configured dispatcher; with no expert axes every expert is here (or on the devices
    of its expert-tensor group), and both dispatchers are the all-gather one, the same code."""
    cfg = self.cfg
    if local:
      kind = LocalDispatcher
    else:
      kind = DISPATCHERS[cfg.dispatcher] if axes.expert else AllGatherDispatcher
    fp8_dispatch = bool(self.fp8 and self.fp8.dispatch) and not local
    return kind(axes, num_local, cfg.capacity_factor, cfg.drop_policy, fp8_dispatch,
                cfg.dispatch_factor)

  def _expert_weights(self) -> ExpertWeights:
    cast = lambda p: None if p is None else p[...].astype(self.dtype)
    lora = None
    if self.lora is not None:
      up, down = self.lora["w_in_ED2F"], self.lora["w_out_EFD"]
      lora = ExpertLoRA(a_in_EDR=cast(up["a"]), b_in_ER2F=cast(up["b"]), a_out_EFR=cast(down["a"]),
                        b_out_ERD=cast(down["b"]), scale=self.lora_scale)
    kept = lambda a: None if a is None else a[...]
    return ExpertWeights(w_in_ED2F=cast(self.w_in_ED2F), w_out_EFD=cast(self.w_out_EFD),
                         b_in_E2F=cast(self.b_in_E2F), b_out_ED=cast(self.b_out_ED), lora=lora,
                         amax_in_E=kept(self.amax_in_E), amax_out_E=kept(self.amax_out_E))

  def _router_logits(self, x_TD: jax.Array, rng: jax.Array | None) -> jax.Array:
    """Router logits in float32, with multiplicative input jitter when training asks for it."""
    x_TD = x_TD.astype(jnp.float32)
    jitter = self.cfg.router.jitter
    if jitter and rng is not None:
      x_TD = x_TD * jax.random.uniform(rng, x_TD.shape, minval=1 - jitter, maxval=1 + jitter)
    logits_TE = jnp.einsum("td,de->te", x_TD, gathered(self.router_DE, jnp.float32))
    if self.router_bias_E is not None:
      logits_TE = logits_TE + self.router_bias_E[...].astype(jnp.float32)
    return logits_TE

  def _balance_groups(self, batch: int, layout) -> int:
    kind = self.cfg.balance.aux_loss_type
    if kind == "seq":
      return batch
    if kind == "micro_batch" and layout is not None:
      return layout.data_parallel_size
    return 1


def keep_weight_amax(model: nnx.Module) -> None:
  """Every MoE layer's kept expert-weight amaxes set from its weights as they are now (for a
  train state: after each update, and wherever a run's parameters come from)."""
  for _, module in nnx.iter_modules(model):
    if isinstance(module, MoE):
      module.keep_weight_amax()
