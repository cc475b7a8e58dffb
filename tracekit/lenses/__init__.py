"""Lenses beyond the logit lens: the tuned lens (Belrose et al. 2023), Patchscopes (Ghandeharioun et
al. 2024) and a per-layer quality table comparing every lens on held-out text.

Modules: :mod:`.tuned` (the tuned lens: translators, training on cached activations, the tuned-lens
package's on-disk layout), :mod:`.patchscope` (Patchscopes: a hidden state patched into a target
prompt) and :mod:`.quality` (KL to the final distribution, next-token cross-entropy and top-1
agreement per hidden state, for every lens).
"""
