"""Start a sparse layer from a dense MLP ("sparse upcycling"), for the MLP of every supported family. The MLP is read
by its family's `MlpLayout` row in families.py (child names, gated or fused gate/up, Conv1D), named by the caller's
`family` (the model's model_type), never guessed from the module's children: a family whose row is missing or wrong
fails by name instead of being read with another family's layout.

The methods are the `init_modes` a kind's spec lists besides "default" (today MoE-X's); the layer says how it holds
the MLP (`SparseLayer.dense_init_groups`, `dense_fit_problems`, `init_from_dense`) and its spec which fields do
(`SparseSpec.dense_init_fields`), so nothing here names a kind:

- "split" (MoEfication / LLaMA-MoE style; for MoE-X ours, the paper does not say how it upcycles): the H hidden
  neurons are partitioned into as many groups as the layer has experts (random, or balanced k-means on the neurons'
  input weight vectors) and expert j holds group j: its encoder rows, biases and decoder columns. For MoE-X,
  d_expert = ceil(H / M); when M does not divide H the spare slots of the smaller groups are zero (zero encoder row
  and bias, zero decoder column: they add nothing, and under ReLU they get no gradient either, so prefer M | H).
  With all experts on (k = M), gate_scaling="none" and the base activation, the layer equals the MLP exactly:
  Σ_j W_decʲ φ(W_encʲ x + b_encʲ) + b_dec is the dense sum.
- "copy" (Komatsuzaki et al. 2022, the paper's "upcycling"): every expert is the whole MLP (d_expert = H). Softmax
  gates sum to 1, so the layer equals the MLP at any k while the experts are identical. But identical experts also
  have identical sparsity-router scores, so TopK's tie-breaking sends every token to the same k experts and the others
  never train (digest pitfall 2). Gaussian noise of `noise_std` × std(W_in) on each expert's encoder breaks the ties
  (the router reads only W_enc); it perturbs the function by about that relative amount.

GLU MLPs (Llama: down(act(gate x) * up x); Phi-3 fuses gate and up into one projection, read here as its two halves)
map gate -> W_enc (the branch under φ, which the sparsity router reads), up -> W_up, down -> W_dec, with
`expert_glu=True`. MoE-X's experts are ReLU; switching a GELU / SiLU MLP to ReLU changes the function, so it is an
explicit option: build the spec with `activation="relu"` and pass `allow_activation_change=True`
(`layer_from_dense(kind, ..., activation="relu")` does both). To see what the switch costs before training, splice
the layers in and compare the cross-entropy, e.g.

    layers = {i: layer_from_dense(kind, decoder_blocks(model)[i].mlp, "copy", family=model.config.model_type,
                                  activation="relu") for i in targets}
    with replaced_mlps(model, layers):          # conversion.capture
        ce = next_token_ce(model(ids).logits, ids)   # conversion.metrics
"""

import dataclasses
import math

import torch
from torch import nn

from expertize.modeling import MlpShape
from expertize.modeling.sparse_base import ACTIVATIONS, SparseLayer, canonical_activation
from expertize.modeling.sparse_spec import SparseSpec
from expertize.modeling.sparse_layers import LAYER_KINDS, build_sparse_layer

from .families import mlp_layout

CLUSTERINGS = ("random", "balanced_kmeans")
COPY_NOISE_STD = 0.01
"""Default relative encoder noise for "copy" (ours; the paper is silent): enough to break the router's ties."""


@dataclasses.dataclass(frozen=True)
class DenseMlp:
    """A dense MLP's weights in one layout: y = W_out (φ(W_in x + b_in) [* (W_up x + b_up)]) + b_out."""

    w_in: torch.Tensor
    """(H, I) the projection under φ (GPT-2 c_fc, NeoX dense_h_to_4h, Llama gate_proj)."""
    b_in: torch.Tensor | None
    w_up: torch.Tensor | None
    """(H, I) the linear GLU branch (Llama up_proj), None for plain MLPs."""
    b_up: torch.Tensor | None
    w_out: torch.Tensor
    """(O, H)."""
    b_out: torch.Tensor | None
    activation: str
    """φ, canonical name (see sparse_base.ACTIVATIONS)."""

    @property
    def glu(self) -> bool:
        return self.w_up is not None

    @property
    def has_bias(self) -> bool:
        return any(b is not None for b in (self.b_in, self.b_up, self.b_out))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(I, H, O)."""
        return self.w_in.shape[1], self.w_in.shape[0], self.w_out.shape[0]

    # The facts `SparseSpec.dense_init_fields` and `SparseLayer.dense_fit_problems` read (also `DenseShape`'s).

    @property
    def d_in(self) -> int:
        return self.shape[0]

    @property
    def d_hidden(self) -> int:
        return self.shape[1]

    @property
    def d_out(self) -> int:
        return self.shape[2]

    @property
    def bias(self) -> bool:
        return self.has_bias


@dataclasses.dataclass(frozen=True)
class DenseShape:
    """A dense MLP's shape without its weights (what a spec needs to hold it)."""

    d_in: int
    d_hidden: int
    d_out: int
    glu: bool
    bias: bool
    """Whether the MLP has biases (assumed from the family when only an `MlpShape` is known)."""
    activation: str
    """φ, canonical name."""


def _bias(module: nn.Module) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach()


def dense_mlp(mlp: nn.Module | DenseMlp, family: str | None = None) -> DenseMlp:
    """Read a dense MLP into one layout by its family's `MlpLayout` (families.py): `family` is the model's model_type
    (base or expertize), e.g. GPT-2's Conv1D c_fc / c_proj, the Llama-likes' gate_proj / up_proj / down_proj, Phi-3's
    fused gate_up_proj / down_proj. A `DenseMlp` is returned as it is."""
    if isinstance(mlp, DenseMlp):
        return mlp
    if family is None:
        raise ValueError(f"reading the dense MLP {type(mlp).__name__} needs its family: pass "
                         "family=model.config.model_type (its MLP layout is the family's row in families.py)")
    layout = mlp_layout(family)
    missing = [name for name in layout.children if not hasattr(mlp, name)]
    if missing:
        raise ValueError(
            f"cannot read the dense MLP {type(mlp).__name__} as a {family} MLP: it has no {', '.join(missing)} (its "
            f"children: {', '.join(dict(mlp.named_children()))}); the {family} row of conversion/surgery/families.py "
            "names another MLP layout"
        )

    def weight(name: str) -> torch.Tensor:  # (out, in), whatever the module stores
        w = getattr(mlp, name).weight.detach()
        return w.T if layout.transposed else w  # Conv1D stores (in, out)

    w_in, b_in = weight(layout.w_in), _bias(getattr(mlp, layout.w_in))
    w_up = b_up = None
    if layout.fused_halves is not None:  # one (2H, I) projection: its output rows are the two halves, in this order
        gate = layout.fused_halves.index("gate")
        w_in, w_up = _gate_and_up(w_in, gate)  # (H, I) each
        b_in, b_up = (None, None) if b_in is None else _gate_and_up(b_in, gate)  # (H,) each
    elif layout.w_up is not None:
        w_up, b_up = weight(layout.w_up), _bias(getattr(mlp, layout.w_up))
    return DenseMlp(w_in, b_in, w_up, b_up, weight(layout.w_out), _bias(getattr(mlp, layout.w_out)),
                    _activation_name(getattr(mlp, layout.activation)))


def _gate_and_up(fused: torch.Tensor, gate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused projection's weight (2H, I) or bias (2H,) -> (gate part, up part), each (H, ...): the halves of its
    output as the MLP's `chunk(2, dim=-1)` takes them, the gate half at position `gate`."""
    halves = fused.chunk(2, dim=0)
    return halves[gate], halves[1 - gate]


def _activation_name(act) -> str:
    """Identify the MLP's activation module by its values (transformers' ACT2FN classes have no stable names)."""
    probe = torch.linspace(-6.0, 6.0, 241, dtype=torch.float64)
    with torch.no_grad():
        values = act(probe)
    for name, fn in ACTIVATIONS.items():
        if torch.allclose(values, fn(probe), rtol=0, atol=1e-7):
            return name
    raise ValueError(
        f"the dense MLP's activation {act!r} matches none of {sorted(ACTIVATIONS)}, which the sparse layers implement"
    )


def init_methods(kind: str) -> tuple[str, ...]:
    """The methods by which `kind` can start from a dense MLP: its spec's init_modes besides "default"."""
    return tuple(mode for mode in LAYER_KINDS[kind][0].init_modes if mode != "default")


def _check_method(kind: str, method: str) -> None:
    if kind not in LAYER_KINDS:
        raise ValueError(f"unknown sparse layer kind {kind!r}; known kinds: {sorted(LAYER_KINDS)}")
    methods = init_methods(kind)
    if not methods:
        kinds = [k for k in LAYER_KINDS if init_methods(k)]
        raise ValueError(f"{kind} layers cannot start from a dense MLP (their spec's init_modes are only 'default'); "
                         f"kinds that can: {', '.join(kinds)}")
    _check_choice("method", method, methods)


def spec_for_dense(
    kind: str, mlp: nn.Module | MlpShape | DenseMlp, method: str, num_units: int | None = None,
    k: int | None = None, *, family: str | None = None, **fields,
) -> SparseSpec:
    """A `kind` spec that holds a dense MLP (module of `family`, `MlpShape` or `DenseMlp`) exactly by `method`, for
    `init_from_dense`: the spec's `dense_init_fields` (e.g. MoE-X split: d_expert = ceil(H / M), k = M and
    gate_scaling="none"; copy: d_expert = H, k = 2 and softmax gates). The activation, GLU form and biases default to
    the MLP's (for an `MlpShape`, biases are assumed for plain MLPs (GPT-2, Pythia) and absent for GLU ones
    (Llama-like)); any spec field can be given in `fields`.
    """
    _check_method(kind, method)
    if isinstance(mlp, MlpShape):
        dense = DenseShape(mlp.d_model, mlp.d_hidden, mlp.d_model, mlp.glu, not mlp.glu,
                           canonical_activation(mlp.activation))
    else:
        dense = dense_mlp(mlp, family)
    spec_cls = LAYER_KINDS[kind][0]
    return spec_cls(**{**spec_cls.dense_init_fields(method, dense, num_units=num_units, k=k), **fields})


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


# -- neuron partitions (split) --------------------------------------------------------------------------------------


def _group_sizes(hidden: int, num_groups: int) -> list[int]:
    q, r = divmod(hidden, num_groups)
    return [q + 1 if j < r else q for j in range(num_groups)]


def partition_neurons(
    dense: DenseMlp, num_experts: int, clustering: str = "random", seed: int = 0
) -> list[torch.Tensor]:
    """Split the H hidden neurons into `num_experts` groups of sizes ⌊H/M⌋ or ⌈H/M⌉ (sorted neuron ids per group).

    "random": a seeded random permutation. "balanced_kmeans": k-means on the unit-normalized input weight vectors
    (rows of W_in, concatenated with W_up for GLUs; MoEfication's features) with a greedy capacity-constrained
    assignment, so that neurons that read similar directions share an expert.
    """
    _check_choice("clustering", clustering, CLUSTERINGS)
    hidden = dense.w_in.shape[0]
    if num_experts > hidden:
        raise ValueError(f"cannot split {hidden} hidden neurons into {num_experts} experts; use at most {hidden}")
    sizes = _group_sizes(hidden, num_experts)
    gen = torch.Generator().manual_seed(seed)
    if clustering == "random":
        groups = torch.randperm(hidden, generator=gen).split(sizes)
    else:
        rows = dense.w_in if dense.w_up is None else torch.cat([dense.w_in, dense.w_up], dim=1)  # (H, F)
        assign = _balanced_kmeans(nn.functional.normalize(rows.double(), dim=1), sizes, gen)
        groups = [torch.nonzero(assign == j).flatten() for j in range(num_experts)]
    return [g.sort().values for g in groups]


def _balanced_kmeans(points: torch.Tensor, sizes: list[int], gen: torch.Generator, iters: int = 25) -> torch.Tensor:
    """points (H, F) -> cluster id per point (H,), cluster j holding exactly sizes[j] points."""
    centroids = points[torch.randperm(points.shape[0], generator=gen)[: len(sizes)]]  # (M, F)
    assign = None
    for _ in range(iters):
        new = _capacity_assign(torch.cdist(points, centroids), sizes)  # (H,)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        centroids = torch.stack([points[assign == j].mean(dim=0) for j in range(len(sizes))])
    return assign


def _capacity_assign(dist: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Greedy: points closest to some centroid choose first, each taking its nearest cluster with room left."""
    preference = dist.argsort(dim=1).tolist()  # (H, M)
    room = list(sizes)
    assign = [0] * dist.shape[0]
    for point in dist.min(dim=1).values.argsort().tolist():
        cluster = next(j for j in preference[point] if room[j] > 0)
        room[cluster] -= 1
        assign[point] = cluster
    return torch.tensor(assign)


# -- initialization -------------------------------------------------------------------------------------------------


def _check_layer_fits(layer: SparseLayer, dense: DenseMlp, method: str, allow_activation_change: bool) -> None:
    spec = layer.spec
    problems = layer.dense_fit_problems(dense, method)
    if problems:
        raise ValueError(
            f"{spec.kind} layer does not fit the dense MLP for {method!r}: {'; '.join(problems)}; build the spec "
            f"with spec_for_dense({spec.kind!r}, mlp, {method!r}, ...)"
        )
    activation = getattr(spec, "activation", dense.activation)
    if activation != dense.activation and not allow_activation_change:
        raise ValueError(
            f"{spec.kind}.activation={activation!r} differs from the dense MLP's {dense.activation!r}, which changes "
            f"the function (e.g. MoE-X's ReLU experts from a GELU MLP); pass allow_activation_change=True to do it on "
            f"purpose, or build the spec with activation={dense.activation!r} to upcycle exactly"
        )


@torch.no_grad()
def init_from_dense(
    layer: SparseLayer,
    mlp: nn.Module | DenseMlp,
    method: str,
    *,
    family: str | None = None,
    clustering: str = "random",
    noise_std: float | None = None,
    seed: int = 0,
    allow_activation_change: bool = False,
) -> SparseLayer:
    """Overwrite `layer`'s weights with the dense MLP's (see the module docstring); returns it.

    family: the model_type of the model `mlp` is from (its layout is the family's row; see `dense_mlp`).
    noise_std: Gaussian noise relative to std(W_in) where the layer puts it (MoE-X: every expert's W_enc); None means
    COPY_NOISE_STD for "copy" (ties must be broken) and 0 for "split" (keeps the function exact). clustering and seed
    choose the split partition (`partition_neurons(dense, groups, clustering, seed)` returns it); seed also draws the
    noise.
    """
    _check_method(layer.spec.kind, method)
    std = (COPY_NOISE_STD if method == "copy" else 0.0) if noise_std is None else float(noise_std)
    if not std >= 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std}")
    dense = dense_mlp(mlp, family)
    _check_layer_fits(layer, dense, method, allow_activation_change)
    num_groups = layer.dense_init_groups
    if method == "split":
        groups = partition_neurons(dense, num_groups, clustering, seed)
    else:
        groups = [torch.arange(dense.d_hidden)] * num_groups
    layer.init_from_dense(dense, groups, noise_std=std, seed=seed)
    return layer


init_moe_from_dense = init_from_dense
"""The name upcycle.py and benchmarks/ import (a mixture of experts from a dense MLP)."""


def layer_from_dense(
    kind: str,
    mlp: nn.Module,
    method: str,
    num_units: int | None = None,
    k: int | None = None,
    *,
    family: str | None = None,
    clustering: str = "random",
    noise_std: float | None = None,
    seed: int = 0,
    **fields,
) -> SparseLayer:
    """Build a `kind` layer that starts as `mlp` (a module of the `family` model_type's MLP) in one call, on the MLP's
    device and dtype.

    `fields` go to the spec (see `spec_for_dense`); an explicit `activation` other than the MLP's is taken as the
    deliberate switch (e.g. activation="relu" for MoE-X's ReLU experts).
    """
    dense = dense_mlp(mlp, family)
    spec = spec_for_dense(kind, dense, method, num_units, k, **fields)
    layer = build_sparse_layer(spec).to(device=dense.w_in.device, dtype=dense.w_in.dtype)
    return init_from_dense(
        layer, dense, method, clustering=clustering, noise_std=noise_std, seed=seed,
        allow_activation_change="activation" in fields,
    )
