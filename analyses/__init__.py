"""analyses: how we look inside a hooked model (classification, ablation, patching, reports)."""

from analyses.causal_check import ablation_effects
from analyses.classify import MEASURES, ROLES, assign_roles, classify_heads, head_table
from analyses.tl_compat import detect_heads
from analyses.report import build_report, write_report
from analyses.attention_map import attention_map
