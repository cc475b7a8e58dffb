"""Tiny configurations of every architecture the conformance suite builds (tests/conformance).

Each is a 2-layer (or the smallest pattern-complete) model of about 64 hidden units with the
family's distinguishing features switched on where they can bite on a 10-token prompt: soft-caps
of 5 / 10, sliding windows of 4, MoE with 4 experts top-2, GQA/MQA, parallel blocks, ALiBi, QK
norms, post-norms, tied and untied embeddings, Granite/Falcon-H1 multipliers. The vocabulary holds
GPT-2's tokenizer ids (the vendored gpt2-bpe tables tokenize the prompts).

SPECS[arch] = dict(
    hf_class   = transformers class name to build (defaults to arch),
    tiny       = config kwargs,
    features   = short strings describing what the tiny config switches on,
    arch_override = architecture name to route the bridge through (for alias keys),
    variants   = {variant_name: dict(tiny=..., features=...)}  (extra configs of the same family)
)
"""

V = 50304  # GPT-2 tokenizer ids fit
TOK = dict(bos_token_id=50256, eos_token_id=50256, pad_token_id=None)

# llama-style base: 2 layers, d=64, 4 heads (GQA 2 kv), d_mlp=128
L = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
         tie_word_embeddings=False, **TOK)


def llama(**kw):
    d = dict(L)
    d.update(kw)
    return d


SW2 = ["sliding_attention", "full_attention"]

SPECS = {
    # ------------------------------------------------------------------ classic / GPT family
    "GPT2LMHeadModel": dict(
        tiny=dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=256, **TOK),
        features=["learned-pos", "layernorm", "fused-qkv(Conv1D)", "gelu_new", "tied"],
        variants={"scale_by_inverse_layer_idx": dict(
            tiny=dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=256,
                      scale_attn_by_inverse_layer_idx=True, **TOK),
            features=["scale_attn_by_inverse_layer_idx"])},
    ),
    "OpenAIGPTLMHeadModel": dict(
        tiny=dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=256),
        features=["post-LN (GPT-1)", "learned-pos", "tied", "mlp=4*d fixed"],
    ),
    "GPTBigCodeForCausalLM": dict(
        tiny=dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=256,
                  multi_query=True, **TOK),
        features=["MQA (multi_query)", "learned-pos", "tied"],
        variants={"mha": dict(
            tiny=dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=256,
                      multi_query=False, **TOK), features=["multi_query=False"])},
    ),
    "GPTJForCausalLM": dict(
        tiny=dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_inner=128,
                  n_positions=256, **TOK),
        features=["parallel attn+mlp (shared ln_1)", "partial rotary (rotary_dim=8 of 16, interleaved)",
                  "untied", "lm_head bias"],
    ),
    "CodeGenForCausalLM": dict(
        tiny=dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_inner=128,
                  n_positions=256, n_ctx=256, **TOK),
        features=["parallel attn+mlp", "fused qkv mp_num=4 layout", "partial rotary", "untied"],
    ),
    "GPTNeoForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                  attention_types=[[["global", "local"], 1]], window_size=4,
                  max_position_embeddings=256, **TOK),
        features=["global/local alternation (window 4)", "no 1/sqrt(d) scaling", "learned-pos", "tied"],
    ),
    "GPTNeoXForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=256, use_parallel_residual=True,
                  tie_word_embeddings=False, **TOK),
        features=["use_parallel_residual", "partial rotary 0.25", "attention bias", "untied"],
        variants={"sequential_residual": dict(
            tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=256, use_parallel_residual=False,
                      tie_word_embeddings=False, **TOK),
            features=["use_parallel_residual=False"])},
    ),
    "OPTForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                  word_embed_proj_dim=64, max_position_embeddings=256, pad_token_id=1,
                  bos_token_id=50256, eos_token_id=50256),
        features=["learned-pos offset 2", "relu", "pre-LN", "tied"],
        variants={"opt350m_style": dict(
            tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                      word_embed_proj_dim=32, do_layer_norm_before=False, max_position_embeddings=256,
                      pad_token_id=1, bos_token_id=50256, eos_token_id=50256),
            features=["word_embed_proj_dim=32 (project_in/out)", "post-LN (do_layer_norm_before=False)"])},
    ),
    "XGLMForCausalLM": dict(
        tiny=dict(vocab_size=V, d_model=64, ffn_dim=128, num_layers=2, attention_heads=4,
                  max_position_embeddings=256, scale_embedding=True, pad_token_id=1,
                  bos_token_id=50256, eos_token_id=50256),
        features=["sinusoidal pos", "scale_embedding sqrt(d)", "tied"],
    ),
    "BloomForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, n_layer=2, n_head=4, **TOK),
        features=["ALiBi", "embedding layernorm", "fused qkv (per-head interleaved)", "tied"],
    ),
    "BloomModel": dict(
        hf_class="BloomModel",
        tiny=dict(vocab_size=V, hidden_size=64, n_layer=2, n_head=4, **TOK),
        features=["base model (no lm_head)", "ALiBi"],
        variants={"via_BloomForCausalLM": dict(hf_class="BloomForCausalLM", arch_override="BloomModel",
                                               features=["BloomForCausalLM with config.architectures=['BloomModel']"])},
    ),
    "MptForCausalLM": dict(
        tiny=dict(vocab_size=V, d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=256,
                  no_bias=True, attn_config={"alibi": True, "alibi_bias_max": 8}, **TOK),
        features=["ALiBi", "no_bias", "fused Wqkv", "tied"],
        variants={"clip_qkv": dict(
            tiny=dict(vocab_size=V, d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=256,
                      no_bias=True, attn_config={"alibi": True, "alibi_bias_max": 8, "clip_qkv": 0.1}, **TOK),
            features=["clip_qkv=0.1"])},
    ),
    "FalconForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False,
                  alibi=False, ffn_hidden_size=128, max_position_embeddings=256, **TOK),
        features=["falcon-7b style: MQA + parallel_attn (single LN)", "rope", "tied"],
        variants={
            "alibi_rw": dict(
                tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          multi_query=False, parallel_attn=False, new_decoder_architecture=False, bias=True,
                          alibi=True, ffn_hidden_size=128, max_position_embeddings=256, **TOK),
                features=["falcon-rw style: ALiBi, sequential, bias"]),
            "new_decoder_arch": dict(
                tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_kv_heads=2, new_decoder_architecture=True, num_ln_in_parallel_attn=2,
                          parallel_attn=True, bias=False, alibi=False, ffn_hidden_size=128,
                          max_position_embeddings=256, **TOK),
                features=["falcon-40b style: new_decoder_architecture, GQA, 2 LNs in parallel"]),
        },
    ),
    "PhiForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                  qk_layernorm=False, **TOK),
        features=["parallel attn+mlp (shared LN)", "partial rotary 0.5", "dense bias", "lm_head bias", "untied"],
        variants={"qk_layernorm": dict(
            tiny=dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      qk_layernorm=True, **TOK),
            features=["qk_layernorm", "GQA"])},
    ),
    # ------------------------------------------------------------------ llama-like
    "LlamaForCausalLM": dict(
        tiny=llama(head_dim=16),
        features=["rmsnorm", "rope", "GQA 4q/2kv", "swiglu", "untied"],
        variants={"tied_bias_llama3rope": dict(
            tiny=llama(head_dim=16, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0}),
            features=["tied", "attention_bias", "mlp_bias", "llama3 rope scaling"])},
    ),
    "MistralForCausalLM": dict(tiny=llama(head_dim=16, sliding_window=4),
                               features=["sliding_window=4 (all layers)", "GQA"]),
    "MixtralForCausalLM": dict(tiny=llama(head_dim=16, num_local_experts=4, num_experts_per_tok=2),
                               features=["MoE 4 experts top-2", "GQA"]),
    "Ministral3ForCausalLM": dict(
        tiny=llama(head_dim=16, rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                                                 "llama_4_scaling_beta": 0.1}),
        features=["yarn rope", "llama_4_scaling_beta (position-dependent q scaling)", "GQA"]),
    "ApertusForCausalLM": dict(
        tiny=llama(rope_parameters={"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0,
                                    "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0}),
        features=["xielu activation (learned)", "qk norm", "non-gated MLP", "llama3 rope"]),
    "ArceeForCausalLM": dict(tiny=llama(head_dim=16), features=["relu2 non-gated MLP", "GQA"]),
    "BitNetForCausalLM": dict(tiny=llama(), features=["ternary weight quant (AutoBitLinear)", "sub-norms", "relu2"]),
    "SeedOssForCausalLM": dict(
        tiny=llama(head_dim=16, attention_bias=True, attention_out_bias=False, attention_dropout=0.0,
                   residual_dropout=0.0),
        features=["qkv bias, no o bias", "GQA"]),
    "SmolLM3ForCausalLM": dict(tiny=llama(no_rope_layers=[1, 0], tie_word_embeddings=True),
                               features=["NoPE on layer 1 (no_rope_layers=[1,0])", "tied", "GQA"]),
    "HunYuanDenseV1ForCausalLM": dict(tiny=llama(head_dim=16), features=["qk norm (query/key_layernorm)", "GQA"]),
    "Jais2ForCausalLM": dict(tiny=llama(head_dim=16), features=["layernorm", "relu2 non-gated MLP", "biases"]),
    "Ernie4_5ForCausalLM": dict(tiny=llama(head_dim=16, use_bias=True, tie_word_embeddings=True),
                                features=["use_bias", "tied", "interleaved rope", "GQA"]),
    "Ernie4_5_MoeForCausalLM": dict(
        tiny=llama(moe_intermediate_size=32, moe_k=2, moe_num_experts=4, moe_num_shared_experts=1,
                   moe_layer_start_index=1, moe_layer_end_index=1, moe_layer_interval=1, tie_word_embeddings=True),
        features=["layer0 dense / layer1 MoE 4e top-2 + shared", "tied"]),
    "Exaone4ForCausalLM": dict(
        tiny=llama(sliding_window=4, sliding_window_pattern=2, layer_types=SW2),
        features=["sliding/global alternation (window 4)", "post-sublayer norms + qk norm", "GQA"]),
    "GlmForCausalLM": dict(tiny=llama(head_dim=16), features=["partial rotary 0.5 (interleaved)", "qkv bias", "fused gate_up"]),
    "Glm4ForCausalLM": dict(tiny=llama(head_dim=16), features=["sandwich norms (post_self_attn/post_mlp)", "partial rotary", "qkv bias"]),
    "Glm4MoeForCausalLM": dict(
        tiny=llama(head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True, n_group=1, topk_group=1,
                   routed_scaling_factor=1.5),
        features=["layer0 dense / layer1 MoE 4e top-2 + shared", "qk norm", "routed_scaling 1.5", "partial rotary"]),
    "Qwen2ForCausalLM": dict(tiny=llama(), features=["qkv bias", "GQA", "untied"],
                             variants={"sliding_tied": dict(
                                 tiny=llama(use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                            tie_word_embeddings=True),
                                 features=["sliding window on layers >= max_window_layers=1", "tied"])}),
    "Qwen2MoeForCausalLM": dict(
        tiny=llama(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                   num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=False),
        features=["layer0 dense (mlp_only_layers) / layer1 MoE 4e top-2 + gated shared expert", "qkv bias"]),
    "Qwen3ForCausalLM": dict(tiny=llama(head_dim=32, tie_word_embeddings=True),
                             features=["qk norm", "head_dim 32 != d_model/n_heads", "tied", "GQA"]),
    "Qwen3MoeForCausalLM": dict(
        tiny=llama(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                   decoder_sparse_step=1, norm_topk_prob=True),
        features=["MoE 4e top-2 (all layers)", "qk norm", "GQA"]),
    "OlmoForCausalLM": dict(tiny=llama(clip_qkv=0.1), features=["non-parametric layernorm", "clip_qkv=0.1 (bites)"]),
    "Olmo2ForCausalLM": dict(tiny=llama(), features=["post-sublayer norm (no pre-norm)", "qk norm over all heads"]),
    "Olmo3ForCausalLM": dict(tiny=llama(sliding_window=4, layer_types=SW2),
                             features=["post-norm", "qk norm", "sliding/global alternation (window 4)"]),
    "OlmoeForCausalLM": dict(tiny=llama(intermediate_size=64, num_experts=4, num_experts_per_tok=2, clip_qkv=0.1),
                             features=["MoE 4e top-2", "qk norm", "clip_qkv"]),
    "FlexOlmoForCausalLM": dict(tiny=llama(num_experts=4, num_experts_per_tok=2),
                                features=["MoE 4e top-2", "post-norm (Olmo2-style)", "qk norm"]),
    "NemotronForCausalLM": dict(tiny=llama(head_dim=16), features=["LayerNorm1P (1+w)", "relu2 non-gated", "partial rotary 0.5"]),
    "StableLmForCausalLM": dict(
        tiny=llama(use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=False),
        features=["layernorm", "partial rotary 0.25", "qkv bias", "per-head qk layernorm"],
        variants={"parallel_residual": dict(tiny=llama(use_parallel_residual=True),
                                            features=["use_parallel_residual"])}),
    "Starcoder2ForCausalLM": dict(
        tiny=llama(sliding_window=4, use_bias=True, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh"),
        features=["sliding_window=4", "layernorm", "biases", "non-gated gelu MLP", "tied", "GQA"]),
    "Phi3ForCausalLM": dict(
        tiny=llama(original_max_position_embeddings=256,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
        features=["fused qkv_proj", "fused gate_up_proj", "partial rotary 0.75 (phi-4-mini)", "GQA"],
        variants={"tied_full_rotary": dict(tiny=llama(tie_word_embeddings=True, original_max_position_embeddings=256),
                                           features=["tied", "full rotary"])}),
    "CohereForCausalLM": dict(
        tiny=llama(logit_scale=0.5, use_qk_norm=True, tie_word_embeddings=True),
        features=["parallel attn+mlp (single LN)", "logit_scale=0.5", "qk norm", "bias-free LayerNorm",
                  "interleaved rope", "tied"],
        variants={"no_qk_norm": dict(tiny=llama(logit_scale=0.5, use_qk_norm=False, tie_word_embeddings=True),
                                     features=["use_qk_norm=False (command-r v01 style)"])}),
    "Cohere2ForCausalLM": dict(
        tiny=llama(head_dim=16, logit_scale=0.5, sliding_window=4, layer_types=SW2, tie_word_embeddings=True),
        features=["parallel attn+mlp", "logit_scale=0.5", "sliding/global (rope only on sliding)", "tied"]),
    "GraniteForCausalLM": dict(
        tiny=llama(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=3.0,
                   attention_multiplier=0.3, tie_word_embeddings=True),
        features=["logits_scaling=4", "residual_multiplier=0.5", "embedding_multiplier=3", "attention_multiplier=0.3",
                  "tied"]),
    "GraniteMoeForCausalLM": dict(
        tiny=llama(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=3.0, attention_multiplier=0.3,
                   num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True),
        features=["MoE 4e top-2", "granite multipliers", "tied"]),
    "JetMoeForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
                  intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                  tie_word_embeddings=True, **TOK),
        features=["mixture-of-attention-heads (MoA)", "MoE MLP 4e top-2", "tied"]),
    "MiniMaxM2ForCausalLM": dict(
        tiny=llama(head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, rotary_dim=8),
        features=["MoE 4e top-2 (sigmoid router + bias)", "qk norm (full width)", "partial rotary 8/16"]),
    "NanoChatForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, final_logit_softcapping=5.0,
                  tie_word_embeddings=False, **TOK),
        features=["final_logit_softcapping=5", "param-free rmsnorm + qk norm", "relu2", "GQA"]),
    "ModernBertDecoderForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, layer_types=["full_attention", "sliding_attention"],
                  local_attention=8, pad_token_id=50256, bos_token_id=50256, eos_token_id=50256,
                  cls_token_id=50256, sep_token_id=50256),
        features=["global/local alternation (local_attention=8 -> window 4)", "bias-free LayerNorm",
                  "embedding norm", "prediction head + decoder bias", "tied"]),
    # ------------------------------------------------------------------ gemma family
    "GemmaForCausalLM": dict(tiny=llama(head_dim=16, num_key_value_heads=1, tie_word_embeddings=True,
                                        hidden_act="gelu_pytorch_tanh"),
                             features=["MQA (1 kv head)", "rmsnorm (1+w)", "embed * sqrt(d)", "geglu", "tied"]),
    "Gemma2ForCausalLM": dict(
        tiny=llama(head_dim=16, query_pre_attn_scalar=32, sliding_window=4, layer_types=SW2,
                   final_logit_softcapping=5.0, attn_logit_softcapping=10.0, tie_word_embeddings=True),
        features=["final_logit_softcapping=5", "attn_logit_softcapping=10", "sliding/global (window 4)",
                  "query_pre_attn_scalar=32 (!= head_dim)", "pre+post norms", "tied"]),
    "Gemma3ForCausalLM": dict(
        tiny=llama(head_dim=16, query_pre_attn_scalar=32, sliding_window=4, layer_types=SW2,
                   tie_word_embeddings=True),
        features=["qk norm", "sliding/global (window 4) with separate rope thetas", "query_pre_attn_scalar=32",
                  "pre+post norms", "tied"]),
    "Gemma4ForCausalLM": dict(
        tiny=llama(head_dim=16, global_head_dim=32, sliding_window=4, layer_types=SW2, hidden_size_per_layer_input=8,
                   vocab_size_per_layer_input=V, final_logit_softcapping=5.0, attention_k_eq_v=True,
                   num_global_key_value_heads=1, tie_word_embeddings=True),
        features=["per-layer embeddings (PLE)", "global head_dim 32 vs sliding 16", "attention_k_eq_v on global",
                  "proportional partial rope on global", "final_logit_softcapping=5", "sliding window 4", "tied"]),
    "VaultGemmaForCausalLM": dict(
        tiny=llama(head_dim=16, query_pre_attn_scalar=32, sliding_window=4, layer_types=SW2,
                   final_logit_softcapping=5.0, attn_logit_softcapping=10.0, tie_word_embeddings=True),
        features=["softcaps 5/10", "sliding/global", "tied"]),
    # ------------------------------------------------------------------ MLA / DeepSeek family
    "DeepseekV2ForCausalLM": dict(
        tiny=llama(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8, topk_method="greedy"),
        features=["MLA (q_lora 24, kv_lora 16, rope 8 + nope 16)", "layer0 dense / layer1 MoE 4e top-2 + shared"]),
    "DeepseekV3ForCausalLM": dict(
        tiny=llama(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8, n_group=1, topk_group=1,
                   routed_scaling_factor=2.5, norm_topk_prob=True),
        features=["MLA", "sigmoid router + e_score_correction_bias", "routed_scaling 2.5", "layer0 dense / layer1 MoE"]),
    "DeepseekV4ForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                  head_dim=32, q_lora_rank=32, qk_rope_head_dim=8, partial_rotary_factor=0.25,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                  layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                  compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                  mlp_layer_types=["hash_moe", "moe"], hc_mult=2, sliding_window=4, o_groups=2, o_lora_rank=16,
                  index_n_heads=2, index_head_dim=16, index_topk=2, max_position_embeddings=256,
                  tie_word_embeddings=False, **TOK),
        features=["compressed sparse / heavily compressed attention", "hyper-connections (hc_mult=2)",
                  "hash MoE + MoE", "grouped low-rank o_proj", "MQA"]),
    "Glm4MoeLiteForCausalLM": dict(
        tiny=llama(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                   v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   n_shared_experts=1, mlp_layer_types=["dense", "sparse"]),
        features=["MLA", "layer0 dense / layer1 MoE 4e top-2 + shared"]),
    "GlmMoeDsaForCausalLM": dict(
        tiny=llama(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                   v_head_dim=16, head_dim=8, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   n_shared_experts=1, mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1,
                   index_topk=4, index_head_dim=16, index_n_heads=2,
                   layer_types=["indexed_attention", "indexed_attention"], indexer_types=["full", "full"]),
        features=["MLA + DSA indexer (index_topk=4 < seq, bites)", "layer0 dense / layer1 MoE"]),
    "YoutuForCausalLM": dict(
        tiny=llama(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                   v_head_dim=16, head_dim=8, tie_word_embeddings=True),
        features=["MLA (dense MLP)", "tied"]),
    # ------------------------------------------------------------------ other MoE / exotic attention
    "AfmoeForCausalLM": dict(
        tiny=llama(head_dim=16, moe_intermediate_size=32, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                   num_shared_experts=1, route_scale=1.5, global_attn_every_n_layers=2, sliding_window=4,
                   layer_types=SW2, mup_enabled=True),
        features=["sliding/global (window 4)", "layer0 dense / layer1 MoE 4e top-2 + shared", "muP scaling",
                  "gated attention", "qk norm"]),
    "GptOssForCausalLM": dict(
        tiny=llama(head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                   layer_types=SW2,
                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 64,
                                    "rope_theta": 150000.0}),
        features=["attention sinks", "sliding/global (window 4)", "MoE 4e top-2 clamped swiglu", "yarn rope",
                  "attention bias"]),
    "Llama4ForCausalLM": dict(
        tiny=llama(head_dim=16, intermediate_size=64, intermediate_size_mlp=128, num_local_experts=4,
                   num_experts_per_tok=1, moe_layers=[1], no_rope_layers=[1, 0], attention_chunk_size=4,
                   layer_types=["chunked_attention", "full_attention"], use_qk_norm=True,
                   attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1),
        features=["chunked attention (chunk 4) + NoPE global layer with temperature tuning", "L2 qk norm",
                  "layer0 dense / layer1 MoE (top-1 + shared)"]),
    "LagunaForCausalLM": dict(
        tiny=llama(head_dim=16, num_attention_heads_per_layer=[4, 8], layer_types=SW2, sliding_window=4,
                   mlp_layer_types=["dense", "sparse"], moe_intermediate_size=32, shared_expert_intermediate_size=32,
                   num_experts=4, num_experts_per_tok=2, gating=True),
        features=["per-layer head counts [4,8]", "gated attention", "sliding/global (window 4)",
                  "layer0 dense / layer1 MoE"]),
    "HrmTextForCausalLM": dict(
        tiny=llama(num_hidden_layers=1, head_dim=16, H_cycles=2, L_cycles=2, L_bp_cycles=[1]),
        features=["hierarchical recurrent H/L stacks (1 layer each, 2x2 cycles)", "embedding_scale=1/init_range"]),
    # ------------------------------------------------------------------ hybrids
    "JambaForCausalLM": dict(
        tiny=llama(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                   num_experts=4, num_experts_per_tok=2, use_mamba_kernels=False, mamba_d_state=8, mamba_d_conv=4,
                   mamba_expand=2, mamba_dt_rank=8),
        features=["layer0 mamba + dense MLP", "layer1 attention + MoE 4e top-2", "no positional encoding"]),
    "BambaForCausalLM": dict(
        tiny=llama(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                   mamba_expand=2, mamba_chunk_size=16),
        features=["layer0 mamba2 / layer1 attention", "partial rotary 0.5"]),
    "FalconH1ForCausalLM": dict(
        tiny=llama(head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
                   mamba_d_state=16, mamba_expand=2, mamba_chunk_size=16, mamba_rms_norm=True,
                   lm_head_multiplier=0.5, embedding_multiplier=2.0, mlp_multipliers=[0.8, 1.2], key_multiplier=0.7,
                   attention_out_multiplier=0.9, attention_in_multiplier=1.1,
                   ssm_multipliers=[1.0, 0.9, 1.1, 1.0, 0.8], ssm_in_multiplier=1.1, ssm_out_multiplier=0.9),
        features=["attention || mamba2 in every layer", "muP multipliers != 1 (lm_head 0.5, embed 2, ...)",
                  "mamba rms norm"]),
    "GraniteMoeHybridForCausalLM": dict(
        tiny=llama(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=3.0, attention_multiplier=0.3,
                   layer_types=["linear_attention", "full_attention"], mamba_n_heads=8, mamba_d_head=16,
                   mamba_n_groups=1, mamba_d_state=16, mamba_expand=2, mamba_chunk_size=16,
                   shared_intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                   position_embedding_type=None, tie_word_embeddings=True),
        features=["layer0 mamba2 / layer1 attention (NoPE)", "MoE 4e top-2 + shared MLP", "granite multipliers"],
        variants={"rope": dict(
            tiny=llama(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=3.0, attention_multiplier=0.3,
                       layer_types=["linear_attention", "full_attention"], mamba_n_heads=8, mamba_d_head=16,
                       mamba_n_groups=1, mamba_d_state=16, mamba_expand=2, mamba_chunk_size=16,
                       shared_intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                       position_embedding_type="rope", tie_word_embeddings=True),
            features=["position_embedding_type='rope'"])}),
    "NemotronHForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=4,
                  layers_block_type=["linear_attention", "full_attention", "moe", "mlp"],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                  mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1, expand=2, chunk_size=16,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=32, use_mamba_kernels=False, max_position_embeddings=256,
                  tie_word_embeddings=False, **TOK),
        features=["4 single-mixer layers: mamba2 / attention / MoE / MLP", "no rope", "relu2"]),
    "Qwen3NextForCausalLM": dict(
        tiny=llama(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                   num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1),
        features=["layer0 gated-deltanet / layer1 gated attention", "MoE 4e top-2 + shared", "partial rotary 0.25",
                  "zero-centered rmsnorm"]),
    "Qwen3_5ForCausalLM": dict(
        tiny=llama(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4),
        features=["layer0 gated-deltanet / layer1 gated attention", "dense MLP"]),
    "Qwen3_5MoeForCausalLM": dict(
        tiny=llama(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                   num_experts=4, num_experts_per_tok=2),
        features=["layer0 gated-deltanet / layer1 gated attention", "MoE 4e top-2 + shared"]),
    "OlmoHybridForCausalLM": dict(
        tiny=llama(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                   linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=32,
                   linear_conv_kernel_dim=4),
        features=["layer0 gated-deltanet / layer1 attention", "post-norm"]),
    "Lfm2ForCausalLM": dict(
        tiny=llama(layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False, conv_L_cache=3,
                   tie_word_embeddings=True),
        features=["layer0 short-conv / layer1 attention", "qk norm", "tied"]),
    "Lfm2MoeForCausalLM": dict(
        tiny=llama(layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, conv_L_cache=3, tie_word_embeddings=True),
        features=["layer0 conv + dense / layer1 attention + MoE 4e top-2 (expert bias)", "tied"]),
    "RecurrentGemmaForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, block_types=["recurrent", "attention"],
                  lru_width=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16, attention_window_size=4,
                  intermediate_size=128, logits_soft_cap=5.0, conv1d_width=4, tie_word_embeddings=True,
                  max_position_embeddings=256, **TOK),
        features=["layer0 RG-LRU recurrent / layer1 local attention (window 4, MQA)", "logits_soft_cap=5",
                  "partial rotary 0.5", "tied"]),
    "Zamba2ForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, layers_block_type=["linear_attention", "hybrid"],
                  mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, n_mamba_heads=8, mamba_ngroups=1,
                  chunk_size=16, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                  num_mem_blocks=1, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
                  use_mamba_kernels=False, max_position_embeddings=256, tie_word_embeddings=True, **TOK),
        features=["layer0 mamba2 / layer1 shared-transformer + mamba2 (hybrid)", "shared attention LoRA adapters",
                  "concat(original embeds) input to shared block", "tied"]),
    # ------------------------------------------------------------------ pure SSM / RNN (bonus)
    "MambaForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                  time_step_rank=8, **TOK),
        features=["mamba1 selective scan", "tied"]),
    "FalconMambaForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                  time_step_rank=8, **TOK),
        features=["mamba1 with B/C/dt rms norms", "tied"]),
    "Mamba2ForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=1, expand=2,
                  chunk_size=16, num_hidden_layers=2, **TOK),
        features=["mamba2 SSD", "gated rmsnorm", "untied"]),
    "RwkvForCausalLM": dict(
        tiny=dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64, intermediate_size=128,
                  context_length=256, **TOK),
        features=["RWKV-4 time-mix / channel-mix", "untied"]),
}

# alias keys (not transformers classes) tested through the equivalent transformers class, with
# config.architectures overridden so the bridge routes through the alias' adapter.
ALIASES = {
    "Gemma1ForCausalLM": "GemmaForCausalLM",
    "NeoForCausalLM": "GPTNeoForCausalLM",
    "NeoXForCausalLM": "GPTNeoXForCausalLM",
    "JetMoEForCausalLM": "JetMoeForCausalLM",
    "MPTForCausalLM": "MptForCausalLM",
}
for _alias, _base in ALIASES.items():
    SPECS[_alias] = dict(hf_class=SPECS[_base].get("hf_class", _base), tiny=SPECS[_base]["tiny"],
                         features=["alias of " + _base] + SPECS[_base]["features"], arch_override=_alias)
SPECS["PhiMoEForCausalLM"] = dict(
    hf_class="PhimoeForCausalLM",
    tiny=llama(num_local_experts=4, num_experts_per_tok=2),
    features=["remote-code name; tested via transformers' PhimoeForCausalLM", "MoE 4e top-2 sparsemixer",
              "layernorm", "GQA"],
    arch_override="PhiMoEForCausalLM")
