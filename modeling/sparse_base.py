"""Pieces shared by every sparse layer: the spec base class, the sparse code, its hook point and interventions.

Part of the Hub bundle: imports only torch, the standard library and sibling files.

Letters used in shape comments across the bundle:
    T tokens (any leading dims flattened), I d_in, O d_out, H hidden width, N experts / latents, K active (top-k).
"""

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F


class SparseCode(NamedTuple):
    """The sparse part of a layer's computation for each token."""

    top_k_index: torch.Tensor
    """(..., K) int64 ids of the active experts / latents."""
    top_k_weights: torch.Tensor
    """(..., K) their coefficients (post-activation, post-TopK)."""

    def flat(self) -> "SparseCode":
        """The same code with the leading dims flattened: (..., K) -> (T, K)."""
        return SparseCode(
            self.top_k_index.reshape(-1, self.top_k_index.shape[-1]),
            self.top_k_weights.reshape(-1, self.top_k_weights.shape[-1]),
        )


class CodeHook(nn.Module):
    """Identity on the `SparseCode`.

    A stable module path (`...mlp.code_hook`) whose forward output hooks, nnsight and SAE tooling can read and replace.
    The code it sees has the layer input's leading shape, e.g. (batch, seq, K) inside a model, like the module's own
    output (batch, seq, d_out).
    """

    def forward(self, code: SparseCode) -> SparseCode:
        return code


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (Monet, Primer)
}
# Activation names used by transformers configs -> ours (same function, other spelling).
ACTIVATION_ALIASES = {"gelu_pytorch_tanh": "gelu_new", "swish": "silu", "gelu_fast": "gelu_new"}


def canonical_activation(name: str) -> str:
    name = ACTIVATION_ALIASES.get(name, name)
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; choose one of {sorted(ACTIVATIONS)}")
    return name


def _require_int(spec: "SparseSpec", name: str, minimum: int = 1) -> None:
    value = getattr(spec, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{spec.kind}.{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{spec.kind}.{name} must be >= {minimum}, got {value}")


def _require_bool(spec: "SparseSpec", name: str) -> None:
    value = getattr(spec, name)
    if not isinstance(value, bool):
        raise ValueError(f"{spec.kind}.{name} must be true or false, got {value!r}")


def _require_choice(spec: "SparseSpec", name: str, choices: Iterable[str]) -> None:
    value = getattr(spec, name)
    if value not in choices:
        raise ValueError(f"{spec.kind}.{name} must be one of {sorted(choices)}, got {value!r}")


def arxiv_bibtex(key: str, *, title: str, authors: list[str], year: int, arxiv_id: str) -> str:
    """BibTeX @article entry of an arXiv paper (the `citation` of a spec class)."""
    fields = {
        "title": title,
        "author": " and ".join(authors),
        "journal": f"arXiv preprint arXiv:{arxiv_id}",
        "year": year,
        "eprint": arxiv_id,
        "archivePrefix": "arXiv",
        "url": f"https://arxiv.org/abs/{arxiv_id}",
    }
    body = ",\n".join(f"  {name:<13} = {{{value}}}" for name, value in fields.items())
    return f"@article{{{key},\n{body}\n}}"


@dataclasses.dataclass
class SparseSpec:
    """Hyperparameters of one sparse layer. Subclasses add fields and set `kind`.

    A spec validates itself on construction, counts its parameters and FLOPs, and round-trips through the plain JSON
    dict stored in the model config (`to_dict` / `from_dict`).
    """

    kind: ClassVar[str] = ""

    # -- Kind facts -------------------------------------------------------------------------------------------------
    # What the recipe, the model card and the docs know about a kind, declared once on its spec class: a new kind
    # sets these in its own file and registers itself in `sparse_layers.LAYER_KINDS`; no other file names it.

    title: ClassVar[str] = ""
    """The method's name in prose, e.g. "Mixture of Decoders (MxD)" (model card)."""
    unit_name: ClassVar[str] = "expert"
    """What the sparse code indexes: "expert" or "latent" (model card: "K of N experts active")."""
    units_field: ClassVar[str] = "num_experts"
    """The field counting the units (N): "num_experts" or "num_latents"."""
    match_field: ClassVar[str | None] = None
    """The field parameter matching (recipe `layer.match_transcoder`) chooses; None: `units_field`."""
    match_conventions: ClassVar[tuple[str, ...]] = ("exact",)
    """Parameter-matching conventions (recipe `layer.match_convention`). "exact": the largest `match_field` within
    the transcoder's parameter count; others are computed by `matched_size`."""
    init_modes: ClassVar[tuple[str, ...]] = ("default",)
    """Where the weights can start (recipe `layer.init`): "default" (`reset_parameters`), or modes built from the
    dense MLP ("split", "copy") that the conversion package implements for this kind."""
    citation: ClassVar[str] = ""
    """BibTeX of the paper behind the kind (cited by every model card that uses it)."""

    d_in: int
    d_out: int

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _require_int(self, "d_in")
        _require_int(self, "d_out")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SparseSpec":
        data = dict(data)
        kind = data.pop("kind", cls.kind)
        if kind != cls.kind:
            raise ValueError(f"spec of kind {kind!r} cannot be read as {cls.kind!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown} for sparse layer kind {cls.kind!r}; valid fields: {sorted(names)}")
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        if missing:
            raise ValueError(f"sparse layer kind {cls.kind!r} needs field(s) {missing}")
        return cls(**data)

    @classmethod
    def size_field(cls) -> str:
        """The field parameter matching chooses (`match_field`, else `units_field`)."""
        return cls.match_field or cls.units_field

    @classmethod
    def mlp_defaults(cls, shape: Any, *, init: str = "default", num_units: int | None = None) -> dict[str, Any]:
        """Field values derived from the dense MLP this layer replaces (the recipe's "auto" values; explicit recipe
        settings override them).

        `shape` is a `configuration_expertize.MlpShape` (d_model, d_hidden, activation, glu); `init` the recipe's
        `layer.init`; `num_units` the unit count when the recipe gives it. The activation is returned as the base
        model names it (the caller canonicalizes it). Kinds whose fields mirror the MLP differently override this.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        derived = {
            "d_hidden": shape.d_hidden,
            "encoder": "glu" if shape.glu else "mlp",
            "activation": shape.activation,
        }
        return {name: value for name, value in derived.items() if name in names}

    @classmethod
    def matched_size(cls, fields: dict[str, Any], num_latents: int, convention: str) -> int | None:
        """`size_field()`'s value under a parameter-matching convention other than "exact" (listed in
        `match_conventions`) for a transcoder of `num_latents` latents; None: the exact search applies."""
        return None

    def num_parameters(self) -> int:
        raise NotImplementedError

    def active_parameters(self) -> int:
        """Parameters touched per token (dense parts + the K selected rows)."""
        raise NotImplementedError

    def flops_per_token(self) -> int:
        """Forward FLOPs per token (2 x multiply-accumulates), counting only the K selected rows of sparse parts."""
        raise NotImplementedError


class SparseLayer(nn.Module):
    """Base class of every sparse MLP replacement.

    `forward(hidden_states) -> hidden_states` with the MLP's shape and dtype; `encode(x)` returns the `SparseCode`
    after it has passed through `self.code_hook`. Interventions (`steer`, `ablate`) act on the code after TopK.
    """

    spec: SparseSpec

    def __init__(self, spec: SparseSpec) -> None:
        super().__init__()
        self.spec = spec
        self.code_hook = CodeHook()
        # Interventions are run-time state, never saved: plain attributes, not buffers.
        self._steering: dict[int, float] = {}
        self._ablated: frozenset[int] = frozenset()
        # Side channel for routed layers (transformers' MoEs record router logits from their router module; a
        # swapped `.mlp` is invisible to that machinery, so the model collects these after the forward instead).
        self.router_logits: torch.Tensor | None = None
        """(T, E) router scores of the last forward, set by routed layers while `record_router_outputs` is on."""
        self.aux_loss: torch.Tensor | None = None
        """Scalar auxiliary loss of the last forward, *already weighted* by the spec's own coefficient(s); set by
        layers that have one, while training or while `record_router_outputs` is on."""
        self.record_router_outputs = False

    @property
    def num_units(self) -> int:
        """Number of units (experts / latents) the code indexes."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        raise NotImplementedError

    # -- router side channel and optimizer hooks ------------------------------------------------------------------

    @property
    def wants_router_outputs(self) -> bool:
        """Whether this forward should compute `aux_loss` / keep `router_logits` (training, or asked by the model)."""
        return self.training or self.record_router_outputs

    def _set_router_outputs(self, router_logits: torch.Tensor | None, aux_loss: torch.Tensor | None) -> None:
        if self.wants_router_outputs:
            self.router_logits, self.aux_loss = router_logits, aux_loss

    def clear_router_outputs(self) -> None:
        self.router_logits = self.aux_loss = None

    def before_optimizer_step(self) -> None:
        """Called by trainers after backward, before the optimizer step (e.g. project gradients)."""

    def after_optimizer_step(self) -> None:
        """Called by trainers after the optimizer step (e.g. renormalize constrained weights)."""

    # -- interventions --------------------------------------------------------------------------------------------

    def _check_units(self, units: Iterable[int]) -> list[int]:
        units = [int(u) for u in units]
        bad = [u for u in units if not 0 <= u < self.num_units]
        if bad:
            raise ValueError(f"unit id(s) {bad} out of range: this layer has {self.num_units} units (0..{self.num_units - 1})")
        return units

    def steer(self, unit: int, value: float) -> None:
        """Add `value` to unit `unit`'s coefficient after TopK at every position (the MxD paper's `a_n += λ`)."""
        (unit,) = self._check_units([unit])
        self._steering[unit] = self._steering.get(unit, 0.0) + float(value)

    def ablate(self, units: Iterable[int]) -> None:
        """Zero the coefficients of `units` after TopK (the other selected units keep theirs)."""
        self._ablated = self._ablated | frozenset(self._check_units(units))

    def clear_interventions(self) -> None:
        self._steering = {}
        self._ablated = frozenset()

    @contextlib.contextmanager
    def intervene(self, steer: dict[int, float] | None = None, ablate: Iterable[int] = ()) -> Iterator["SparseLayer"]:
        """Context manager: `with layer.intervene(steer={5: 100.0}, ablate=[3]): model.generate(...)`."""
        saved = (dict(self._steering), self._ablated)
        try:
            for unit, value in (steer or {}).items():
                self.steer(unit, value)
            self.ablate(ablate)
            yield self
        finally:
            self._steering, self._ablated = saved

    def _hook_code(self, index: torch.Tensor, weights: torch.Tensor, lead: tuple[int, ...]) -> SparseCode:
        """Interventions, then `code_hook` at the input's leading shape: (T, K) each -> the code (*lead, K')."""
        code = self._intervene_on_code(index, weights)
        return self.code_hook(SparseCode(code.top_k_index.reshape(*lead, -1), code.top_k_weights.reshape(*lead, -1)))

    def _hook_code_tracked(
        self, index: torch.Tensor, weights: torch.Tensor, lead: tuple[int, ...]
    ) -> tuple[SparseCode, bool, bool]:
        """`_hook_code` for layers that decode faster from their own internal form while the code is untouched.

        Returns (the code flattened to (T, K'), same_units, same_values): whether the code's units / values are still
        `index` / `weights` — no intervention and no hook replaced or edited them (in place too: nnsight's setitem
        bumps the version counter). Where edits cannot be seen — under torch.compile / torch.export, or for
        inference-mode tensors, which carry no version counter — both are False, so the caller decodes whatever the
        code holds (its general path, which is also free of host synchronizations).
        """
        code = self._intervene_on_code(index, weights)
        shown = SparseCode(code.top_k_index.reshape(*lead, -1), code.top_k_weights.reshape(*lead, -1))
        trackable = not (
            torch.compiler.is_compiling() or shown.top_k_index.is_inference() or shown.top_k_weights.is_inference()
        )
        stamp = (shown.top_k_index._version, shown.top_k_weights._version) if trackable else None
        out = self.code_hook(shown)
        if not trackable:
            return out.flat(), False, False
        same_units = (
            code.top_k_index is index and out.top_k_index is shown.top_k_index and out.top_k_index._version == stamp[0]
        )
        same_values = (
            code.top_k_weights is weights
            and out.top_k_weights is shown.top_k_weights
            and out.top_k_weights._version == stamp[1]
        )
        return out.flat(), same_units, same_values

    def _intervene_on_code(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> SparseCode:
        # top_k_index, top_k_weights: (T, K)
        if self._ablated:
            ablated = torch.tensor(sorted(self._ablated), device=top_k_index.device)
            top_k_weights = top_k_weights.masked_fill(torch.isin(top_k_index, ablated), 0.0)
        if self._steering:
            # Steered units ride along as extra (index, value) pairs: the sum over the code then adds λ·row_n exactly,
            # also when n is already among the top K (embedding_bag sums duplicate ids).
            n_tokens, n_steer = top_k_index.shape[0], len(self._steering)
            extra_index = torch.tensor(list(self._steering), device=top_k_index.device).expand(n_tokens, n_steer)
            extra_weights = torch.tensor(
                list(self._steering.values()), device=top_k_weights.device, dtype=top_k_weights.dtype
            ).expand(n_tokens, n_steer)
            top_k_index = torch.cat([top_k_index, extra_index], dim=-1)  # (T, K + S)
            top_k_weights = torch.cat([top_k_weights, extra_weights], dim=-1)  # (T, K + S)
        return SparseCode(top_k_index, top_k_weights)


def sparse_rows_sum(code: SparseCode, rows: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k · rows[idx_k] per token, touching only the selected rows (never densifying over N).

    code: (T, K) index and weights; rows: (N, O). Returns (T, O).
    """
    return F.embedding_bag(
        code.top_k_index, rows, per_sample_weights=code.top_k_weights.to(rows.dtype), mode="sum"
    )


def relu_topk(pre: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TopK(ReLU(pre)) along the last dim: returns (values, indices), each (T, K)."""
    values, indices = pre.topk(k, dim=-1, sorted=False)
    # ReLU after TopK equals TopK after ReLU (ReLU is monotone) and touches K entries instead of N.
    return F.relu(values), indices


class _LinearReluTopK(torch.autograd.Function):
    """`relu_topk(F.linear(x, weight, bias), k)` with a backward that touches only the K selected rows of `weight`.

    The gradient of the (T, N) logits is zero outside the K selected entries per token (g_tk), so the dense backward
    (two T×N×I matmuls) reduces to gathers and scatters over T·K rows, which is exactly one `embedding_bag` and its
    backward: grad x_t = Σ_k g_tk W[idx_tk], grad W[n] = Σ_{idx_tk = n} g_tk x_t, grad b[n] = Σ_{idx_tk = n} g_tk.
    Same values as the plain ops; gradients equal theirs up to float summation order.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, k):  # x (T, I), weight (N, I), bias (N,) or None
        values, index = relu_topk(F.linear(x, weight, bias), k)  # (T, K) each
        ctx.save_for_backward(x, weight, index, values)
        ctx.mark_non_differentiable(index)
        return values, index

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_values, _grad_index):
        x, weight, index, values = ctx.saved_tensors
        grad = torch.where(values > 0, grad_values, 0).to(weight.dtype)  # ReLU's backward, as F.relu's: (T, K)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_x or need_w:
            with torch.enable_grad():
                w = weight.detach().requires_grad_(need_w)
                grad_x = F.embedding_bag(index, w, per_sample_weights=grad, mode="sum")  # Σ_k g_tk W[idx_tk]: (T, I)
            if need_w:
                (grad_w,) = torch.autograd.grad(grad_x, w, grad_outputs=x.to(weight.dtype))  # (N, I)
            grad_x = grad_x.detach().to(x.dtype) if need_x else None
        if need_b:  # False when bias is None
            grad_b = weight.new_zeros(weight.shape[0]).index_add_(0, index.reshape(-1), grad.reshape(-1))  # (N,)
        return grad_x, grad_w, grad_b, None


def uniform_(param: nn.Parameter, bound: float) -> None:
    nn.init.uniform_(param, -bound, bound)


def linear_bound(fan_in: int) -> float:
    """nn.Linear's default init bound (kaiming_uniform with a=sqrt(5) reduces to 1/sqrt(fan_in))."""
    return 1.0 / math.sqrt(fan_in)
