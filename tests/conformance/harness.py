"""The conformance harness: every architecture TransformerLens' bridge supports, built tiny and
random offline, run through tracekit's invariants against plain ``transformers``.

For one (architecture, variant):

1. ``category`` from :mod:`tracekit.model.architectures`. Categories tracekit does not read (encoders,
   encoder-decoders, multimodal wrappers, diffusion LMs, remote code) must be refused by
   :func:`tracekit.model.architectures.check_loadable` with the architecture named.
2. Otherwise the tiny config of ``specs.SPECS`` is built with ``transformers``, perturbed (every
   1-D parameter, norm weights and biases, moved by 0.3 x N(0, 1); every matrix scaled by 3, so
   attention is far from uniform and logits are O(1): identity norms, zero biases and flat
   attention cannot hide a bug), saved with ``save_pretrained`` and loaded with
   ``tracekit.load_model(dir)`` (weights processed, the default). A load refused with a
   :class:`tracekit.ModelLoadError` naming the architecture is a refusal; the unprocessed spec is
   then tried too (``process_weights: false``).
3. A loaded model goes through :func:`tracekit.verify.verify_model` against a fresh
   ``from_pretrained`` copy (eager attention), with a second load of the same weights under
   another spec (unprocessed, left padding).

Each check is ``pass`` (within its tolerance), ``refused`` (a TracekitError with a reason) or
``fail``; the suite requires no ``fail``. ``docs/gen_architectures.py`` turns the rows into
``docs/architectures.md`` and ``docs/reference/conformance.json``.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

import torch
from conformance.specs import SPECS  # noqa: I001 - tests/ is on the path (pyproject pythonpath)

ROOT = Path(__file__).resolve().parents[2]
GPT2_BPE = str(ROOT / "tracekit" / "data" / "gpt2-bpe")

#: The order checks are reported in (tracekit.verify's names).
CHECKS = ("forward", "lens_final", "lens_hidden_states", "dla_sum", "dla_heads", "neurons_sum",
          "patch_full_residual", "patch_vs_hf", "attention_patterns", "batching", "second_load")

_TMP = tempfile.TemporaryDirectory(prefix="tracekit-conformance-")
_ROWS: dict = {}


def supported() -> list[str]:
    """Every architecture name the installed bridge supports (read from TransformerLens)."""
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

    return sorted(SUPPORTED_ARCHITECTURES)


def cases() -> list[tuple[str, str | None]]:
    """``(architecture, variant)`` pairs: every supported architecture, plus the spec variants."""
    out = []
    for arch in supported():
        out.append((arch, None))
        out += [(arch, v) for v in SPECS.get(arch, {}).get("variants", {})]
    return out


def spec_of(arch: str, variant: str | None) -> dict:
    sp = dict(SPECS[arch])
    if variant:
        v = sp["variants"][variant]
        sp.update({k: v[k] for k in v})
    return sp


def build(arch: str, variant: str | None = None, seed: int = 0) -> str:
    """Save the perturbed tiny model of ``arch`` (cached per session); returns its directory."""
    import transformers

    d = Path(_TMP.name) / f"{arch}-{variant or 'base'}-{seed}"
    if (d / "config.json").exists():
        return str(d)
    sp = spec_of(arch, variant)
    cls = getattr(transformers, sp.get("hf_class", arch))
    cfg = cls.config_class(**sp["tiny"])
    cfg.architectures = [sp.get("arch_override", arch)]
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = cls(cfg).eval()
    g = torch.Generator().manual_seed(11 + seed)
    with torch.no_grad():
        seen = set()
        for _, p in hf.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.mul_(3.0)
    hf.save_pretrained(str(d))
    return str(d)


def reference(d: str, model):
    from transformers import AutoModelForCausalLM

    from tracekit.verify import HFReference

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    return HFReference(hf, model.adapter.component_mapping["blocks"].name)


def row(arch: str, variant: str | None = None) -> dict:
    """The conformance row of one case (cached): category, load outcome per spec, checks."""
    key = (arch, variant)
    if key in _ROWS:
        return _ROWS[key]
    from tracekit.errors import ModelLoadError
    from tracekit.model.architectures import category, check_loadable
    from tracekit.model.load import clear_cache, load_model
    from tracekit.model.spec import ModelSpec
    from tracekit.verify import verify_model

    t0 = time.perf_counter()
    cat = category(arch)
    r: dict = {"architecture": arch, "variant": variant, "category": cat, "features": [], "load": {},
               "checks": {}, "spec": None}
    try:
        check_loadable(arch)
    except ModelLoadError as e:
        r["load"]["refused"] = str(e)
        r["seconds"] = round(time.perf_counter() - t0, 2)
        _ROWS[key] = r
        return r
    if arch not in SPECS:
        r["load"]["missing_spec"] = f"no tiny spec for {arch}: add one to tests/conformance/specs.py"
        _ROWS[key] = r
        return r
    r["features"] = list(spec_of(arch, variant).get("features", []))
    d = build(arch, variant)
    model = None
    for pw in (True, False):
        spec = ModelSpec(name=d, tokenizer=GPT2_BPE, device="cpu", process_weights=pw)
        try:
            model = load_model(spec)
            r["load"]["processed" if pw else "unprocessed"] = "ok"
            r["spec"] = "processed" if pw else "unprocessed"
            break
        except ModelLoadError as e:
            r["load"]["processed" if pw else "unprocessed"] = str(e)
    if model is not None:
        other = ModelSpec(name=d, tokenizer=GPT2_BPE, device="cpu", process_weights=not model.tracekit_spec.process_weights,
                          padding_side="left")

        def second():
            return load_model(other)

        rep = verify_model(model, reference(d, model), second_load=second)
        r["checks"] = {c.name: {"status": c.status, "value": c.value, "tolerance": c.tolerance, "detail": c.detail}
                       for c in rep.checks}
    clear_cache()
    r["seconds"] = round(time.perf_counter() - t0, 2)
    _ROWS[key] = r
    return r


def all_rows() -> list[dict]:
    return [row(a, v) for a, v in cases()]
