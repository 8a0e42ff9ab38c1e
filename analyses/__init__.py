"""analyses: how we look inside a hooked model (classification, ablation, patching, reports).

The entry points, by job (``help(analyses)`` lists them; docs/reference/analyses.md says what each
returns: a tidy frame, a tensor or a value). A head is ``(1, 4)``, ``"L1H4"`` or ``"1.4"`` wherever
one is taken (``as_head``, ``as_heads``), but for ``qk_attribution`` and ``qk_intervention_check``,
which take it as two numbers, ``layer, head``; outputs print it as ``"L1H4"`` (``head_label``).

- Prompts: ``probes_for`` (repeated-segment probes), ``corrupt_first_copy`` (their corruption),
  ``make_task``, ``load_task``, ``task_batch``, ``task_metric``; metrics ``loss_metric``,
  ``logit_diff_metric``.
- Head roles: ``report_roles`` (exactly ``interp report``'s roles, in one call), ``classify_heads``,
  ``calibrate_roles``, ``meaning_nulls``, ``joint_fdr``, ``assign_roles``, ``head_table``,
  ``detect_heads``.
- Ablation: ``ablate_heads``, ``ablation_sweep``, ``pruning_curve``, ``head_importance``,
  ``control_effects``, ``direct_and_total_effects``, ``backup_report``, ``backup_direct_effect_rise``.
- Patching: ``patch_heads``, ``patch_mlps``, ``patch_residual``, ``patch_patterns``,
  ``patch_effects``, ``attribution_patch_heads``, ``patching_frame``.
- Circuits: ``path_patch``, ``edge_attribution``, ``eap_ig``, ``composition_scores``,
  ``full_graph``, ``ioi_classes``.
- Components: ``direct_logit_attribution``, ``logit_lens``, ``decompose_residual``, ``ov_scores``,
  ``neuron_effects``, ``linear_probe``, ``qk_attribution``, ``explain``.
- Facts: ``causal_trace``, ``trace_facts``, ``top1_facts``.
- Pages and figures: ``build_report``, ``write_report``, ``compare_models``, ``ablation_figure``,
  ``patching_figure``, ``attention_map``; studies ``run_study``.
"""

from analyses.roles.causal_check import ablation_effects
from analyses.core.hook_check import check_hooks, require_edit
from analyses.roles.classify import MEASURES, ROLES, assign_roles, classify_heads, head_table
from analyses.roles.tl_compat import detect_heads
from analyses.report.build import build_report, report_roles, write_report
from analyses.report.attention_map import attention_map
from analyses.interventions.ablation import ablate_heads, ablation_sweep, head_importance, pruning_curve
from analyses.interventions.controls import ControlEffects, control_effects, control_figure, matched_random_sets
from analyses.interventions.attribution import (Screen, attribution_agreement, attribution_patch_heads,
                                                attribution_patch_mlps, screened_patches, shortlist_patch_heads)
from analyses.core.metrics import logit_diff_metric, loss_metric
from analyses.interventions.patching import (patch_components, patch_effects, patch_heads, patch_mlps, patch_patterns,
                                             patch_residual, patching_frame)
from analyses.report.intervention_figures import ablation_figure, patching_figure
from analyses.studies.runner import run_study
from analyses.interventions.attribution import unpatched_value
from analyses.roles.nulls import benjamini_hochberg, calibrate_roles, joint_fdr
from analyses.roles.backup import backup_direct_effect_rise, backup_report, direct_and_total_effects, pairwise_ablation
from analyses.roles.dormant import dormant_heads, head_similarities, output_norms
from analyses.roles.calibration import CalibrationOptions, calibration_frames
from analyses.report.calibration_figures import calibration_section
from analyses.circuits.composition import composition_figure, composition_scores
from analyses.circuits.path_patching import (eap_ig, edge_attribution, path_patch, screened_path_patch,
                                             shortlist_path_patch)
from analyses.circuits.edge_attribution import edge_agreement
from analyses.circuits.qk_check import QKCheck, qk_intervention_check, role_pairs
from analyses.circuits.ground_truth import compile_with_graph, ground_truth
from analyses.circuits.circuit_eval import evaluate_discovery, graph_edge_scores
from analyses.circuits.full_graph import (circuit_faithfulness, completeness, faithfulness_curve, full_graph,
                                          full_graph_figure, minimality)
from analyses.circuits.circuit import circuit_edges, circuit_figure, circuit_section
from analyses.components.rollout import attention_flow, attention_rollout, model_flow, model_rollout
from analyses.components.neurons import neuron_effects, promoted_tokens, promotion_effects
from analyses.components.explanation import decisive_attention, explain, explanation_figure
from analyses.report.compare import compare_models, scores_over_training, training_figure, write_comparison
from analyses.components.decompose import (accumulated_residual, attention_vs_mlp, attention_vs_mlp_figure, component_hooks,
                                 decompose_residual, direct_logit_attribution, dla_heatmap, logit_lens,
                                 logit_lens_figure, mlp_ablation)
from analyses.components.qk import QKAttribution, qk_attribution
from analyses.tasks.task import Task, load_task, make_task, task_batch, task_metric
from analyses.core.probes import corrupt_first_copy, probes_for
from analyses.core.heads import as_head, as_heads, head_label
from analyses.circuits.ioi_classes import IOIClasses, classify_ioi, ioi_classes, ioi_classes_figure, ioi_positions
from analyses.roles.copying import meaning_nulls
from analyses.components.meaning import (attended_token_effect, meaning_roles, ov_scores,
                              qk_positional_scores)
from analyses.tasks.tracing import FactTrace, Trace, causal_trace, facts_figure, trace_facts, trace_figure, trace_verdict
from analyses.tasks.facts import Fact, builtin_facts, load_facts, top1_facts
from analyses.components.probing import bracket_depth, bracket_prompts, linear_probe, repeat_offset, seen_before
