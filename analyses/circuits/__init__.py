"""How heads connect: composition scores, path patching, edge attribution (EAP, EAP-IG), circuits, Tracr ground truth and its evaluation, the role heads' QK attribution (role_qk)."""
