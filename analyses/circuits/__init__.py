"""How heads connect: composition scores, path patching, edge attribution (EAP, EAP-IG), circuits, Tracr ground truth and its evaluation."""
