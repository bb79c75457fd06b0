"""TopK transcoders (Dunefsky et al. 2024) and skip transcoders (Paulo et al. 2025): the MxD paper's baselines.

    z = TopK(ReLU(W_enc x + b_enc))        over L latents
    y = W_decᵀ z + b_dec  (+ W_skip x)     skip transcoder adds a dense linear skip path

Shapes and the parameters, decoder, resampling and export view the transcoder kinds share: latent_coder.py; this file
holds the TopK activation (its sparse backward) and AuxK. The decoder sum touches only the K selected rows of W_dec
(`embedding_bag`).
"""

import dataclasses
from typing import ClassVar

import torch

from .latent_coder import LatentCoderLayer, LatentCoderSpec
from .sparse_code import SparseCode
from .sparse_kernels import LinearReluTopK, dead_relu_topk, sparse_rows_sum
from .sparse_spec import _require_bool, arxiv_bibtex


@dataclasses.dataclass
class TranscoderSpec(LatentCoderSpec):
    kind = "transcoder"
    activation_meaning: ClassVar[str] = "latent value TopK(ReLU(W_enc x + b_enc))"
    title: ClassVar[str] = "TopK transcoder"
    k_bound: ClassVar[str] = "TopK cannot select more latents than exist"
    citation: ClassVar[str] = arxiv_bibtex(
        "dunefsky2024transcoders",
        title="Transcoders Find Interpretable LLM Feature Circuits",
        authors=["Dunefsky, Jacob", "Chlenski, Philippe", "Nanda, Neel"],
        year=2024,
        arxiv_id="2406.11944",
    )
    selection_bias: bool = False
    """A per-latent bias `b_select` (a buffer) added to the encoder pre-activations only to choose the top K among
    the positive ones, never to weight (auxiliary-loss-free balancing; the trainer moves it, `train.balance`)."""

    skip_connection = False  # class constant; the skip transcoder sets it
    coder_activation: ClassVar[str | None] = "topk"

    def validate(self) -> None:
        super().validate()
        _require_bool(self, "selection_bias")


@dataclasses.dataclass
class SkipTranscoderSpec(TranscoderSpec):
    kind = "skip_transcoder"
    title: ClassVar[str] = "skip transcoder"
    citation: ClassVar[str] = arxiv_bibtex(
        "paulo2025transcoders",
        title="Transcoders Beat Sparse Autoencoders for Interpretability",
        authors=["Paulo, Gon{\\c{c}}alo", "Shabalin, Stepan", "Belrose, Nora"],
        year=2025,
        arxiv_id="2501.18823",
    )
    skip_connection = True


class TranscoderLayer(LatentCoderLayer):
    """TopK transcoder, with the zero-initialized skip path `W_skip` when `spec.skip_connection`."""

    spec: TranscoderSpec

    selects_top_k_units = True
    supports_auxk = True
    """Dead latents can model the residual error (`auxk_reconstruction`; conversion/training/auxk.py)."""

    def encode(self, x: torch.Tensor) -> SparseCode:
        """z = TopK(ReLU(W_enc x + b_enc)) as (index, weight) pairs: (..., I) -> (..., K).

        The backward touches only the K selected encoder rows (`LinearReluTopK`: no dense (T, L) gradient, no two
        T×L×I products); the pre-activations are kept for AuxK when it runs this step."""
        source, lead = x, x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        values, index, pre = LinearReluTopK.apply(
            x, self.W_enc, self.b_enc, self.spec.k, self.b_select, self._wants_pre()
        )  # (T, K) each
        self._note_selection_scale(values)
        self._keep(source, pre=pre)
        return self._hook_code(index, values, lead)

    def auxk_reconstruction(self, x: torch.Tensor, dead_mask: torch.Tensor, k_aux: int) -> torch.Tensor:
        """AuxK's ê: W_decᵀ z_aux with z_aux = TopK_aux(ReLU(W_enc x + b_enc)) over the dead latents; no b_dec and
        no skip path (the dead latents' contribution only). (..., I), (L,) bool -> (..., O).
        Gradients reach only the selected dead latents' rows of W_enc, b_enc and W_dec. The ranking reuses the
        training forward's pre-activations when it kept them (`keep_for_auxk`)."""
        kept, lead = self._take_kept(x), x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (T, I)
        values, index = dead_relu_topk(x, self.W_enc, self.b_enc, dead_mask, k_aux, pre=kept.get("pre"))
        return sparse_rows_sum(SparseCode(index, values), self.W_dec).view(*lead, -1)  # (..., O)
