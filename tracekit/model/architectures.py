"""Which architectures tracekit reads, and what each method needs from a model's structure.

TransformerLens' bridge supports about 150 Hugging Face architectures
(``transformer_lens.factories.architecture_adapter_factory.SUPPORTED_ARCHITECTURES``): causal
decoders, hybrids with SSM / linear-attention layers, pure SSMs, and also encoders, encoder-
decoders, multimodal wrappers and diffusion LMs. tracekit's methods read a *causal* language model
(text in, next-token logits out, a residual stream of blocks). :data:`CATEGORIES` classifies every
architecture the bridge lists; :func:`check_loadable` refuses the categories tracekit does not read
before any weights are read, naming the architecture and why. The tests check that every name the
installed bridge supports is classified (``tests/unit/test_architectures.py``) and the conformance
suite (``tests/conformance``) runs every causal decoder, hybrid and SSM that ``transformers`` can
build offline through every method: each (family, method) cell is exact within its tolerance or
refused by :func:`require` / a method's own guard with a reason (docs/architectures.md).

:func:`require` is the one place a method asks "can I run on this model?": structural facts
(attention heads with a per-head output, dense MLP neurons, attention/MLP writes in every block)
are read from the loaded bridge, never from a list of families.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, cast

from ..core.errors import MethodRefused, ModelLoadError
from ..core.sites import head_count, hook, mlp_width  # noqa: F401 - head_count, mlp_width re-exported
from .state import state_of

if TYPE_CHECKING:  # only for the annotations: model.info imports the loader (a cycle at run time)
    from .info import HookedModel

__all__ = ["CATEGORIES", "READABLE", "ALIASES", "category", "architecture_name", "check_loadable", "require",
           "layer_structure", "MethodRefused", "head_count", "mlp_width"]


_ENCODER = ("ASTForAudioClassification", "BertForMaskedLM", "BertLMHeadModel", "DeiTForImageClassification",
            "DeiTModel", "HubertForCTC", "HubertModel", "ViTForImageClassification", "ViTModel",
            # adapted by TransformerLens 4.x only
            "RobertaForMaskedLM", "Wav2Vec2ForCTC", "Wav2Vec2ForPreTraining", "Wav2Vec2Model")
_ENCODER_DECODER = ("BartForConditionalGeneration", "BlenderbotForConditionalGeneration",
                    "LEDForConditionalGeneration", "LongT5ForConditionalGeneration", "M2M100ForConditionalGeneration",
                    "MBartForConditionalGeneration", "MT5ForConditionalGeneration", "MarianMTModel",
                    "PegasusForConditionalGeneration", "SwitchTransformersForConditionalGeneration",
                    "T5ForConditionalGeneration", "T5GemmaForConditionalGeneration", "T5Gemma2ForConditionalGeneration",
                    "T5WithLMHeadModel")
_MULTIMODAL = ("AudioFlamingo3ForConditionalGeneration", "Emu3ForConditionalGeneration",
               "Florence2ForConditionalGeneration", "Gemma3ForConditionalGeneration", "Gemma3nForConditionalGeneration",
               "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration", "Glm4vForConditionalGeneration",
               "GlmAsrForConditionalGeneration", "Idefics3ForConditionalGeneration", "Llama4ForConditionalGeneration",
               "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
               "LlavaOnevisionForConditionalGeneration", "Mistral3ForConditionalGeneration",
               "MusicFlamingoForConditionalGeneration", "Qwen2AudioForConditionalGeneration",
               "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
               "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
               "Qwen3_5MoeForConditionalGeneration",
               "MuseGlimmerForConditionalGeneration")  # TransformerLens 4.x only
_DIFFUSION = ("BD3LM", "DreamModel", "GiddForDiffusionLM", "LLaDA2MoeModelLM", "LLaDAModelLM")
_SSM = ("FalconMambaForCausalLM", "Mamba2ForCausalLM", "MambaForCausalLM", "RwkvForCausalLM")
_HYBRID = ("BambaForCausalLM", "FalconH1ForCausalLM", "GraniteMoeHybridForCausalLM", "JambaForCausalLM",
           "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "NemotronHForCausalLM", "OlmoHybridForCausalLM",
           "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "RecurrentGemmaForCausalLM",
           "Zamba2ForCausalLM")
#: Names the bridge lists whose code is not in ``transformers`` (remote code or TransformerLens'
#: own checkpoint formats): what they are.
_NOT_HF = {
    "BaiChuanForCausalLM": "remote code (Baichuan-1)", "BaichuanForCausalLM": "remote code (Baichuan/Baichuan2)",
    "ExaoneForCausalLM": "remote code (EXAONE 3.x)", "GPT2LMHeadCustomModel": "remote code (GPT-2 variants)",
    "InternLM2ForCausalLM": "remote code (InternLM2)", "OpenELMForCausalLM": "remote code (apple/OpenELM)",
    "OuroForCausalLM": "remote code (looped decoder)", "QwenForCausalLM": "remote code (Qwen-1)",
    "RavenForCausalLM": "remote code (recurrent-depth decoder)", "RWKV7ForCausalLM": "remote code (RWKV-7, fla)",
    "HyenaDNAForCausalLM": "remote code (HyenaDNA long convolutions)",
    "MinGPTForCausalLM": "TransformerLens' minGPT checkpoint format", "NanoGPTForCausalLM":
    "TransformerLens' nanoGPT checkpoint format", "NeelSoluOldForCausalLM": "TransformerLens' SoLU checkpoints",
    "TransformerLensNative": "a TransformerLens-native model", "TransformerLensPretrain": "a TransformerLens-native model",
}
#: Names the bridge lists that are spellings of a ``transformers`` class (loaded through it).
ALIASES = {"Gemma1ForCausalLM": "GemmaForCausalLM", "NeoForCausalLM": "GPTNeoForCausalLM",
           "NeoXForCausalLM": "GPTNeoXForCausalLM", "JetMoEForCausalLM": "JetMoeForCausalLM",
           "MPTForCausalLM": "MptForCausalLM", "PhiMoEForCausalLM": "PhimoeForCausalLM"}

#: Architectures whose rows influence each other in a padded batch (found by the conformance suite's
#: batching check): prompts of different lengths are refused in one batch, with the reason.
BATCH_SENSITIVE = {
    "GlmMoeDsaForCausalLM": "its sparse-attention indexer (DSA) selects different keys for a prompt when it shares "
                            "a padded batch with a prompt of another length",
}

#: Architectures whose attention depends on absolute positions in a way left padding shifts (found by
#: the conformance suite's batching check): their prompts are always padded on the right, which is
#: exact for every read position (later pads cannot reach earlier tokens).
RIGHT_PADDED = {
    "Llama4ForCausalLM": "chunked attention: chunk boundaries are absolute positions, which left padding moves",
}

#: Categories tracekit loads (the others are refused at load).
READABLE = ("causal_decoder", "hybrid_decoder", "ssm")

_WHY = {
    "encoder": "an encoder (no next-token prediction)",
    "encoder_decoder": "an encoder-decoder (tracekit reads decoder-only causal LMs)",
    "multimodal": "a multimodal wrapper (load its text decoder's *ForCausalLM checkpoint instead)",
    "diffusion": "a diffusion LM (no left-to-right next-token distribution)",
    "not_hf": "not a model class of the installed transformers",
}


def category(arch: str) -> str:
    """``causal_decoder`` | ``hybrid_decoder`` | ``ssm`` | ``encoder`` | ``encoder_decoder`` |
    ``multimodal`` | ``diffusion`` | ``not_hf`` for an architecture name (a config's
    ``architectures[0]``); unknown names are ``causal_decoder`` (loaded, and verified at load)."""
    for cat, names in (("encoder", _ENCODER), ("encoder_decoder", _ENCODER_DECODER), ("multimodal", _MULTIMODAL),
                       ("diffusion", _DIFFUSION), ("ssm", _SSM), ("hybrid_decoder", _HYBRID)):
        if arch in names:
            return cat
    if arch in _NOT_HF:
        return "not_hf"
    return "causal_decoder"


#: Every architecture name tracekit has classified (the tests compare it with the installed bridge).
CATEGORIES: dict[str, str] = {n: category(n) for n in
                              (*_ENCODER, *_ENCODER_DECODER, *_MULTIMODAL, *_DIFFUSION, *_SSM, *_HYBRID, *_NOT_HF)}


def architecture_name(model_or_config) -> str:
    """The Hugging Face architecture name of a model, bridge or config (``architectures[0]``, else
    the config class's model type)."""
    cfg = getattr(model_or_config, "config", None)
    orig = getattr(model_or_config, "original_model", None)
    if orig is not None:
        cfg = getattr(orig, "config", cfg)
    if cfg is None:
        cfg = model_or_config
    archs = getattr(cfg, "architectures", None) or []
    if archs:
        return str(archs[0])
    hf_cls = type(orig).__name__ if orig is not None else None
    return hf_cls or str(getattr(cfg, "model_type", None) or getattr(cfg, "model_name", "unknown"))


def check_loadable(arch: str, where: str = "model.name") -> None:
    """Refuse, before any weights are read, an architecture tracekit does not read.

    Raises:
        ModelLoadError: naming the architecture and why (encoder, encoder-decoder, multimodal
            wrapper, diffusion LM, remote code).
    """
    cat = category(arch)
    if cat in READABLE:
        return
    why = _WHY[cat]
    if cat == "not_hf":
        why = f"{_NOT_HF.get(arch, why)}; tracekit does not run remote code"
    raise ModelLoadError(f"{where}: architecture {arch} is {why}. tracekit reads causal language models "
                         "(docs/architectures.md lists every architecture and what runs on it).")


def layer_structure(model: HookedModel, layer: int) -> dict:
    """What block ``layer`` has: ``heads`` (a per-head output ``attn.hook_z`` and ``W_O``), ``attn``
    (an attention write ``hook_attn_out``), ``mlp`` (``hook_mlp_out``), ``neurons`` (a dense MLP
    with ``mlp.hook_post`` and ``W_out``), ``moe`` (a mixture-of-experts MLP)."""
    hd = model.hook_dict
    blk = cast(Any, model).blocks[layer] if hasattr(model, "blocks") else None  # a loaded bridge's module
    attn = getattr(blk, "attn", None) if blk is not None else None
    mlp = getattr(blk, "mlp", None) if blk is not None else None
    moe = mlp is not None and ("moe" in type(mlp).__name__.lower() or hasattr(mlp, "experts")
                               or hasattr(getattr(mlp, "original_component", None), "experts"))

    def has_weight(obj, name):
        try:
            w = getattr(obj, name)
        except Exception:  # noqa: BLE001 - bridges raise various errors for absent weights
            return False
        return hasattr(w, "shape")

    return {
        "attn": hook("attn_out", layer) in hd,
        "heads": hook("head_out", layer) in hd and attn is not None and has_weight(attn, "W_O"),
        "mlp": hook("mlp_out", layer) in hd,
        "moe": bool(moe),
        "neurons": (not moe) and hook("neuron", layer) in hd and mlp is not None and has_weight(mlp, "W_out"),
    }


def require(model: HookedModel, method: str, layers: Optional[Sequence[int]] = None, need: Sequence[str] = ()) -> None:
    """Refuse ``method`` on ``model`` when a structural need is missing in ``layers`` (default: all)
    or the model's verification refused it.

    Args:
        method: the method's name for the message (``direct logit attribution``, ...).
        need: any of ``attn``, ``mlp``, ``heads``, ``neurons`` (see :func:`layer_structure`).

    Raises:
        MethodRefused: naming the architecture, the layer and what is missing.
    """

    arch = architecture_name(model)
    refused = state_of(model).refusals.get(method)
    if refused:
        raise MethodRefused(f"{method} is refused on {arch}: {refused}")
    if not hasattr(model, "blocks"):
        return
    n = int(model.cfg.n_layers)
    what = {"attn": "attention output (hook_attn_out)", "mlp": "MLP output (hook_mlp_out)",
            "heads": "per-head attention outputs (attn.hook_z and W_O)",
            "neurons": "dense MLP neurons (mlp.hook_post and W_out)"}
    for L in (range(n) if layers is None else layers):
        s = layer_structure(model, int(L))
        for k in need:
            if not s[k]:
                extra = " (a mixture-of-experts MLP: its neurons are per expert)" if k == "neurons" and s["moe"] else ""
                raise MethodRefused(f"{method} is refused on {arch}: block {L} has no {what[k]}{extra}.")
