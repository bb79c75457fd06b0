"""`expertize specialize`: do a sparse layer's units specialize to domains? Three measurements on held-out text.

    splits.py    document-level split by seeded hash: fit documents (train / assign / probe) vs eval documents
    passes.py    mean CE under an intervention; context-pooled sparse codes and dense MLP neurons
    masking.py   Monet's 2x assignment rule, ablation of a domain's units, random-live-units control, specificity
    probing.py   SAEBench-style sparse probing: signed-mean-difference selection, 1-D and k-sparse probes, F1
    steering.py  add λ to a domain's unit at every position: CE drop on its domain vs the others, random control
    report.py    `specialize(model, fit, held, ...)` -> SpecializationReport (summary row, JSON, text)
    folder.py    from a model folder and named corpora
"""

from .errors import SpecializationError
from .folder import specialize_folder, split_corpora
from .masking import MaskingRow, assign_units, domain_masking, random_live_units, specificity
from .passes import mean_ce, pooled_codes, pooled_dense
from .probing import ProbeResult, binary_f1, probe_domains, select_units
from .report import SpecializationReport, SpecializationSettings, specialize
from .splits import content_mask, in_eval, pack_documents, read_documents, split_documents
from .steering import SteeringRow, domain_units, steer_domains

__all__ = [
    "MaskingRow", "ProbeResult", "SpecializationError", "SpecializationReport", "SpecializationSettings",
    "SteeringRow", "assign_units", "binary_f1", "content_mask", "domain_masking", "domain_units", "in_eval",
    "mean_ce", "pack_documents", "pooled_codes", "pooled_dense", "probe_domains", "random_live_units",
    "read_documents", "select_units", "specialize", "specialize_folder", "specificity", "split_corpora",
    "split_documents", "steer_domains",
]
