"""circuit-tracer's loading and running of a per-layer TopK transcoder set, restated from its source for a test that
cannot install it (its TopK loading is not in the registry release, circuit-tracer 0.5.0, which also pins
transformers < 5). Followed: github.com/safety-research/circuit-tracer

- circuit_tracer/utils/hf_utils.py `load_transcoders` (commit b00048e4710a66436b08364778f574753a7d2b63): config.yaml
  with model_kind "transcoder_set", feature_input_hook, feature_output_hook, activation, k; `resolve_transcoder_paths`
  takes layer_{i}.safetensors for i = 0 .. (number of files - 1).
- circuit_tracer/transcoder/single_layer_transcoder.py (commit 196e2cecbae69532a5677630f6b7c99c6c275fe3):
  `load_transcoder_set` builds TopK(k) when activation is "topk"; `load_transcoder` reads every tensor of the file,
  sizes the transcoder by b_enc (d_transcoder) and b_dec (d_model), has W_skip exactly when the file does, and loads
  the tensors with a strict `load_state_dict` (so the file holds W_enc, W_dec, b_enc, b_dec and optionally W_skip,
  nothing else); `SingleLayerTranscoder` stores W_enc and W_dec as (d_transcoder, d_model), encodes
  F.linear(x, W_enc, b_enc), decodes acts @ W_dec + b_dec and adds x @ W_skip.T; `TranscoderSet` asserts layers
  0..max and one d_transcoder.
- circuit_tracer/transcoder/activation_functions.py `TopK` (commit b00048e4): the top k by value, no ReLU,
  x * gate.
- The registry's circuit-tracer 0.5.0 (what a JumpReLU set is for; tests/test_circuit_tracer_e2e.py runs the real
  one): `load_transcoder_set` -> `load_relu_transcoder` ignores config.yaml's activation and k; the layer is
  JumpReLU(threshold) (x * (x > threshold), the threshold under the key `activation_function.threshold`) when the file
  has that key, else ReLU.

Standalone (torch, safetensors, PyYAML): run in a subprocess that cannot import expertize.
"""

from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F


class TopK(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.topk(x, k=self.k, dim=-1).indices
        gate = torch.zeros_like(x).scatter_(-1, index, 1)
        return x * gate


class JumpReLU(nn.Module):
    def __init__(self, threshold: torch.Tensor) -> None:
        super().__init__()
        self.threshold = nn.Parameter(threshold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (x > self.threshold)


class SingleLayerTranscoder(nn.Module):
    def __init__(self, d_model: int, d_transcoder: int, activation: nn.Module, skip: bool) -> None:
        super().__init__()
        self.d_transcoder = d_transcoder
        self.W_enc = nn.Parameter(torch.zeros(d_transcoder, d_model))
        self.W_dec = nn.Parameter(torch.zeros(d_transcoder, d_model))
        self.b_enc = nn.Parameter(torch.zeros(d_transcoder))
        self.b_dec = nn.Parameter(torch.zeros(d_model))
        self.W_skip = nn.Parameter(torch.zeros(d_model, d_model)) if skip else None
        self.activation_function = activation

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation_function(F.linear(x, self.W_enc, self.b_enc))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.encode(x) @ self.W_dec + self.b_dec
        if self.W_skip is not None:
            out = out + x @ self.W_skip.T
        return out


def load_transcoder_set(folder: str | Path) -> tuple[dict, list[SingleLayerTranscoder]]:
    """(config.yaml as a dict, the transcoders of layers 0..n-1) as circuit-tracer loads a local set."""
    folder = Path(folder)
    config = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
    assert config["model_kind"] == "transcoder_set", config
    topk = config.get("activation") == "topk"  # only circuit-tracer from its repository reads these two keys
    assert not topk or config["k"] is not None, config
    n = len(list(folder.glob("layer_*.safetensors")))
    transcoders = []
    for layer in range(n):
        with safe_open(str(folder / f"layer_{layer}.safetensors"), framework="pt") as f:
            params = {key: f.get_tensor(key) for key in f.keys()}
        d_transcoder, d_model = params["b_enc"].shape[0], params["b_dec"].shape[0]
        if topk:
            activation = TopK(config["k"])
        elif "activation_function.threshold" in params:
            activation = JumpReLU(torch.zeros_like(params["activation_function.threshold"]))
        else:
            activation = nn.ReLU()
        transcoder = SingleLayerTranscoder(d_model, d_transcoder, activation, params.get("W_skip") is not None)
        transcoder.load_state_dict(params, strict=True)
        transcoders.append(transcoder)
    assert len({t.d_transcoder for t in transcoders}) == 1, "all transcoders must have the same d_transcoder"
    return config, transcoders
