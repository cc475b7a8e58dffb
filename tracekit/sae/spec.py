"""Which SAE, and what it is without its weights: the ``sae:`` config block (:class:`SAESpec`,
:class:`SAETrainSpec`), an SAE's identity (:class:`SAEInfo`, :func:`sae_info`), SAELens release
lookup, and the checks of an SAE against a model before any forward pass (:func:`check_sae`).

Only the release form (``sae.release`` + ``id``: SAELens' pretrained registry) needs SAELens; a
SAELens directory (``sae.path``) is read here without it (:func:`saelens_cfg_defaults` accepts the
older field names as SAELens' ``handle_config_defaulting`` does), so its identity and checks work in
the TransformerLens 4 environment too."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from ..compat import SAE_RELEASE_FIX, official_model_name, require_sae_lens
from ..core.errors import HookError, SAEError
from ..core.sites import hook as site_hook
from ..core.strict import StrictModel
from ..hooks import check_hooks
from ..model.context import check_window
from ..model.info import HookedModel
from ..model.load import model_fingerprint, model_spec_of
from ..model.source import hub_reachable
from ..model.spec import EMBEDDED_ALIASES, EMBEDDED_HUB_NAME

__all__ = ["SAEInfo", "SAESpec", "SAETrainSpec", "check_sae", "hook_width", "require_release_support", "sae_info",
           "saelens_cfg_defaults"]


class _Strict(StrictModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# =============================================================================================
# specs


class SAETrainSpec(_Strict):
    """Train an SAE with SAELens' ``LanguageModelSAETrainingRunner`` on tracekit's model.

    Fields:
        hook: TransformerLens hook the SAE reads and reconstructs (``blocks.24.hook_resid_pre``).
        architecture: ``topk`` (Gao et al. 2024; default) or ``standard`` (ReLU + L1).
        d_sae: number of features (default ``expansion_factor x d_in``).
        expansion_factor: used when ``d_sae`` is not given.
        k: active features per token (``topk``).
        l1_coefficient: L1 sparsity penalty coefficient of the ``standard`` architecture (default
            5.0; ignored by ``topk``).
        training_tokens: activations the SAE is trained on (SAELens' ``training_tokens``; more than
            ``dataset_tokens`` means several passes over them).
        dataset_tokens: distinct corpus tokens trained on: the first ``dataset_tokens`` of the
            corpus, packed into windows (default: ``training_tokens``).
        eval_tokens: held-out tokens (the corpus tokens right after the dataset tokens), kept for
            evaluation (``sae_eval`` reads them by default). The stdlib corpus holds ~130k tokens.
        context_size: tokens per training window (BOS included when the model prepends one).
        train_batch_size_tokens / lr: SAELens' optimiser settings.
        dead_feature_window: training steps without firing after which SAELens counts a feature
            as dead (the TopK auxiliary loss then trains dead features on the residual error,
            Gao et al. 2024); keep it well below the number of steps or the auxiliary loss never acts.
        corpus: ``stdlib`` (offline default), a text/JSONL file or a directory.
        seed: seeds torch for the SAE's initialisation and SAELens' buffer shuffles (SAELens' runner
            does not seed torch itself); the caller's RNG state is restored after training.
        store: an activation store to train from instead of running the model
            (:mod:`tracekit.sae.store`): written with this model from packed windows of the same
            ``corpus`` (``kind: activations``, ``corpus: {source: <corpus>, packed: true, seq_len:
            <context_size>, max_tokens: >= dataset_tokens}``, ``hooks: [<hook>]``). The SAE trained
            from it equals the one trained by running the model (tested); held-out tokens still come
            from the corpus. The store's manifest, not its path, is part of the cache key.

    The trained SAE is saved in SAELens' format under ``$TRACEKIT_CACHE_DIR/saes/<hash>`` (default
    ``~/.cache/tracekit/saes``), keyed by this block, the model's fingerprint and basis, so the
    first run trains and later runs load.
    """

    hook: str
    architecture: Literal["topk", "standard"] = "topk"
    d_sae: int | None = Field(default=None, ge=1)
    expansion_factor: int = Field(default=8, ge=1)
    k: int = Field(default=32, ge=1)
    l1_coefficient: float = Field(default=5.0, ge=0)
    training_tokens: int = Field(default=40_960, ge=64)
    dataset_tokens: int | None = Field(default=None, ge=64)
    eval_tokens: int = Field(default=4096, ge=64)
    context_size: int = Field(default=64, ge=4)
    train_batch_size_tokens: int = Field(default=1024, ge=8)
    lr: float = Field(default=4e-4, gt=0)
    dead_feature_window: int = Field(default=1000, ge=1)
    corpus: str | list[str] = "stdlib"
    seed: int = 0
    store: str | None = None

    @model_validator(mode="after")
    def _means_what_it_says(self):
        # values SAELens would quietly change (k clipped to d_sae; fewer tokens than one batch = one
        # step) are refused, naming the field and the fix
        if self.architecture == "topk" and self.d_sae is not None and self.k > self.d_sae:
            raise ValueError(f"k: {self.k} active features per token is more than d_sae ({self.d_sae}) features; "
                             "lower k or raise d_sae")
        if self.training_tokens < self.train_batch_size_tokens:
            raise ValueError(f"training_tokens: {self.training_tokens} is less than one batch "
                             f"(train_batch_size_tokens {self.train_batch_size_tokens}): not one full optimiser step; "
                             "raise training_tokens (to many batches) or lower train_batch_size_tokens")
        return self

    def check_width(self, d_in: int | None, field: str = "sae.train") -> None:
        """Refuse a TopK ``k`` above the SAE's width once the hook's width ``d_in`` is known (``d_sae``
        defaults to ``expansion_factor x d_in``)."""
        d_sae = self.d_sae or (d_in or 0) * self.expansion_factor
        if self.architecture == "topk" and d_sae and self.k > d_sae:
            raise SAEError(f"{field}.k: {self.k} active features per token is more than the SAE's {d_sae} features "
                           f"(expansion_factor {self.expansion_factor} x width {d_in}); lower k or raise d_sae")


class SAESpec(_Strict):
    """Which SAE (config key ``sae:``): exactly one of

    * ``release`` + ``id``: a SAELens pretrained SAE (``gpt2-small-res-jb`` /
      ``blocks.8.hook_resid_pre``), from the local Hugging Face cache or the hub (needs SAELens: the
      default environment; refused in the TransformerLens 4 one, naming ``sae.path`` instead);
    * ``path``: a directory in SAELens' format (``cfg.json`` + ``sae_weights.safetensors``),
      older SAELens field names accepted (``hook_point`` ...); read without SAELens (both environments);
    * ``train``: an :class:`SAETrainSpec` (trained once, then loaded from the cache).

    The SAE is always put on the model's device and dtype, whatever its ``cfg.json`` says.

    Fields:
        release: a SAELens pretrained release name (``gpt2-small-res-jb``); needs ``id``.
        id: the SAE's id within ``release`` (``blocks.8.hook_resid_pre``); needs ``release``.
        path: a local directory in SAELens' format (``cfg.json`` + ``sae_weights.safetensors``).
        train: an :class:`SAETrainSpec`: train the SAE on this model once, then load it from the cache.
    """

    release: str | None = None
    id: str | None = None
    path: str | None = None
    train: SAETrainSpec | None = None

    retired = {"sae_id": "id; sae: {release: ..., id: ...}"}

    @model_validator(mode="before")
    @classmethod
    def _no_hook(cls, v):
        if isinstance(v, dict) and ("hook_point" in v or "hook_name" in v):
            raise ValueError("the hook of an SAE comes from its cfg.json (path/release) or train.hook")
        return v

    @model_validator(mode="after")
    def _one_source(self):
        given = [n for n in ("release", "path", "train") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one SAE source: release + id (SAELens pretrained), path (a SAELens "
                             f"directory) or train (train one here); got {given or 'none'}")
        if (self.release is None) != (self.id is None):
            raise ValueError("release and id go together (sae: {release: gpt2-small-res-jb, id: blocks.8.hook_resid_pre})")
        return self

    @model_validator(mode="after")
    def _sae_lens_available(self):
        # only the release form needs SAELens (the tracekit[sae] extra; it pins transformer-lens<4): refuse it at
        # config time, metadata only; a path or a training needs no SAELens
        if self.release is not None:
            require_release_support("release", import_check=False)
        return self

    def describe(self) -> str:
        if self.release is not None:
            return f"{self.release}/{self.id}"
        if self.path is not None:
            return str(self.path)
        assert self.train is not None
        return f"trained:{self.train.hook}"


# =============================================================================================
# what an SAE is, without its weights; checks


@dataclass
class SAEInfo:
    """An SAE's identity, enough to check it against a model before any forward pass.

    Attributes:
        hook: hook name it reads. d_in / d_sae: widths. model_name: the model it was trained on.
        fingerprint: :func:`tracekit.model.model_fingerprint` of that model when tracekit trained it.
        processed: whether its activations come from a weight-processed model (TransformerLens
            ``center_writing_weights``); None when unknown.
        prepend_bos / context_size: its training tokenization. normalize: its input normalisation.
        head_index: ``hook_head_index`` (unsupported when set).
    """

    hook: str | None
    d_in: int | None = None
    d_sae: int | None = None
    model_name: str | None = None
    fingerprint: str | None = None
    processed: bool | None = None
    prepend_bos: bool | None = None
    context_size: int | None = None
    normalize: str = "none"
    head_index: int | None = None
    source: str = ""


def require_release_support(field: str = "sae.release", import_check: bool = True) -> None:
    """Refuse a SAELens pretrained release (``sae.release`` + ``id``) where SAELens cannot be used,
    naming the field and the alternative (``sae.path``: a downloaded SAELens directory).

    Args:
        field: the YAML field named in the message.
        import_check: also try ``import sae_lens`` (``False`` at config validation).

    Raises:
        SAEError: SAELens is missing or does not import here (:func:`tracekit.compat.require_sae_lens`).
    """
    require_sae_lens(field, import_check, needs="a SAELens pretrained release (sae.release + id: SAELens' registry)",
                     fix=SAE_RELEASE_FIX)


_RENAMED_PRE_6 = {"hook_point": "hook_name", "hook_point_head_index": "hook_head_index",
                  "activation_fn_str": "activation_fn"}


def _before_6(version: Any) -> bool:
    """Whether a ``sae_lens_version`` string is missing or older than 6.0 (SAELens' test)."""
    from packaging.version import InvalidVersion, Version  # lazy: only SAE directories need it

    if not version:
        return True
    try:
        return Version(str(version)) < Version("6.0.0-rc.0")
    except InvalidVersion:
        return True


def saelens_cfg_defaults(cfg: dict) -> dict:
    """A SAELens ``cfg.json`` with the older (pre-6.0) field names and defaults brought forward, as
    SAELens' ``handle_config_defaulting`` does (``sae_lens/loading/pretrained_sae_loaders.py``), for
    the fields tracekit reads: ``hook_point`` -> ``hook_name``, ``hook_point_head_index`` ->
    ``hook_head_index``, ``prepend_bos`` default True, ``apply_b_dec_to_input`` default True, the
    boolean ``normalize_activations`` -> ``"none"`` / ``"expected_average_only_in"``, None -> ``"none"``,
    ``architecture`` (default ``standard``; ``topk`` for an ``activation_fn`` topk with ``k``).
    A 6.x config (``sae_lens_version`` >= 6, top level or in ``metadata``) is returned as is.

    Args:
        cfg: the parsed ``cfg.json``.

    Returns:
        A new dict (the input is not changed). Raises nothing.
    """
    d = dict(cfg)
    meta = d.get("metadata")
    version = d.get("sae_lens_version") or (meta.get("sae_lens_version") if isinstance(meta, dict) else None)
    if not _before_6(version):
        return d
    d = {_RENAMED_PRE_6.get(k, k): v for k, v in d.items()}
    d.setdefault("prepend_bos", True)
    d.setdefault("apply_b_dec_to_input", True)
    d.setdefault("activation_fn", "relu")
    d.setdefault("architecture", "standard")
    if d.get("activation_fn") == "topk" and (d.get("activation_fn_kwargs") or {}).get("k") is not None:
        d["architecture"] = "topk"
        d["k"] = d["activation_fn_kwargs"]["k"]
    if isinstance(d.get("normalize_activations"), bool):
        d["normalize_activations"] = "expected_average_only_in" if d["normalize_activations"] else "none"
    if d.get("normalize_activations") is None:
        d["normalize_activations"] = "none"
    return d


def _cfg_info(cfg_dict: dict, source: str) -> SAEInfo:
    """SAEInfo from a SAELens cfg dict (new layout with ``metadata``, or pre-6.0 flat); no SAELens."""
    d = saelens_cfg_defaults(cfg_dict)
    meta = dict(d.get("metadata") or {})
    get = lambda k: meta.get(k, d.get(k))
    kwargs = get("model_from_pretrained_kwargs") or {}
    processed = get("tracekit_process_weights")
    if processed is None:
        processed = bool(kwargs.get("center_writing_weights", True))
    return SAEInfo(hook=get("hook_name"), d_in=d.get("d_in"), d_sae=d.get("d_sae"), model_name=get("model_name"),
                   fingerprint=get("tracekit_fingerprint"), processed=processed, prepend_bos=get("prepend_bos"),
                   context_size=get("context_size"), normalize=str(d.get("normalize_activations") or "none"),
                   head_index=get("hook_head_index"), source=source)


def _release_info(spec: SAESpec, field: str) -> tuple[Any, str, str]:
    require_release_support(f"{field}.release")
    from sae_lens.loading.pretrained_saes_directory import get_pretrained_saes_directory  # lazy: sae_lens is heavy

    directory = get_pretrained_saes_directory()
    if spec.release not in directory:
        close = difflib.get_close_matches(str(spec.release), list(directory), n=3, cutoff=0.5)
        raise SAEError(f"{field}.release: {spec.release!r} is not a SAELens pretrained release"
                       + (f"; did you mean {close}?" if close else "") + " (see sae_lens/pretrained_saes.yaml)")
    rel = directory[spec.release]
    if spec.id not in rel.saes_map:
        ids = list(rel.saes_map)
        raise SAEError(f"{field}.id: {spec.id!r} is not in release {spec.release!r}; ids: {ids[:8]}"
                       + (" ..." if len(ids) > 8 else ""))
    return rel, rel.repo_id, rel.saes_map[spec.id]


def _release_available(spec: SAESpec, field: str) -> None:
    """Refuse (at once, no network wait) a pretrained SAE that is neither cached nor downloadable."""
    from huggingface_hub import try_to_load_from_cache  # lazy: huggingface_hub is heavy

    _, repo, folder = _release_info(spec, field)
    cached = False
    for name in (f"{folder}/cfg.json", f"{folder}/sae_weights.safetensors"):
        try:
            cached = isinstance(try_to_load_from_cache(repo, name), str)
        except Exception:  # noqa: BLE001
            cached = False
        if not cached:
            break
    if not cached and not hub_reachable():
        raise SAEError(f"{field}: the SAELens SAE {spec.release}/{spec.id} (hub repo {repo}, folder {folder}) is not "
                       "in the local Hugging Face cache and the hub cannot be reached (offline, or HF_HUB_OFFLINE=1). "
                       "Download it on a machine with network, give sae.path (a SAELens directory), or train one "
                       "here with sae.train.")


def hook_width(model: HookedModel, hook: str) -> int | None:
    """The width an SAE on ``hook`` reads (``d_model`` for the residual / attention / MLP outputs,
    ``d_mlp`` for ``mlp.hook_pre/post``, ``n_heads x d_head`` for ``attn.hook_z/q``); None when unknown."""
    cfg = model.cfg
    d_model = int(cfg.d_model)
    if hook.endswith(("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out",
                      site_hook("embed"), site_hook("pos_embed"), "ln_final.hook_normalized")):
        return d_model
    if hook.endswith(("mlp.hook_post", "mlp.hook_pre")):
        return int(getattr(cfg, "d_mlp", 0) or 0) or None
    if hook.endswith(("attn.hook_z", "attn.hook_q")):
        return int(cfg.n_heads) * int(cfg.d_head)
    if hook.endswith(("attn.hook_k", "attn.hook_v")):
        n_kv = getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
        return int(n_kv) * int(cfg.d_head)
    return None


def _same_model(a: str | None, b: str) -> bool:
    """Whether SAELens' model name ``a`` names the model ``b`` (TransformerLens aliases resolved)."""
    if not a:
        return True

    def norm(s: str) -> str:
        try:
            s = official_model_name(s)
        except Exception:  # noqa: BLE001, S110
            pass
        return s.lower().split("/")[-1]

    return norm(a) == norm(b)


def _model_names(model: HookedModel) -> list[str]:
    spec = model_spec_of(model)
    names = [spec.name, str(getattr(model.cfg, "model_name", ""))]
    if spec.name.lower() in EMBEDDED_ALIASES:
        names.append(EMBEDDED_HUB_NAME)
    return [n for n in names if n]


def check_sae(model: HookedModel, info: SAEInfo, field: str = "sae") -> None:
    """Check an SAE against a model before any forward pass.

    Checks, each its own :class:`SAEError`: the SAE names a hook; the hook exists on the model
    and fires (gated hooks are enabled by the SAE runs; ``hook_pos_embed`` under rotary positions
    never fires); the SAE's width ``d_in`` equals the hook's width; the SAE was trained on this
    model (its SAELens ``model_name``, or the weights fingerprint tracekit recorded when it trained
    it); the activation basis matches (an SAE trained on unprocessed activations is refused on a
    weight-processed model and vice versa: TransformerLens' ``center_writing_weights`` changes the
    residual stream); the input normalisation is one tracekit applies exactly; no head index.

    Works on a :class:`tracekit.model.ModelInfo` (no weights: the fingerprint is checked once
    the model is loaded).
    """
    if not info.hook:
        raise SAEError(f"{field}: the SAE's config names no hook (cfg.json metadata.hook_name, or hook_point in "
                       "older SAELens files); add it to cfg.json")
    try:
        check_hooks(model, [info.hook], f"{field} hook_name")
    except HookError as e:
        raise SAEError(f"{field}: the SAE reads hook {info.hook!r}, which this model does not have: {e}") from e
    if info.hook.endswith(site_hook("pos_embed")) and getattr(model.cfg, "positional_embedding_type", "") == "rotary":
        raise SAEError(f"{field}: hook {info.hook!r} never fires on this model (rotary positions)")
    if info.head_index is not None:
        raise SAEError(f"{field}: SAEs on one head (hook_head_index={info.head_index}) are not supported; "
                       "use an SAE on the whole hook")
    width = hook_width(model, info.hook)
    if info.d_in is not None and width is not None and int(info.d_in) != width:
        raise SAEError(f"{field}: the SAE's width d_in={info.d_in} does not match hook {info.hook!r} of this model "
                       f"(width {width}); it was trained on another model or hook")
    if info.normalize not in ("none", "layer_norm", "constant_norm_rescale"):
        raise SAEError(f"{field}: the SAE's input normalisation {info.normalize!r} is not applied by tracekit "
                       "(supported: none, layer_norm, constant_norm_rescale; SAELens folds "
                       "expected_average_only_in when loading a release that records its scaling factor)")
    spec = model_spec_of(model)
    processed = bool(spec.process_weights)
    if info.fingerprint is None and not any(_same_model(info.model_name, n) for n in _model_names(model)):
        raise SAEError(f"{field}: the SAE was trained on model {info.model_name!r}, not on this model "
                       f"({spec.name!r}); use an SAE trained on it (or sae.train)")
    if info.processed is not None and info.processed != processed:
        want = "true" if info.processed else "false"
        raise SAEError(f"{field}: the SAE was trained on {'processed' if info.processed else 'unprocessed'} "
                       f"activations (TransformerLens center_writing_weights {info.processed}) but this model is "
                       f"loaded with process_weights {processed}: its residual stream is in another basis, so the "
                       f"SAE would read the wrong vectors. Load the model with model.process_weights: {want}")
    if info.fingerprint is not None and hasattr(model, "parameters") and hasattr(model, "W_U"):
        fp = model_fingerprint(model)
        if fp != info.fingerprint:
            raise SAEError(f"{field}: the SAE was trained by tracekit on another model (weights fingerprint "
                           f"{info.fingerprint}, this model {fp}, {info.model_name!r}); train it on this model "
                           "(sae.train) or load the model it was trained on")


def sae_info(spec: SAESpec, model: HookedModel, field: str = "sae") -> SAEInfo:
    """The identity of the SAE a spec names, without loading weights or training.

    Raises:
        SAEError: a release where SAELens is not available (:func:`require_release_support`; a path
            or a training needs no SAELens); a path without ``cfg.json``, an unknown release/id, a
            pretrained SAE that is neither cached nor downloadable.
        ConfigError: an SAE to train whose ``train.context_size`` is longer than the model's context.
    """
    if spec.train is not None:
        check_window(model, spec.train.context_size, f"{field}.train.context_size")
    if spec.path is not None:
        p = Path(spec.path).expanduser()
        if not (p / "cfg.json").is_file():
            raise SAEError(f"{field}.path: {spec.path!r} is not a SAELens SAE directory (cfg.json + "
                           "sae_weights.safetensors)")
        try:
            cfg = json.loads((p / "cfg.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SAEError(f"{field}.path: cannot read {p / 'cfg.json'}: {e}") from e
        if not isinstance(cfg, dict):
            raise SAEError(f"{field}.path: {p / 'cfg.json'} is not a JSON object")
        return _cfg_info(cfg, str(p))
    if spec.release is not None:
        rel, _, _ = _release_info(spec, field)
        _release_available(spec, field)
        overrides = dict(rel.config_overrides or {})
        kwargs = overrides.get("model_from_pretrained_kwargs") or {}
        hook = spec.id if str(spec.id).startswith(("blocks.", "hook_")) else None
        return SAEInfo(hook=hook or "", model_name=rel.model, processed=bool(kwargs.get("center_writing_weights", True)),
                       source=spec.describe())
    t = spec.train
    assert t is not None
    width = hook_width(model, t.hook)
    t.check_width(width, f"{field}.train")
    return SAEInfo(hook=t.hook, d_in=width, d_sae=t.d_sae or (width or 0) * t.expansion_factor,
                   model_name=model_spec_of(model).name, processed=bool(model_spec_of(model).process_weights),
                   prepend_bos=bool(model_spec_of(model).prepend_bos), context_size=t.context_size,
                   source=spec.describe())

