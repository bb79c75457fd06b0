"""Stand-in (written for expertize, not transformers' file) for `tests/exporters/test_export.py`, which the
transformers sdist does not ship and `test_modeling_common.ModelTesterMixin` inherits from.

One test: `torch.export` of every model class gives a program whose outputs equal the eager model's — the contract
inference stacks (ExecuTorch, AOTInductor) rely on, and one that data-dependent host synchronizations break.
"""

import torch


def _first_tensor(output):
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    return output[0]


class ExportTesterMixin:
    test_torch_exportable = True

    def test_torch_export(self):
        if not self.test_torch_exportable:
            self.skipTest("this model class is not torch.export-able (test_torch_exportable = False)")
        for model_class in self.all_model_classes:
            config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
            model = model_class(config).eval()
            inputs = {key: value for key, value in inputs.items() if key != "labels"}
            with torch.no_grad():
                eager = _first_tensor(model(**inputs, use_cache=False))
                program = torch.export.export(model, args=(), kwargs={**inputs, "use_cache": False}, strict=False)
                exported = _first_tensor(program.module()(**inputs, use_cache=False))
            torch.testing.assert_close(exported, eager, rtol=1e-5, atol=1e-5, msg=f"{model_class.__name__}")
