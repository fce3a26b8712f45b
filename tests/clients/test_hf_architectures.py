"""The built-in policies and the block split on more Hugging Face families, from tiny configs.

BERT / RoBERTa (``attention.self.query``, ``intermediate.dense``, the layer's ``output.dense``),
T5 (``SelfAttention`` / ``EncDecAttention``, ``DenseReluDense.wi`` / ``wo``), OPT, Falcon, Qwen2,
GPT-NeoX and Falcon (a fused ``query_key_value`` laid out head by head or by group), Phi-3 and
GPTBigCode (grouped-query fused projections), ViT with a classification head, RoBERTa's head
modules, and Mixtral (experts stacked in 3-D tensors). Each builder skips when the installed
transformers lacks the family.
"""

from __future__ import annotations

import functools
import io
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from manifoldlib import DGram, Stiefel
from manifoldlib.optim import assign_parameters, build_optimizer

VOCAB, WIDTH, FF = 64, 32, 64


def _config(cls_name, **kw):
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    return cls(**kw)


def _build(model_cls, config):
    cls = getattr(transformers, model_cls, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(0)
    return cls(config).eval()


#: The layer stack every encoder/decoder family shares, under each family's own names.
_STACK = dict(num_hidden_layers=2, hidden_size=WIDTH, num_attention_heads=4, vocab_size=VOCAB)
#: family -> (model class, config class, config keywords).
SPECS = {
    "bert": ("BertForMaskedLM", "BertConfig",
             {**_STACK, "intermediate_size": FF, "max_position_embeddings": 32}),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig",
                {**_STACK, "intermediate_size": FF, "max_position_embeddings": 40}),
    "t5": ("T5ForConditionalGeneration", "T5Config",
           dict(num_layers=2, num_decoder_layers=2, d_model=WIDTH, d_kv=8, d_ff=FF, num_heads=4,
                vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0)),
    "opt": ("OPTForCausalLM", "OPTConfig",
            {**_STACK, "ffn_dim": FF, "max_position_embeddings": 32, "word_embed_proj_dim": WIDTH}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config",
              {**_STACK, "intermediate_size": FF, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(_STACK)),
    "neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig",
             {**_STACK, "intermediate_size": FF, "max_position_embeddings": 32}),
    "vit": ("ViTForImageClassification", "ViTConfig",
            {**{k: v for k, v in _STACK.items() if k != "vocab_size"}, "intermediate_size": FF,
             "image_size": 16, "patch_size": 4, "num_labels": 3}),
}


def _family(name: str):
    """A tiny model of ``name`` (:data:`SPECS`), skipped when transformers lacks it."""
    model_cls, config_cls, kw = SPECS[name]
    return _build(model_cls, _config(config_cls, **kw))


BUILDERS = {name: functools.partial(_family, name) for name in SPECS}

#: Name parts that mark a block's attention or MLP matrices in each family (checked on every matrix).
ATTN_MARK = {"bert": ".attention.", "roberta": ".attention.", "t5": "Attention.", "opt": ".self_attn.",
             "qwen2": ".self_attn.", "falcon": ".self_attention.", "neox": ".attention.", "vit": ".attention."}
MLP_MARK = {"bert": (".intermediate.", ".output."), "roberta": (".intermediate.", ".output."),
            "t5": (".DenseReluDense.",), "opt": (".fc1.", ".fc2."), "qwen2": (".mlp.",), "falcon": (".mlp.",),
            "neox": (".mlp.",), "vit": (".mlp.", ".intermediate.", ".output.")}
#: Hidden matrices outside attention and MLP that the fallback (with its warning) rightly takes.
OTHER: dict[str, set[str]] = {}


def _layer_matrices(model):
    """Names of the 2-D weights inside the numbered layers (blocks) of the model."""
    return [n for n, p in model.named_parameters()
            if p.dim() == 2 and any(part.isdigit() for part in n.split(".")) and "relative_attention_bias" not in n]


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_hetero_classifies_attention_and_mlp_of_every_layer(family):
    model = BUILDERS[family]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assignment = assign_parameters(model, "hetero")
    matrices = _layer_matrices(model)
    assert matrices
    for name in matrices:
        if "ayerNorm" in name:
            continue
        attn = ATTN_MARK[family] in f".{name}" and not any(m in name for m in (".intermediate.", ".mlp."))
        if family in ("bert", "roberta", "vit") and ".attention." not in name:
            attn = False
        expected = "stiefel" if attn else "dgram"
        if not attn:
            assert any(m in f".{name}" for m in MLP_MARK[family]), name
        assert assignment[name] == expected, (name, assignment[name])
    fallback = {n for n, c in assignment.items() if c == "euclidean"}
    assert fallback == OTHER.get(family, set())
    if fallback:  # the fallback is never silent
        assert any(all(n in str(w.message) for n in fallback) for w in caught)
    else:
        assert not [w for w in caught if "fallback" in str(w.message)]


def test_t5_relative_attention_bias_is_an_embedding_on_adamw():
    model = BUILDERS["t5"]()
    assignment = assign_parameters(model, "all-stiefel")
    bias = [n for n in assignment if "relative_attention_bias" in n]
    assert bias and {assignment[n] for n in bias} == {None}


@pytest.mark.parametrize("policy", ["all-stiefel", "all-dgram", "hetero", "unconstrained"])
def test_a_classification_head_stays_on_adamw(policy):
    """ViT's ``classifier`` (and ``score``, ``qa_outputs``) is the output head, never a hidden matrix."""
    model = BUILDERS["vit"]()
    assert assign_parameters(model, policy)["classifier.weight"] is None


def _on_manifold(group, p):
    w = p.detach().double()
    w = w if w.shape[0] >= w.shape[1] else w.T
    manifold = {"stiefel": Stiefel(), "dgram": DGram()}[group["manifold"]]
    return manifold.check_point_on_manifold(w, explain=True, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_hetero_step_keeps_encoder_matrices_on_their_manifolds(family):
    model = BUILDERS[family]()
    idx = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    opt = build_optimizer(model, "hetero", lr=0.02, adamw_lr=3e-3)
    opt.zero_grad()
    loss = model(input_ids=idx, labels=idx).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    checked = 0
    for group in opt.param_groups:
        if group.get("manifold") in ("stiefel", "dgram"):
            for name, p in zip(group["param_names"], group["params"]):
                ok, why = _on_manifold(group, p)
                assert ok, (name, why)
                checked += 1
    assert checked == len([n for n in _layer_matrices(model) if "ayerNorm" not in n])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    opt.load_state_dict(torch.load(buffer, weights_only=True))  # plain data only


def _neox_qkv(model, layer=0):
    """GPT-NeoX's true q, k and v matrices: its query_key_value is (heads, 3, head_dim) by rows."""
    attn = model.gpt_neox.layers[layer].attention
    w = attn.query_key_value.weight.detach()  # (3 * WIDTH, WIDTH)
    per_head = w.view(4, 3, WIDTH // 4, WIDTH)
    return [per_head[:, i].reshape(WIDTH, WIDTH) for i in range(3)]


def test_neox_query_key_value_needs_its_layout_named():
    from manifoldlib.charts import FUSED_NAMES, PER_HEAD_NAMES, split_blocks

    assert set(PER_HEAD_NAMES) <= set(FUSED_NAMES)  # selected by default, split only with heads=
    model = BUILDERS["neox"]()
    with pytest.raises(ValueError, match=r"gpt_neox\.layers\.0\.attention\.query_key_value\.weight.*heads="):
        split_blocks(model)
    assert not any("parametrizations" in n for n, _ in model.named_parameters())  # none split


def test_neox_split_per_head_gives_q_k_v_and_merges_back_exactly():
    from manifoldlib.charts import merge_blocks, split_blocks

    model = BUILDERS["neox"]()
    fused = model.gpt_neox.layers[0].attention.query_key_value.weight.detach().clone()
    q, k, v = _neox_qkv(model)
    idx = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(idx).logits
    names = split_blocks(model, heads=4)
    assert names == [f"gpt_neox.layers.{i}.attention.query_key_value.weight" for i in range(2)]
    plist = model.gpt_neox.layers[0].attention.query_key_value.parametrizations.weight
    for block, true in zip((plist.original0, plist.original1, plist.original2), (q, k, v)):
        torch.testing.assert_close(block.detach(), true, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, before, rtol=0, atol=0)
    opt = build_optimizer(model, "hetero", lr=0.02, adamw_lr=3e-3)
    opt.zero_grad()
    model(idx, labels=idx).loss.backward()
    opt.step()
    for group in opt.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            if "query_key_value.parametrizations" in name:
                assert group["manifold"] == "stiefel" and tuple(p.shape) == (WIDTH, WIDTH)
                assert _on_manifold(group, p)[0], name
    model2 = BUILDERS["neox"]()
    split_blocks(model2, heads=4)
    assert merge_blocks(model2) == names
    torch.testing.assert_close(model2.gpt_neox.layers[0].attention.query_key_value.weight, fused, rtol=0, atol=0)


def test_falcon_multi_query_split_by_sizes():
    from manifoldlib.charts import merge_blocks, split_blocks

    model = BUILDERS["falcon"]()  # multi-query: q (4 heads of 8), then one k and one v head
    w = model.transformer.h[0].self_attention.query_key_value.weight.detach().clone()
    assert tuple(w.shape) == (48, WIDTH)
    split_blocks(model, blocks=[32, 8, 8], heads=1)
    plist = model.transformer.h[0].self_attention.query_key_value.parametrizations.weight
    torch.testing.assert_close(plist.original0.detach(), w[:32], rtol=0, atol=0)
    merge_blocks(model)
    torch.testing.assert_close(model.transformer.h[0].self_attention.query_key_value.weight, w, rtol=0, atol=0)


def test_falcon_new_architecture_split_per_group_matches_its_own_head_split():
    from manifoldlib.charts import split_blocks

    model = _build("FalconForCausalLM", _config(
        "FalconConfig", num_hidden_layers=2, hidden_size=WIDTH, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, vocab_size=VOCAB))
    attn = model.transformer.h[0].self_attention
    x = torch.randn(1, 3, WIDTH, generator=torch.Generator().manual_seed(2))
    own_split = getattr(attn, "_split_heads", None)  # Falcon's own reading of its layout (gone in 5.x)
    if own_split is not None:
        with torch.no_grad():
            q, k, v = own_split(attn.query_key_value(x))
    split_blocks(model, blocks=[WIDTH, 16, 16], heads=2)  # q: 4 heads of 8; k, v: 2 heads of 8
    plist = attn.query_key_value.parametrizations.weight
    if own_split is not None:
        with torch.no_grad():
            torch.testing.assert_close(x @ plist.original0.T, q.flatten(2), rtol=1e-6, atol=1e-6)
            kv = [(x @ b.T).unflatten(-1, (2, 1, 8)).expand(-1, -1, -1, 2, -1).flatten(2)
                  for b in (plist.original1, plist.original2)]  # each group's head serves 2 query heads
            torch.testing.assert_close(kv[0], k.flatten(2), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(kv[1], v.flatten(2), rtol=1e-6, atol=1e-6)

    # on every version, through Falcon's forward: zeroing the block read as v zeroes the attention
    # output; zeroing the q block or the k block both make attention uniform (equal outputs)
    seen = []
    attn.dense.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))

    def attention_output_with_zeroed(block):
        saved = block.detach().clone()
        with torch.no_grad():
            block.zero_()
            model(ids)
            block.copy_(saved)
        return seen[-1]

    with torch.no_grad():
        model(ids)
    intact = seen[-1]
    assert torch.count_nonzero(attention_output_with_zeroed(plist.original2)) == 0
    no_q = attention_output_with_zeroed(plist.original0)
    torch.testing.assert_close(no_q, attention_output_with_zeroed(plist.original1), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(no_q, intact, rtol=1e-3, atol=1e-4)


def test_split_per_head_round_trips_a_conv1d_layout():
    from manifoldlib.charts import SplitBlocks

    split = SplitBlocks([8, 4, 4], dim=1, heads=2)
    w = torch.randn(5, 16, dtype=torch.float64)
    blocks = split.right_inverse(w)
    assert [tuple(b.shape) for b in blocks] == [(5, 8), (5, 4), (5, 4)]
    torch.testing.assert_close(blocks[1], torch.cat([w[:, 4:6], w[:, 12:14]], 1))  # head 0, head 1
    torch.testing.assert_close(split(*blocks), w, rtol=0, atol=0)
    with pytest.raises(ValueError, match="heads must be an int >= 1 dividing"):
        SplitBlocks([8, 3, 3], dim=0, heads=2)


def _mixtral():
    return _build("MixtralForCausalLM", _config(
        "MixtralConfig", num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=FF, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2))


def test_mixtral_experts_stacked_in_3d_tensors_are_named_in_a_warning():
    model = _mixtral()
    stacked = [n for n, p in model.named_parameters() if p.dim() > 2 and ".mlp." in n]
    if not stacked:
        pytest.skip("this transformers stores Mixtral's experts as separate 2-D layers")
    with pytest.warns(UserWarning, match=r"stack") as caught:
        assignment = assign_parameters(model, "hetero")
    message = " ".join(str(w.message) for w in caught)
    assert all(n in message for n in stacked) and "AdamW" in message
    assert {assignment[n] for n in stacked} == {None}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # GQA: k/v (16, 32) on Stiefel too
        assert assignment[f"model.layers.0.self_attn.{name}.weight"] == "stiefel"
    assert assignment["model.layers.0.mlp.gate.weight"] == "euclidean"  # the router: not on DGram
    assert "mlp.gate" not in message  # recognized, so not named as unclassified


def test_no_stacked_matrix_warning_for_a_patch_embedding():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assign_parameters(BUILDERS["vit"](), "hetero")  # the 4-D Conv2d patch embedding is an embedding


def _inputs(family):
    if family == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3)),
                "labels": torch.tensor([0, 1])}
    idx = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    return {"input_ids": idx, "labels": idx}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_sel_on_the_mlp_keeps_outputs_trains_reloads_and_merges(family):
    from manifoldlib.charts import SEL, apply_chart, merge_charts
    from manifoldlib.optim import default_classifier

    def is_mlp(name, module):
        w = module._parameters.get("weight")
        return w is not None and w.dim() == 2 and default_classifier(f"{name}.weight", module) == "mlp"

    model, batch = BUILDERS[family](), _inputs(family)
    with torch.no_grad():
        before = model(**batch).logits
    charted = apply_chart(model, lambda w: SEL(w, init="congruent"), include=is_mlp)
    assert len(charted) == {"qwen2": 6, "t5": 8}.get(family, 4)  # 2 layers x 2 (gated: x 3; T5: 2 stacks)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, before, rtol=1e-5, atol=1e-5)
    opt = build_optimizer(model, "hetero", lr=0.02, adamw_lr=1e-3)
    opt.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    with torch.no_grad():
        trained = model(**batch).logits
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = BUILDERS[family]()
    apply_chart(fresh, lambda w: SEL(w, init="congruent"), include=is_mlp)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert sorted(merge_charts(model)) == sorted(charted)
    assert not any("parametrizations" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(fresh(**batch).logits, trained, rtol=0, atol=0)
        torch.testing.assert_close(model(**batch).logits, trained, rtol=1e-5, atol=1e-5)


def _gpt2():
    cfg = _config("GPT2Config", n_layer=2, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=16,
                  bos_token_id=0, eos_token_id=0)
    return _build("GPT2LMHeadModel", cfg)


def test_split_blocks_refuses_a_charted_c_attn_by_name():
    from manifoldlib.charts import SEL, apply_chart, split_blocks

    model = _gpt2()
    apply_chart(model, lambda w: SEL(w, fan_in=w.shape[0]), include=lambda n, m: n.endswith("attn.c_attn"))
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn\.weight is already parametrized"):
        split_blocks(model)


def test_apply_chart_refuses_a_split_c_attn_by_name():
    from manifoldlib.charts import SEL, apply_chart, split_blocks

    model = _gpt2()
    split_blocks(model)
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn\.weight .*merge_blocks"):
        apply_chart(model, lambda w: SEL(w, fan_in=w.shape[0]), include=lambda n, m: ".attn." in f"{n}.")
    assert not any(type(p).__name__ == "SEL" for p in model.modules())  # nothing charted


@pytest.mark.parametrize("policy", ["all-stiefel", "hetero"])
def test_the_matrices_inside_a_head_module_stay_on_adamw(policy):
    """RoBERTa's ``classifier.dense`` / ``out_proj`` and ``lm_head.dense``, BERT's ``cls`` transform."""
    cls_model = _build("RobertaForSequenceClassification", _config(
        "RobertaConfig", num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=FF, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=40, num_labels=3))
    assignment = assign_parameters(cls_model, policy)
    assert assignment["classifier.dense.weight"] is None and assignment["classifier.out_proj.weight"] is None
    assert assign_parameters(BUILDERS["roberta"](), policy)["lm_head.dense.weight"] is None
    assert assign_parameters(BUILDERS["bert"](), policy)["cls.predictions.transform.dense.weight"] is None


def _phi3(kv_heads):
    return _build("Phi3ForCausalLM", _config(
        "Phi3Config", num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=FF, num_attention_heads=4,
        num_key_value_heads=kv_heads, vocab_size=VOCAB, pad_token_id=0, bos_token_id=0, eos_token_id=0))


def test_equal_blocks_are_refused_for_a_grouped_query_qkv_proj():
    """Phi-3's qkv_proj with one k/v head is (32 + 8 + 8, 32): equal thirds would not be q, k, v."""
    from manifoldlib.charts import split_blocks

    model = _phi3(kv_heads=1)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight.*blocks=\[32, 8, 8\]"):
        split_blocks(model)
    assert not any("parametrizations" in n for n, _ in model.named_parameters())
    w = model.model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    split_blocks(model, blocks=[32, 8, 8])
    plist = model.model.layers[0].self_attn.qkv_proj.parametrizations.weight
    torch.testing.assert_close(plist.original1.detach(), w[32:40], rtol=0, atol=0)  # k
    assert len(split_blocks(_phi3(kv_heads=4))) == 2  # plain multi-head: equal thirds are q, k, v


def test_a_layer_output_is_mlp_only_inside_a_numbered_layer_and_outside_attention():
    from manifoldlib.optim import default_classifier
    from manifoldlib.optim.policies import ATTN_NAMES, LAYER_MLP_NAMES, MLP_NAMES

    assert not LAYER_MLP_NAMES & (ATTN_NAMES | MLP_NAMES)
    lin = torch.nn.Linear(4, 4)
    assert default_classifier("bert.encoder.layer.0.output.dense.weight", lin) == "mlp"
    assert default_classifier("bert.encoder.layer.0.attention.output.dense.weight", lin) == "attn"
    assert default_classifier("output.weight", lin) is None  # Meta LLaMA's head, no layer index


def test_equal_blocks_are_refused_for_a_multi_query_gpt_bigcode_c_attn():
    from manifoldlib.charts import split_blocks

    model = _build("GPTBigCodeForCausalLM", _config(
        "GPTBigCodeConfig", n_layer=2, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=16,
        multi_query=True, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn\.weight.*blocks=\[32, 8, 8\]"):
        split_blocks(model)


def test_a_per_head_gpt_bigcode_c_attn_needs_heads_and_then_splits_into_q_k_v():
    from manifoldlib.charts import split_blocks

    model = _build("GPTBigCodeForCausalLM", _config(
        "GPTBigCodeConfig", n_layer=2, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=16,
        multi_query=False, bos_token_id=0, eos_token_id=0))
    attn = model.transformer.h[0].attn
    w = attn.c_attn.weight.detach().clone()  # nn.Linear: (3d, d), rows (heads, 3, head_dim)
    with pytest.raises(ValueError, match=r"h\.0\.attn\.c_attn\.weight.*head by head.*heads=4"):
        split_blocks(model)
    assert not torch.nn.utils.parametrize.is_parametrized(attn.c_attn)  # nothing split on error
    split_blocks(model, heads=4)
    per_head = w.view(4, 3, WIDTH // 4, WIDTH)  # the forward's view(..., heads, 3 * head_dim)
    for i in range(3):  # block i gathers slot i of every head: exactly q, k, v
        block = getattr(attn.c_attn.parametrizations.weight, f"original{i}")
        torch.testing.assert_close(block, per_head[:, i].reshape(WIDTH, WIDTH), rtol=0, atol=0)
