"""What a reader sees: the head-role report (tables, figures, the page and its assets), calibration and intervention figures, the attention map, model comparison, meta.json."""
