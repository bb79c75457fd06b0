"""Initialize MoE-X layers from a dense MLP ("sparse upcycling") for GPT-2, GPT-NeoX/Pythia and Llama-like MLPs.

Two methods:

- "split" (MoEfication / LLaMA-MoE style; ours for MoE-X, the paper does not say how it upcycles): the H hidden
  neurons are partitioned into M groups (random, or balanced k-means on the neurons' input weight vectors) and expert j
  holds group j: its encoder rows, biases and decoder columns. d_expert = ceil(H / M); when M does not divide H the
  spare slots of the smaller groups are zero (zero encoder row and bias, zero decoder column: they add nothing, and
  under ReLU they get no gradient either, so prefer M | H). With all experts on (k = M), gate_scaling="none" and the
  base activation, the layer equals the MLP exactly: Σ_j W_decʲ φ(W_encʲ x + b_encʲ) + b_dec is the dense sum.
- "copy" (Komatsuzaki et al. 2022, the paper's "upcycling"): every expert is the whole MLP (d_expert = H). Softmax
  gates sum to 1, so the layer equals the MLP at any k while the experts are identical. But identical experts also
  have identical sparsity-router scores, so TopK's tie-breaking sends every token to the same k experts and the others
  never train (digest pitfall 2). Gaussian noise of `noise_std` × std(W_in) on each expert's encoder breaks the ties
  (the router reads only W_enc); it perturbs the function by about that relative amount.

GLU MLPs (Llama: down(act(gate x) * up x)) map gate -> W_enc (the branch under φ, which the sparsity router reads),
up -> W_up, down -> W_dec, with `expert_glu=True`. MoE-X's experts are ReLU; switching a GELU / SiLU MLP to ReLU
changes the function, so it is an explicit option: build the spec with `activation="relu"` and pass
`allow_activation_change=True` (`moe_x_from_dense(..., activation="relu")` does both). To see what the switch costs
before training, splice the layers in and compare the cross-entropy, e.g.

    layers = {i: moe_x_from_dense(decoder_blocks(model)[i].mlp, "copy", activation="relu") for i in targets}
    with replaced_mlps(model, layers):          # conversion.capture
        ce = next_token_ce(model(ids).logits, ids)   # conversion.metrics
"""

import dataclasses
import math

import torch
from torch import nn

from expertize.modeling import MlpShape, MoeXLayer, MoeXSpec
from expertize.modeling.sparse_base import ACTIVATIONS, canonical_activation

METHODS = ("split", "copy")
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


def _bias(module: nn.Module) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach()


def dense_mlp(mlp: nn.Module) -> DenseMlp:
    """Read a GPT-2 (Conv1D c_fc/c_proj), GPT-NeoX (dense_h_to_4h/dense_4h_to_h) or Llama-like
    (gate_proj/up_proj/down_proj) MLP into one layout."""
    if isinstance(mlp, DenseMlp):
        return mlp
    names = set(dict(mlp.named_children()))
    if {"c_fc", "c_proj"} <= names:  # GPT-2: Conv1D weights are (in, out)
        w_in, b_in = mlp.c_fc.weight.detach().T, _bias(mlp.c_fc)
        w_up = b_up = None
        w_out, b_out = mlp.c_proj.weight.detach().T, _bias(mlp.c_proj)
        act = mlp.act
    elif {"dense_h_to_4h", "dense_4h_to_h"} <= names:  # GPT-NeoX: nn.Linear (out, in)
        w_in, b_in = mlp.dense_h_to_4h.weight.detach(), _bias(mlp.dense_h_to_4h)
        w_up = b_up = None
        w_out, b_out = mlp.dense_4h_to_h.weight.detach(), _bias(mlp.dense_4h_to_h)
        act = mlp.act
    elif {"gate_proj", "up_proj", "down_proj"} <= names:  # Llama, Mistral, Qwen2, ...
        w_in, b_in = mlp.gate_proj.weight.detach(), _bias(mlp.gate_proj)
        w_up, b_up = mlp.up_proj.weight.detach(), _bias(mlp.up_proj)
        w_out, b_out = mlp.down_proj.weight.detach(), _bias(mlp.down_proj)
        act = mlp.act_fn
    else:
        raise ValueError(
            f"cannot read the dense MLP {type(mlp).__name__} (children {sorted(names)}): supported layouts are GPT-2 "
            "(c_fc, c_proj), GPT-NeoX (dense_h_to_4h, dense_4h_to_h) and Llama-like (gate_proj, up_proj, down_proj)"
        )
    return DenseMlp(w_in, b_in, w_up, b_up, w_out, b_out, _activation_name(act))


def _activation_name(act) -> str:
    """Identify the MLP's activation module by its values (transformers' ACT2FN classes have no stable names)."""
    probe = torch.linspace(-6.0, 6.0, 241, dtype=torch.float64)
    with torch.no_grad():
        values = act(probe)
    for name, fn in ACTIVATIONS.items():
        if torch.allclose(values, fn(probe), rtol=0, atol=1e-7):
            return name
    raise ValueError(
        f"the dense MLP's activation {act!r} matches none of {sorted(ACTIVATIONS)}, which the MoE-X experts implement"
    )


def moe_x_spec_for_mlp(
    mlp: nn.Module | MlpShape | DenseMlp, method: str, num_experts: int = 8, k: int | None = None, **fields
) -> MoeXSpec:
    """A MoE-X spec matching a dense MLP (module, `MlpShape` or `DenseMlp`) for `init_moe_from_dense`.

    split: d_expert = ceil(H / M), k = M and gate_scaling="none" by default (the exact equivalent; lower k for a
    sparse layer). copy: d_expert = H, k = 2 (the paper) and softmax gates. The activation, GLU form and expert biases
    default to the MLP's (for an `MlpShape`, biases are assumed for plain MLPs (GPT-2, Pythia) and absent for GLU
    ones (Llama-like): pass expert_bias to override). Any other MoeXSpec field can be given in `fields`.
    """
    _check_choice("method", method, METHODS)
    if isinstance(mlp, MlpShape):
        d_in = d_out = mlp.d_model
        hidden, glu, bias, activation = mlp.d_hidden, mlp.glu, not mlp.glu, canonical_activation(mlp.activation)
    else:
        dense = dense_mlp(mlp)
        d_in, hidden, d_out = dense.shape
        glu, bias, activation = dense.glu, dense.has_bias, dense.activation
    split = method == "split"
    defaults = dict(
        d_in=d_in,
        d_out=d_out,
        d_expert=math.ceil(hidden / num_experts) if split else hidden,
        num_experts=num_experts,
        k=(num_experts if split else 2) if k is None else k,
        activation=activation,
        expert_bias=bias,
        expert_glu=glu,
        gate_scaling="none" if split else "softmax",
    )
    return MoeXSpec(**{**defaults, **fields})


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


def _check_layer_fits(layer: MoeXLayer, dense: DenseMlp, method: str, allow_activation_change: bool) -> None:
    spec = layer.spec
    I, H, O = dense.shape
    M = spec.num_experts
    fix = "build the spec with moe_x_spec_for_mlp(mlp, method, ...)"
    want_d_expert = math.ceil(H / M) if method == "split" else H
    problems = []
    if (spec.d_in, spec.d_out) != (I, O):
        problems.append(f"d_in, d_out = {spec.d_in}, {spec.d_out} but the MLP maps {I} -> {O}")
    if spec.d_expert != want_d_expert:
        problems.append(
            f"d_expert={spec.d_expert} but {method} of a {H}-wide MLP into {M} experts needs d_expert={want_d_expert}"
        )
    if spec.expert_glu != dense.glu:
        problems.append(f"expert_glu={spec.expert_glu} but the MLP is {'gated (GLU)' if dense.glu else 'not gated'}")
    if (dense.b_in is not None or dense.b_up is not None) and not spec.expert_bias:
        problems.append("the MLP has encoder biases but expert_bias=false")
    if problems:
        raise ValueError(f"moe_x layer does not fit the dense MLP for {method!r}: {'; '.join(problems)}; {fix}")
    if method == "copy" and spec.gate_scaling != "softmax":
        raise ValueError(
            f"copy-upcycling needs gates that sum to 1 (gate_scaling='softmax'), got {spec.gate_scaling!r}, which "
            "would multiply the MLP's output; use gate_scaling='softmax'"
        )
    if method == "split" and spec.gate_scaling == "softmax":
        raise ValueError(
            "split-upcycling with gate_scaling='softmax' scales every expert's share of the dense sum by its gate "
            "(≈ 1/k): use gate_scaling='none' (exact at k = num_experts) or 'k_softmax'"
        )
    if spec.activation != dense.activation and not allow_activation_change:
        raise ValueError(
            f"moe_x.activation={spec.activation!r} differs from the dense MLP's {dense.activation!r}, which changes "
            f"the function (e.g. MoE-X's ReLU experts from a GELU MLP); pass allow_activation_change=True to do it on "
            f"purpose, or build the spec with activation={dense.activation!r} to upcycle exactly"
        )


@torch.no_grad()
def init_moe_from_dense(
    layer: MoeXLayer,
    mlp: nn.Module | DenseMlp,
    method: str,
    *,
    clustering: str = "random",
    noise_std: float | None = None,
    seed: int = 0,
    allow_activation_change: bool = False,
) -> MoeXLayer:
    """Overwrite `layer`'s experts and b_dec with the dense MLP's weights (see the module docstring); returns it.

    noise_std: Gaussian noise added to every expert's W_enc, relative to std(W_in); None means COPY_NOISE_STD for
    "copy" (ties must be broken) and 0 for "split" (keeps the function exact). clustering and seed choose the split
    partition (`partition_neurons(dense, M, clustering, seed)` returns it); seed also draws the noise. The switch
    router keeps its random initialization (Komatsuzaki et al.).
    """
    _check_choice("method", method, METHODS)
    std = (COPY_NOISE_STD if method == "copy" else 0.0) if noise_std is None else float(noise_std)
    if not std >= 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std}")
    dense = dense_mlp(mlp)
    _check_layer_fits(layer, dense, method, allow_activation_change)
    M = layer.spec.num_experts
    H = dense.w_in.shape[0]
    if method == "split":
        groups = partition_neurons(dense, M, clustering, seed)
    else:
        groups = [torch.arange(H)] * M

    def fill(param: nn.Parameter | None, source: torch.Tensor | None, dim: int) -> None:
        # param (M, ..., D, ...) with the hidden dim at `dim` (1 for W_enc/W_up/b_enc/b_up, 2 for W_dec): expert j
        # takes `source`'s hidden entries groups[j] (dim 0 of source, -1 for W_out) into its first len(group) slots.
        if param is None:
            return
        if source is None:  # the MLP has no such bias: zeros keep the function
            nn.init.zeros_(param)
            return
        value = torch.zeros(param.shape, dtype=source.dtype, device=source.device)
        for j, group in enumerate(groups):
            part = source.index_select(0 if dim == 1 else source.dim() - 1, group.to(source.device))
            value[j].narrow(dim - 1, 0, len(group)).copy_(part)
        param.copy_(value)

    fill(layer.W_enc, dense.w_in, 1)  # (M, D, I) <- rows of W_in
    fill(layer.b_enc, dense.b_in, 1)  # (M, D)
    fill(layer.W_up, dense.w_up, 1)
    fill(layer.b_up, dense.b_up, 1)
    fill(layer.W_dec, dense.w_out, 2)  # (M, O, D) <- columns of W_out
    if dense.b_out is None:
        nn.init.zeros_(layer.b_dec)
    else:
        layer.b_dec.copy_(dense.b_out)

    if std > 0:
        gen = torch.Generator().manual_seed(seed)
        scale = std * dense.w_in.double().std().item()
        for j, group in enumerate(groups):  # one expert at a time: no second (M, D, I) tensor
            noise = torch.randn((len(group), layer.W_enc.shape[2]), generator=gen, dtype=torch.float64)
            layer.W_enc[j, : len(group)].add_((scale * noise).to(layer.W_enc))  # padding slots stay zero
    return layer


def moe_x_from_dense(
    mlp: nn.Module,
    method: str,
    num_experts: int = 8,
    k: int | None = None,
    *,
    clustering: str = "random",
    noise_std: float | None = None,
    seed: int = 0,
    **fields,
) -> MoeXLayer:
    """Build and upcycle a MoE-X layer from `mlp` in one call, on the MLP's device and dtype.

    `fields` go to the spec (see `moe_x_spec_for_mlp`); an explicit `activation` other than the MLP's is taken as the
    deliberate switch (e.g. activation="relu" for MoE-X's ReLU experts).
    """
    dense = dense_mlp(mlp)
    spec = moe_x_spec_for_mlp(dense, method, num_experts, k, **fields)
    weight = dense.w_in
    layer = MoeXLayer(spec).to(device=weight.device, dtype=weight.dtype)
    return init_moe_from_dense(
        layer,
        dense,
        method,
        clustering=clustering,
        noise_std=noise_std,
        seed=seed,
        allow_activation_change="activation" in fields,
    )
