"""Invariants of the circuit-discovery engines (:mod:`tracekit.circuits`), each checked against an
exact computation:

* on a model made *linear* (identity MLP activation, LayerNorms made linear, input-independent
  attention) attribution patching equals activation patching at every site, and EAP edge scores
  equal exact path patching of single edges;
* on the perturbed GPT-2 / Llama (GQA): EAP scores out of a node add up to that node's AtP; EAP-IG's
  completeness error shrinks with the number of steps; EAP-IG is the ``eap`` package's loop
  (transcribed here) at each interpolation rule; path patching into every receiver of a sender
  is activation patching of the sender, and into one MLP it is a hand-written hook;
* on a one-layer model whose only nonlinearity is the softmax, AtP*'s QK fix is exact;
* nothing is left on the model (gradients, hooks, flags, grad mode), also when a metric raises;
* models whose writes are not separable (post-norms) are refused.

Tolerances are absolute (float32); every test also checks that the compared effects are not tiny,
so a wrong engine cannot pass by returning zeros.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from helpers import GPT2_BPE, make_perturbed, perturb_params, tiny_overrides
from tracekit import metrics as TM
from tracekit.circuits.attribution import attribution_patch
from tracekit.circuits.edges import edge_attribution
from tracekit.circuits.graph import build_graph, head_writes
from tracekit.circuits.paths import path_patch
from tracekit.errors import CircuitError, MethodRefused
from tracekit.hooks import GATES
from tracekit.patching import run_patching

#: LayerNorm epsilon of the linear models: ``var + EPS`` rounds to ``EPS`` in float32 (the residual's
#: variance is far below ``EPS``'s float32 spacing, 65536), so ``LN(x) = (x - mean(x)) / sqrt(EPS) * w + b``
#: is affine; the norm weights are multiplied by ``sqrt(EPS)`` to keep the scale.
EPS = 1e12

LINEAR_SITES = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "head_out", "head_out_by_pos",
                "head_v_by_pos", "neuron_by_pos", "resid_pre_layer"]


def make_linear(n_layers: int = 3, qk_scale: float = 0.0, ln_gain: float = 1.0, ln_f_gain: float = 1.0):
    """A tiny GPT-2-architecture bridge that is affine in its embeddings, except for the softmax.

    Built like ``helpers.make_perturbed``, then: the MLP activation is the identity
    (``activation_function="linear"``), every LayerNorm is made affine by a huge epsilon (the bridge
    refuses ``torch.nn.Identity`` norms: its NormalizationBridge reads the wrapped module's
    ``weight``; see :data:`EPS`), and the query and key parts of ``c_attn`` (columns
    ``[0, 2 * d_model)`` of the Conv1D weight, and their biases) are multiplied by ``qk_scale``:
    0 makes every attention pattern uniform causal, so the whole model is affine; otherwise the
    softmax is the only nonlinearity. ``process_weights=False``: nothing is folded.
    """
    from transformers import AutoModelForCausalLM

    from tracekit.model.load import wrap_hf_model
    from tracekit.model.source import _load_tokenizer, _random_config
    from tracekit.model.spec import ModelSpec

    spec = ModelSpec(name="gpt2", random_init=True, tokenizer=GPT2_BPE,
                     config_overrides=tiny_overrides("gpt2", n_layers), process_weights=False, device="cpu", seed=7)
    tok = _load_tokenizer(GPT2_BPE)
    torch.manual_seed(7)
    cfg = _random_config(spec)
    cfg.activation_function = "linear"
    cfg.layer_norm_epsilon = EPS
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if hf.config.vocab_size < len(tok):
        hf.resize_token_embeddings(len(tok), mean_resizing=False)
    d = cfg.n_embd
    perturb_params(hf, lambda name: EPS ** 0.5 * (ln_f_gain if "ln_f" in name else ln_gain))
    with torch.no_grad():
        for block in hf.transformer.h:
            block.attn.c_attn.weight[:, : 2 * d] *= qk_scale
            block.attn.c_attn.bias[: 2 * d] *= qk_scale
    return wrap_hf_model(hf, tok, spec, bridge_name="gpt2")


def _pairs(n_rows: int = 3, n_pos: int = 7, changed=(2,)):
    """Random clean prompts and corrupted copies differing at one position per row (``changed[i %
    len(changed)]``), with per-row target/foil ids."""
    torch.manual_seed(0)
    clean = torch.randint(100, 5000, (n_rows, n_pos)).tolist()
    corr = [c[:] for c in clean]
    for i, c in enumerate(corr):
        c[changed[i % len(changed)]] += 17
    tgt = [11 + i for i in range(n_rows)]
    foil = [21 + i for i in range(n_rows)]
    return clean, corr, tgt, foil


def _base(run, mode: str) -> torch.Tensor:
    """``[rows]`` the unpatched run's logit difference of ``mode`` (denoising: the corrupted run)."""
    return (run.corrupted if mode == "denoising" else run.clean)[:, 0]


@pytest.fixture(scope="module")
def linear3():
    return make_linear(3, qk_scale=0.0, ln_gain=2.0, ln_f_gain=20.0)


@pytest.fixture(scope="module")
def linear1_qk():
    return make_linear(1, qk_scale=3.0, ln_gain=3.0, ln_f_gain=20.0)


# -- 1. a linear model: AtP == activation patching, EAP == path patching of one edge --------------------


def test_atp_equals_activation_patching_on_a_linear_model(linear3):
    clean, corr, tgt, foil = _pairs()
    T, F = [[t] for t in tgt], [[f] for f in foil]
    modes = ["denoising", "noising"]
    kw = {"neuron_layers": [1], "neurons": list(range(0, 256, 16))}  # every 16th neuron: exact patching's cost
    ex = run_patching(linear3, clean, corr, LINEAR_SITES, modes, ["logit_diff"], T, F, **kw)
    ap = attribution_patch(linear3, clean, corr, LINEAR_SITES, modes, ["logit_diff"], T, F, **kw)
    assert torch.allclose(ex.clean, ap.clean, atol=1e-5) and torch.allclose(ex.corrupted, ap.corrupted, atol=1e-5)
    assert len(ex.jobs) == len(ap.jobs) == len(LINEAR_SITES) * 2
    for je, ja in zip(ex.jobs, ap.jobs):
        assert (je.mode, je.site.name) == (ja.mode, ja.site.name) and je.index.equals(ja.index)
        err = (je.values[:, 0] - ja.values[:, 0]).abs().max().item()
        assert err < 1e-4, (je.mode, je.site.name, err)
        effect = (je.values[:, 0].reshape(len(je.index), -1) - _base(ex, je.mode)[None]).abs().max().item()
        assert effect > 0.02, (je.mode, je.site.name, effect)  # the effects compared are not tiny


EDGES = ["input->logits", "a0.h1->a2.h3<v>", "m0->m2", "a1.h0->logits", "a0.h2->m1", "input->a1.h2<v>"]


@pytest.mark.parametrize("mode", ["denoising", "noising"])
def test_eap_equals_path_patching_of_single_edges_on_a_linear_model(linear3, mode):
    clean, corr, tgt, foil = _pairs(changed=(2, 6, 4))  # row 1 changes the last token: input->logits is not 0
    es = edge_attribution(linear3, clean, corr, tgt, foil, method="eap", mode=mode)
    g = es.graph
    pairs = [e.split("->") for e in EDGES]
    pr = path_patch(linear3, clean, corr, [[u] for u, _ in pairs], [[v] for _, v in pairs], tgt, foil, mode=mode)
    assert torch.allclose(pr.clean[:, 0], es.clean, atol=1e-5)
    assert torch.allclose(pr.corrupted[:, 0], es.corrupted, atol=1e-5)
    base = _base(pr, mode)
    for j, (u, v) in enumerate(pairs):
        exact = pr.values[j, :, 0] - base
        est = es.scores[:, g.down_index[v], g.up_index[u]]
        assert (exact - est).abs().max() < 1e-4, (u, v, exact, est)
        assert exact.abs().max() > 2e-3, (u, v, exact)  # 30x the tolerance (the smallest: a0.h1->a2.h3<v>)


# -- 2. EAP scores out of a node add up to its node-level AtP ---------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_eap_scores_out_of_a_node_sum_to_its_atp(arch):
    m = make_perturbed(arch)
    clean, corr, tgt, foil = _pairs()
    n_rows = len(clean)
    es = edge_attribution(m, clean, corr, tgt, foil, method="eap")
    g = es.graph
    out = es.scores.sum(1)  # [rows, n_up]: every downstream node of each upstream node
    ap = attribution_patch(m, clean, corr, ["head_out", "mlp_out_layer", "resid_pre_layer"], ["denoising"],
                           ["logit_diff"], [[t] for t in tgt], [[f] for f in foil])
    assert torch.allclose(ap.corrupted[:, 0], es.corrupted, atol=1e-5)
    seen = []
    for job in ap.jobs:
        atp = job.values[:, 0].reshape(len(job.index), n_rows) - ap.corrupted[:, 0][None]
        for r, row in enumerate(job.index.itertuples(index=False)):
            if job.site.name == "head_out":
                node = f"a{row.layer}.h{row.head}"
            elif job.site.name == "mlp_out_layer":
                node = f"m{row.layer}"
            elif row.layer == 0:  # the embeddings entering block 0
                node = "input"
            else:
                continue
            err = (out[:, g.up_index[node]] - atp[r]).abs().max().item()
            assert err < 1e-4, (arch, node, err)
            seen.append(node)
    assert sorted(seen) == sorted(g.upstream)
    assert out.abs().max() > 0.02  # 200x the tolerance


# -- 3. EAP-IG: completeness improves with the number of steps ------------------------------------------


@pytest.mark.parametrize("rule, bound", [("midpoint", 1e-3), ("left", 2e-2)])
def test_eap_ig_completeness_error_shrinks_with_steps(rule, bound):
    """The quadrature error of the midpoint rule is O(1/m^2), of the left (package) rule O(1/m)."""
    m = make_perturbed("llama")
    clean, corr, tgt, foil = _pairs()
    es = edge_attribution(m, clean, corr, tgt, foil, method="eap")
    g = es.graph
    total = es.clean - es.corrupted
    assert total.abs().max() > 0.1

    def err(scores):  # every path starts at the input node: its edges add up to the whole effect
        return (scores[:, :, g.up_index["input"]].sum(1) - total).abs().max().item()

    errs = []
    for steps in (1, 4, 16):
        ig = edge_attribution(m, clean, corr, tgt, foil, method="eap_ig", ig_steps=steps, ig_rule=rule)
        assert torch.allclose(ig.clean, es.clean, atol=1e-5) and torch.allclose(ig.corrupted, es.corrupted, atol=1e-5)
        errs.append(err(ig.scores))
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[2] < bound, errs
    assert err(es.scores) > 10 * errs[2] if rule == "midpoint" else err(es.scores) > errs[2], (err(es.scores), errs)


def _package_eap_ig(model, clean, corr, tgt, foil, steps: int, alpha=lambda k, steps: k / steps):
    """A transcription of ``get_scores_eap_ig`` of the ``eap`` package (Hanna et al. 2024,
    github.com/hannamw/EAP-IG, ``eap/attribute.py``; MIB's EAP-IG baseline), with plain torch and
    TransformerLens hooks, independent of tracekit's engine: ``activation_difference`` accumulates
    ``corrupted - clean`` writes (embeddings, ``attn.hook_result``, ``hook_mlp_out``); ``steps``
    runs of the clean tokens with the embeddings replaced by ``corrupted + alpha * (clean -
    corrupted)`` (the package: ``alpha = k / steps``, ``k in range(steps)``) add ``einsum(diff,
    grad)`` of every reader's input gradient to ``scores[forward, backward]``; then ``scores /=
    items; scores /= steps``. The metric: the logit difference summed over rows (per-row gradients).

    Returns ``({(upstream, downstream): score}, every score)`` in the package's sign."""
    from functools import partial

    from tracekit.hooks import enabled_hooks

    n_layers, H, d = int(model.cfg.n_layers), int(model.cfg.n_heads), int(model.cfg.d_model)
    fwd_names = ["input"] + [n for L in range(n_layers) for n in [f"a{L}.h{h}" for h in range(H)] + [f"m{L}"]]
    bwd_names = [n for L in range(n_layers) for n in
                 [f"a{L}.h{h}<{x}>" for x in "qkv" for h in range(H)] + [f"m{L}"]] + ["logits"]
    clean_t, corr_t = torch.tensor(clean), torch.tensor(corr)
    b, n_pos = clean_t.shape
    scores = torch.zeros(len(fwd_names), len(bwd_names))
    diff = torch.zeros(b, n_pos, len(fwd_names), d)

    def activation_hook(index, acts, hook, add=True):
        a = acts.detach().float()
        a = a if a.ndim == 4 else a[:, :, None]
        diff[:, :, index:index + a.shape[2]] += a if add else -a
        return acts

    def gradient_hook(prev_index, bwd_index, grads):
        g = grads.detach().float()
        g = g if g.ndim == 4 else g[:, :, None]
        scores[:prev_index, bwd_index] += torch.einsum("bpfd,bpkd->fk", diff[:, :, :prev_index], g).squeeze(1)

    def backward_hook(prev_index, bwd_index, acts, hook):
        if acts.requires_grad:
            acts = acts.clone()  # a node of its own: its gradient is this reader's only
            acts.register_hook(partial(gradient_hook, prev_index, bwd_index))
        return acts

    writes = [("blocks.0.hook_resid_pre", 0)]
    bwd = []
    for L in range(n_layers):
        i = fwd_names.index(f"a{L}.h0")
        writes.append((f"blocks.{L}.attn.hook_result", i))
        for x in "qkv":
            j = bwd_names.index(f"a{L}.h0<{x}>")
            bwd.append((f"blocks.{L}.hook_{x}_input", partial(backward_hook, i, slice(j, j + H))))
        i = fwd_names.index(f"m{L}")
        writes.append((f"blocks.{L}.hook_mlp_out", i))
        # the MLP's input before its norm (the bridge's hook_mlp_in is not that point)
        bwd.append((f"blocks.{L}.ln2.hook_in", partial(backward_hook, i, bwd_names.index(f"m{L}"))))
    bwd.append((f"blocks.{n_layers - 1}.hook_resid_post", partial(backward_hook, len(fwd_names), len(bwd_names) - 1)))
    rows, tgt_t, foil_t = torch.arange(b), torch.tensor(tgt), torch.tensor(foil)

    def metric(logits):
        last = logits[:, -1].float()
        return (last[rows, tgt_t] - last[rows, foil_t]).sum()

    with enabled_hooks(model, [h for h, _ in writes] + [h for h, _ in bwd]):
        with torch.inference_mode():
            with model.hooks(fwd_hooks=[(h, partial(activation_hook, i)) for h, i in writes]):
                model(corr_t)
            input_corrupted = diff[:, :, 0].clone()
            with model.hooks(fwd_hooks=[(h, partial(activation_hook, i, add=False)) for h, i in writes]):
                model(clean_t)
            input_clean = input_corrupted - diff[:, :, 0]

        def input_interpolation_hook(k):
            def hook_fn(acts, hook):
                new_input = input_corrupted + alpha(k, steps) * (input_clean - input_corrupted)
                new_input.requires_grad = True
                return new_input
            return hook_fn

        total_steps = 0
        for step in range(0, steps):
            total_steps += 1
            with torch.enable_grad(), model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre",
                                                               input_interpolation_hook(step))] + bwd):
                metric(model(clean_t)).backward()
    scores /= b
    scores /= total_steps
    return {(u, v): scores[i, j] for i, u in enumerate(fwd_names) for j, v in enumerate(bwd_names)}, scores


#: the package's ``k / steps`` for ``k in range(steps)`` (tracekit's default), its EAP-IG-activations
#: points ``k = 1..steps``, and the midpoints
PACKAGE_ALPHAS = {"left": lambda k, m: k / m, "right": lambda k, m: (k + 1) / m, "midpoint": lambda k, m: (k + 0.5) / m}


@pytest.mark.parametrize("rule", [None, "left", "right", "midpoint"])
def test_eap_ig_is_the_eap_package_loop(rule):
    """EAP-IG (default rule, and each rule) equals the transcribed loop of the ``eap`` package at the
    same interpolation points, edge by edge, up to the package's sign (it accumulates corrupted -
    clean; tracekit's denoising score clean - corrupted)."""
    m = make_perturbed("gpt2")
    clean, corr, tgt, foil = _pairs()
    steps = 3
    ref, every = _package_eap_ig(m, clean, corr, tgt, foil, steps, PACKAGE_ALPHAS[rule or "left"])
    kw = {} if rule is None else {"ig_rule": rule}
    es = edge_attribution(m, clean, corr, tgt, foil, method="eap_ig", ig_steps=steps, **kw)
    g, mean = es.graph, es.mean()
    v_idx, u_idx = g.mask.nonzero(as_tuple=True)
    ours = mean[v_idx, u_idx]
    theirs = torch.stack([-ref[(g.upstream[u], g.downstream[v])] for u, v in zip(u_idx.tolist(), v_idx.tolist())])
    assert theirs.abs().max() > 1e-2  # 1e4 x the tolerance
    assert (ours - theirs).abs().max() < 1e-6, (ours - theirs).abs().max()
    assert es.ig_rule == (rule or "left")
    if rule == "right":  # one step per backward pass (max_rows = the rows): the same scores
        one = edge_attribution(m, clean, corr, tgt, foil, method="eap_ig", ig_steps=steps, ig_rule=rule,
                               max_rows=len(clean))
        assert (one.mean()[v_idx, u_idx] - theirs).abs().max() < 1e-6
    # the rules differ by more than the tolerance: the comparison tells them apart
    if rule in (None, "left"):
        other = edge_attribution(m, clean, corr, tgt, foil, method="eap_ig", ig_steps=steps, ig_rule="midpoint")
        assert (other.mean()[v_idx, u_idx] - theirs).abs().max() > 1e-3


# -- 4. path patching ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_path_patching_into_every_receiver_is_activation_patching(arch):
    m = make_perturbed(arch)
    g = build_graph(m)
    clean, corr, tgt, foil = _pairs()
    n_rows = len(clean)
    senders = g.upstream  # input, every head, every MLP
    recv = [[d for d in g.downstream if g.mask[g.down_index[d], g.up_index[s]]] for s in senders]
    # the live rule: receivers in later blocks see the changed earlier ones, as activation patching does
    pr = path_patch(m, clean, corr, [[s] for s in senders], recv, tgt, foil, recipe="live")
    ex = run_patching(m, clean, corr, ["head_out", "mlp_out_layer", "resid_pre_layer"], ["denoising"],
                      ["logit_diff"], [[t] for t in tgt], [[f] for f in foil])
    assert torch.allclose(pr.corrupted, ex.corrupted, atol=1e-5) and torch.allclose(pr.clean, ex.clean, atol=1e-5)
    exact = {}
    for job in ex.jobs:
        vals = job.values[:, 0].reshape(len(job.index), n_rows)
        for r, row in enumerate(job.index.itertuples(index=False)):
            if job.site.name == "head_out":
                exact[f"a{row.layer}.h{row.head}"] = vals[r]
            elif job.site.name == "mlp_out_layer":
                exact[f"m{row.layer}"] = vals[r]
            elif row.layer == 0:
                exact["input"] = vals[r]
    assert sorted(exact) == sorted(senders)
    for j, s in enumerate(senders):
        err = (pr.values[j, :, 0] - exact[s]).abs().max().item()
        assert err < 1e-5, (arch, s, err)
    assert (pr.values[:, :, 0] - pr.corrupted[None, :, 0]).abs().max() > 0.02


def test_path_patching_a_head_into_one_mlp_is_a_pre_hook_on_its_norm():
    m = make_perturbed("gpt2")
    clean, corr, tgt, foil = _pairs()
    pr = path_patch(m, clean, corr, [["a0.h1"]], [["m0"]], tgt, foil)
    C, X = torch.tensor(corr), torch.tensor(clean)
    z = "blocks.0.attn.hook_z"
    _, cc = m.run_with_cache(X, names_filter=lambda n: n == z)
    _, cx = m.run_with_cache(C, names_filter=lambda n: n == z)
    delta = head_writes(m, 0, cc[z])[:, :, 1] - head_writes(m, 0, cx[z])[:, :, 1]  # the head's write, clean - corrupted
    h = m.blocks[0].ln2.register_forward_pre_hook(lambda mod, args: (args[0] + delta,) + tuple(args[1:]))
    try:
        with torch.no_grad():
            lg = m(C)[:, -1]
    finally:
        h.remove()
    rows = torch.arange(len(clean))
    want = lg[rows, tgt] - lg[rows, foil]
    assert (pr.values[0, :, 0] - want).abs().max() < 1e-5, (pr.values[0, :, 0], want)
    assert (want - pr.corrupted[:, 0]).abs().max() > 1e-3


def _transcribe_path_patching(m, clean, corr, senders, receivers, tgt, foil, mode, recipe):
    """Path patching of head ``senders`` ``[(layer, head)]`` into ``receivers`` ``[(hook name, head
    or None)]`` (split q/k/v inputs, ``hook_mlp_in``) written out with plain hooks (no tracekit engine).

    ``wang`` (Wang et al. 2022, section 3.1; ARENA's ``get_path_patch_head_to_heads``): run 1 caches the
    base and source runs; run 2 runs the base prompt with the senders' ``hook_z`` from the source run,
    every other head's ``hook_z`` and every MLP's output frozen to the base run, and records the
    receivers' inputs; run 3 runs the base prompt with the receivers' inputs set to the recorded ones.
    ``live``: run the base prompt adding ``sum_senders (write_src - write_base)`` to the receivers'
    live inputs. Returns ``[rows]`` logit differences."""
    from tracekit.hooks import enabled_hooks

    n_layers = m.cfg.n_layers
    base_t, src_t = (torch.tensor(corr), torch.tensor(clean)) if mode == "denoising" else \
        (torch.tensor(clean), torch.tensor(corr))
    zs = [f"blocks.{L}.attn.hook_z" for L in range(n_layers)]
    mlps = [f"blocks.{L}.hook_mlp_out" for L in range(n_layers)]
    hooks = sorted({h for h, _ in receivers})

    def heads_of(name):
        return [h for r, h in receivers if r == name]

    def at(act, head):
        return act if head is None else act[:, :, head]

    with torch.no_grad(), enabled_hooks(m, hooks):
        _, cb = m.run_with_cache(base_t, names_filter=lambda n: n in zs + mlps)
        _, cs = m.run_with_cache(src_t, names_filter=lambda n: n in zs)
        if recipe == "wang":
            # hooks are bound to the names asked for (a bridge calls them with its own alias as hook.name)
            def freeze_z(act, hook, name):
                out = cb[name].clone()
                for L, h in senders:
                    if name == zs[L]:
                        out[:, :, h] = cs[name][:, :, h]
                return out

            rec = {}

            def record(act, hook, name):
                rec[name] = act.clone()

            m.run_with_hooks(base_t, fwd_hooks=[(z, partial(freeze_z, name=z)) for z in zs]
                             + [(x, lambda a, hook, x=x: cb[x]) for x in mlps] + [(r, partial(record, name=r)) for r in hooks])

            def put(act, hook, name):
                act = act.clone()
                for h in heads_of(name):
                    at(act, h)[...] = at(rec[name], h)
                return act
        else:
            delta = sum(head_writes(m, L, cs[zs[L]])[:, :, h] - head_writes(m, L, cb[zs[L]])[:, :, h]
                        for L, h in senders)

            def put(act, hook, name):
                act = act.clone()
                for h in heads_of(name):
                    at(act, h)[...] += delta
                return act
        lg = m.run_with_hooks(base_t, fwd_hooks=[(r, partial(put, name=r)) for r in hooks])[:, -1]
    rows = torch.arange(len(clean))
    return lg[rows, tgt] - lg[rows, foil]


@pytest.mark.parametrize("mode", ["denoising", "noising"])
def test_path_patching_recipes_with_receivers_in_several_blocks(mode):
    """Receivers in blocks 0, 1 and 2 (an MLP, a head's q/k/v inputs, an MLP, a head): ``wang`` (the
    default) gives each later receiver the base run's input plus the senders' difference, ``live``
    its live input (seeing what the changed earlier receivers wrote) plus the difference. Each equals
    its hand transcription; they differ; with receivers in one block they are the same."""
    m = make_perturbed("gpt2")
    clean, corr, tgt, foil = _pairs(changed=(6,))
    senders = [(0, 1), (0, 3)]
    names_r = ["m0", "a1.h0", "m1", "a2.h1"]
    receivers = [("blocks.0.hook_mlp_in", None), ("blocks.1.hook_mlp_in", None)]
    receivers += [(f"blocks.{L}.attn.hook_{w}_input", h) for L, h in [(1, 0), (2, 1)] for w in "qkv"]
    names_s = [f"a{L}.h{h}" for L, h in senders]
    got = {}
    for recipe in ("wang", "live"):
        pr = path_patch(m, clean, corr, [names_s], [names_r], tgt, foil, mode=mode, recipe=recipe)
        assert pr.recipe == recipe
        want = _transcribe_path_patching(m, clean, corr, senders, receivers, tgt, foil, mode, recipe)
        err = (pr.values[0, :, 0] - want).abs().max().item()
        assert err < 1e-5, (recipe, pr.values[0, :, 0], want)
        assert (want - _base(pr, mode)).abs().max() > 1e-2  # the patch does something
        got[recipe] = pr.values[0, :, 0]
    default = path_patch(m, clean, corr, [names_s], [names_r], tgt, foil, mode=mode)
    assert default.recipe == "wang" and torch.equal(default.values[0, :, 0], got["wang"])
    assert (got["wang"] - got["live"]).abs().max() > 2e-3, got
    # receivers in one block: one rule
    one = [path_patch(m, clean, corr, [names_s], [["a1.h0", "a1.h2<q>"]], tgt, foil, mode=mode, recipe=r).values
           for r in ("wang", "live")]
    assert (one[0] - one[1]).abs().max() < 1e-6


def test_path_patching_refuses_a_sender_named_twice():
    """A sender listed twice in one variant would add its difference twice: refused, naming it."""
    m = make_perturbed("gpt2")
    clean, corr, tgt, foil = _pairs()
    with pytest.raises(CircuitError, match=r"'a0.h0' is listed twice"):
        path_patch(m, clean, corr, [["a0.h0", "a0.h0"]], [["logits"]], tgt, foil)
    with pytest.raises(CircuitError, match="recipe"):
        path_patch(m, clean, corr, [["a0.h0"]], [["logits"]], tgt, foil, recipe="paper")


@pytest.mark.parametrize("sender,receiver", [("a1.h0", "a0.h2<q>"), ("m1", "a1.h0<k>"), ("a1.h0", "a1.h1<q>"),
                                             ("m2", "m1")])
def test_path_patching_refuses_a_receiver_before_its_sender(sender, receiver):
    m = make_perturbed("gpt2")
    clean, corr, tgt, foil = _pairs()
    with pytest.raises(CircuitError, match="receivers"):
        path_patch(m, clean, corr, [[sender]], [[receiver]], tgt, foil)


# -- 5. AtP*'s QK fix is exact when the softmax is the only nonlinearity ----------------------------------


def test_qk_fix_is_exact_when_the_softmax_is_the_only_nonlinearity(linear1_qk):
    # rows 0, 1 change token 2 (its key changes, and its query, which the last position never reads);
    # rows 2, 3 change the last token (the last query changes too). One layer: a position's q and k
    # depend only on its own token and position.
    clean, corr, tgt, foil = _pairs(4, 7, changed=(2, 2, 6, 6))
    T, F = [[t] for t in tgt], [[f] for f in foil]
    sites, modes = ["head_k_by_pos", "head_q_by_pos"], ["denoising", "noising"]
    ex = run_patching(linear1_qk, clean, corr, sites, modes, ["logit_diff"], T, F)
    fixed = attribution_patch(linear1_qk, clean, corr, sites, modes, ["logit_diff"], T, F, qk_fix=True)
    plain = attribution_patch(linear1_qk, clean, corr, sites, modes, ["logit_diff"], T, F, qk_fix=False)
    for je, jf, jp in zip(ex.jobs, fixed.jobs, plain.jobs):
        assert (je.mode, je.site.name) == (jf.mode, jf.site.name) == (jp.mode, jp.site.name)
        assert je.index.equals(jf.index)
        e = je.values[:, 0].reshape(len(je.index), 4)
        effect = e - _base(ex, je.mode)[None]
        changed = effect.abs() > 1e-6
        pos = torch.tensor(je.index["pos"].to_numpy())[:, None].expand_as(effect)
        # only the changed position's q/k matters (k: position 2 or 6; q: the last position only)
        assert bool((pos[changed] == torch.tensor([2, 2, 6, 6]).expand_as(pos)[changed]).all()), je.site.name
        assert effect.abs().max() > 0.1, (je.mode, je.site.name)
        err_fixed = (e - jf.values[:, 0].reshape(len(je.index), 4)).abs().max().item()
        err_plain = (e - jp.values[:, 0].reshape(len(je.index), 4)).abs().max().item()
        assert err_fixed < 1e-4, (je.mode, je.site.name, err_fixed)
        assert err_plain > 1e-3, (je.mode, je.site.name, err_plain)  # without the fix: first order only


# -- 6. nothing is left behind ----------------------------------------------------------------------------


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _state(model) -> dict:
    """Hooks of every module, the gated flags, training mode."""
    hooks = {}
    for name, mod in model.named_modules():
        keys = {(d, k) for d in _HOOK_DICTS for k in (getattr(mod, d, {}) or {})}
        for lst in ("fwd_hooks", "bwd_hooks"):
            keys |= {(lst, id(h)) for h in (getattr(mod, lst, None) or [])}
        hooks[name] = keys
    flags = {g: getattr(model.cfg, g, None) for g in sorted(set(GATES.values()) | {"use_split_qkv_input",
                                                                                  "use_hook_mlp_in"})}
    return {"hooks": hooks, "flags": flags, "training": [m.training for m in model.modules()]}


def _assert_clean(model, before: dict, grad_mode: bool, call: str) -> None:
    """After ``call``: grad mode as it was, no parameter needing or holding a gradient, hooks,
    flags and training mode as :func:`_state` recorded them in ``before``."""
    assert torch.is_grad_enabled() == grad_mode, call
    bad = [n for n, p in model.named_parameters() if p.requires_grad or p.grad is not None]
    assert not bad, (call, bad[:5])
    after = _state(model)
    assert after["flags"] == before["flags"], call
    assert after["training"] == before["training"], call
    diff = {n: after["hooks"][n] ^ before["hooks"].get(n, set()) for n in after["hooks"]}
    assert not {n: d for n, d in diff.items() if d}, call


def _calls(model, clean, corr, tgt, foil):
    T, F = [[t] for t in tgt], [[f] for f in foil]
    return {
        "atp": lambda: attribution_patch(model, clean, corr, ["head_out", "head_k_by_pos", "neuron"],
                                         ["denoising", "noising"], ["logit_diff"], T, F, neuron_layers=[1],
                                         qk_fix=True),
        "eap_ig": lambda: edge_attribution(model, clean, corr, tgt, foil, method="eap_ig", ig_steps=2),
        "path": lambda: path_patch(model, clean, corr, [["a0.h1"], ["m0"]], [["m1", "a2.h0<k>"], ["logits"]],
                                   tgt, foil),
    }


@pytest.fixture(scope="module")
def warm_gpt2():
    """The perturbed GPT-2 after one use of every call (the libraries wire their own lazy hooks on
    first use: those are not ours) and its calls."""
    m = make_perturbed("gpt2")
    clean, corr, tgt, foil = _pairs()
    calls = _calls(m, clean, corr, tgt, foil)
    for fn in calls.values():
        fn()
    return m, calls, (clean, corr, tgt, foil)


@pytest.mark.parametrize("grad_mode", [True, False])
def test_nothing_is_left_on_the_model(warm_gpt2, grad_mode):
    m, calls, _ = warm_gpt2
    assert all(not p.requires_grad for p in m.parameters())
    with torch.set_grad_enabled(grad_mode):
        before = _state(m)
        for name, fn in calls.items():
            fn()
            _assert_clean(m, before, grad_mode, name)


class _BoomBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_nothing_is_left_on_the_model_when_the_metric_raises(warm_gpt2, monkeypatch, where):
    m, calls, (clean, corr, tgt, foil) = warm_gpt2
    good = TM.METRICS["logit_diff"]

    def forward_boom(lg, inputs):
        raise RuntimeError("boom in forward")

    def backward_boom(lg, inputs):
        return _BoomBackward.apply(good(lg, inputs))

    before = _state(m)
    grad_mode = torch.is_grad_enabled()
    monkeypatch.setitem(TM.METRICS, "logit_diff", forward_boom if where == "forward" else backward_boom)
    for name, fn in calls.items():
        if where == "backward" and name == "path":
            continue  # no backward pass in path patching
        with pytest.raises(RuntimeError, match=f"boom in {where}"):
            fn()
        _assert_clean(m, before, grad_mode, name)
    monkeypatch.undo()
    # the model still computes what it did: path patching with every receiver of m0 is its activation patching
    g = build_graph(m)
    recv = [d for d in g.downstream if g.mask[g.down_index[d], g.up_index["m0"]]]
    pr = path_patch(m, clean, corr, [["m0"]], [recv], tgt, foil, recipe="live")
    ex = run_patching(m, clean, corr, ["mlp_out_layer"], ["denoising"], ["logit_diff"], [[t] for t in tgt],
                      [[f] for f in foil], layers=[0])
    assert (pr.values[0, :, 0] - ex.jobs[0].values[:, 0]).abs().max() < 1e-5


# -- 7. models whose writes are not separable are refused ---------------------------------------------------


def test_edge_methods_refuse_post_norm_blocks():
    from conformance import harness

    from tracekit.model.load import load_model
    from tracekit.model.spec import ModelSpec

    m = load_model(ModelSpec(name=harness.build("Olmo2ForCausalLM"), tokenizer=harness.GPT2_BPE, device="cpu"))
    clean, corr, tgt, foil = _pairs(2, 6)
    for method in ("eap", "eap_ig"):
        with pytest.raises(MethodRefused, match="post-norm"):
            edge_attribution(m, clean, corr, tgt, foil, method=method)
    with pytest.raises(MethodRefused, match="post-norm"):
        path_patch(m, clean, corr, [["a0.h0"]], [["logits"]], tgt, foil)
    # node-level attribution patching still runs on it (what the refusal recommends)
    ap = attribution_patch(m, clean, corr, ["head_out"], ["denoising"], ["logit_diff"],
                           [[t] for t in tgt], [[f] for f in foil])
    assert torch.isfinite(ap.jobs[0].values).all()
