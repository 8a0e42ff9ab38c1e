"""analyses: how we look inside a hooked model (classification, ablation, patching, reports)."""

from analyses.causal_check import ablation_effects
from analyses.hook_check import check_hooks, require_edit
from analyses.classify import MEASURES, ROLES, assign_roles, classify_heads, head_table
from analyses.tl_compat import detect_heads
from analyses.report import build_report, write_report
from analyses.attention_map import attention_map
from analyses.ablation import ablate_heads, ablation_sweep, head_importance, pruning_curve
from analyses.attribution import attribution_agreement, attribution_patch_heads, shortlist_patch_heads
from analyses.metrics import logit_diff_metric, loss_metric
from analyses.patching import patch_heads, patch_patterns, patch_residual, patching_frame
from analyses.intervention_figures import ablation_figure, patching_figure
from analyses.study import run_study
