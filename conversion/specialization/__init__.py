"""`expertize specialize`: do a sparse layer's units specialize to domains? Three measurements on held-out text.

    splits.py      document-level split by seeded hash (or an explicit held-out file); packing with document ids
    suffix.py      cheap interventions: one full forward records the prefix of the sparse layer's block, conditions
                   replay only the blocks from there (bit for bit the full forward)
    conditions.py  ablation / steering conditions on one domain's eval text: per-document CE sums
    bootstrap.py   confidence intervals by bootstrap over eval documents; "n.s." against the random control
    passes.py      full-forward mean CE (the reference); context-pooled sparse codes and dense MLP neurons
    masking.py     Monet's 2x assignment rule, ablation of a domain's units, random-live-units control, specificity
    probing.py     SAEBench-style sparse probing: signed-mean-difference selection, 1-D and k-sparse probes, F1
    steering.py    add λ to a domain's unit at every position: CE drop on its domain vs the others, random control
    report.py      `specialize(model, fit, held, ...)` -> SpecializationReport (summary row, JSON, text)
    from_folder.py from a model folder and named corpora
"""

from .bootstrap import Estimate, document_weights, significant
from .conditions import Condition, DomainCE, condition_ce
from .errors import SpecializationError
from .from_folder import specialize_folder, split_corpora
from .masking import MaskingPlan, MaskingRow, assign_units, masking_rows, plan_masking, random_live_units, specificity
from .passes import CodePooler, mean_ce, pooled_codes, pooled_dense
from .probing import ProbeResult, binary_f1, probe_domains, select_units, weighted_f1
from .report import SpecializationReport, SpecializationSettings, specialize
from .splits import content_mask, in_eval, pack_documents, pack_with_documents, read_documents, split_documents
from .steering import SteeringPlan, SteeringRow, domain_units, plan_steering, steering_rows
from .suffix import PrefixBatch, SuffixRunner

__all__ = [
    "CodePooler", "Condition", "DomainCE", "Estimate", "MaskingPlan", "MaskingRow", "PrefixBatch", "ProbeResult",
    "SpecializationError", "SpecializationReport", "SpecializationSettings", "SteeringPlan", "SteeringRow",
    "SuffixRunner", "assign_units", "binary_f1", "condition_ce", "content_mask", "document_weights", "domain_units",
    "in_eval", "masking_rows", "mean_ce", "pack_documents", "pack_with_documents", "plan_masking", "plan_steering",
    "pooled_codes", "pooled_dense", "probe_domains", "random_live_units", "read_documents", "select_units",
    "significant", "specialize", "specialize_folder", "specificity", "split_corpora", "split_documents",
    "steering_rows", "weighted_f1",
]
