"""transformers' common tests (copied from its 5.23.0 sdist) and expertize's stand-ins for the modules they import.

The copied test_modeling_common.py imports `transformers.testing_utils.preserve_module_forwards`, which transformers
5.25.0's wheel no longer defines (its own sdist's tests still import it): without it the module cannot be imported
and the whole common battery fails to collect. Where it is missing, the same context manager is installed here
before that import — the copied file stays unchanged. Its one use is a kernels test that needs an accelerator.
"""

from contextlib import contextmanager

import transformers.testing_utils as _testing_utils

if not hasattr(_testing_utils, "preserve_module_forwards"):

    @contextmanager
    def preserve_module_forwards(model):
        """Restore every submodule's instance-level `forward` (what `kernelize` sets in a module's __dict__) on exit,
        as transformers 5.23's helper of this name does; a module that had none gets none back."""
        missing = object()
        saved = {module: module.__dict__.get("forward", missing) for module in model.modules()}
        try:
            yield
        finally:
            for module, forward in saved.items():
                if forward is missing:
                    module.__dict__.pop("forward", None)
                else:
                    module.__dict__["forward"] = forward

    _testing_utils.preserve_module_forwards = preserve_module_forwards
