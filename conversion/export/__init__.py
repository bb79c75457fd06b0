"""`expertize export MODEL_DIR --to TARGET OUTPUT`: a folder's sparse layers in the layout of the tools researchers
analyse with (docs/export.md).

    expressible.py      what a sparse-coder format can hold (TopK coders, no choice-changing selection bias) and
                        the hookpoint of a layer in the base model: the one rule every target asks
    endpoints.py        the source folder (checked, its base model named) and the output, written whole or not at all
    sparsify.py         EleutherAI sparsify: <hookpoint>/cfg.json + sae.safetensors
    circuit_tracer.py   circuit-tracer: config.yaml + layer_{i}.safetensors at every layer (TopK without ReLU made
                        exact by K zero latents)
    saelens.py          SAELens: <input hook>/cfg.json + sae_weights.safetensors (JumpReLU / ReLU transcoders; a CLT as
                        its per-layer view, the later layers' decoders beside it)
    delphi.py           delphi's latent cache of every activation over named corpora (every kind)
    transformer_lens.py TransformerLens adapters for expertize folders (registered through its entry points; no
                        files are written: TransformerLens wraps the folder itself)
    coders.py           sparsify, circuit-tracer and SAELens exports of a folder (`export_coders`)
    command.py          the subcommand's flags and its run

Nothing is imported here: the CLI registers the subcommand without loading torch.
"""
