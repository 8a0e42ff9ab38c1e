"""The base every hooked module here shares: TransformerLens's ``HookedRootModule`` whose
``run_with_cache`` returns an ``ActivationCache`` (as ``TransformerBridge`` does) instead of a dict."""

from __future__ import annotations

from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.HookedRootModule import HookedRootModule


class HookedModule(HookedRootModule):
    def run_with_cache(self, *model_args, **kwargs):
        """Run forward with caching hooks; returns ``(output, ActivationCache)``.

        Takes TransformerLens's keywords (``names_filter``, ``remove_batch_dim``, ``pos_slice``...).
        """
        output, cache = super().run_with_cache(*model_args, **kwargs)
        return output, ActivationCache(cache, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))
