"""test_hf.py - comet.torch.patch_model on HF transformers models built from
tiny random configs (no download): Mixtral, Qwen2-MoE (with its shared
expert, which stays torch) and Qwen3-MoE, 2 layers, H = 64, 6 experts, top-2,
on CPU (comet's CPU engine, one rank).

The unpatched model runs in float32 with every weight rounded to bf16
first, so both models hold the same weights; the patched one computes its
experts with comet.h's rounding points (x, h, o and y rounded to bf16, fp32
accumulation). Stated tolerances, for a batch of 2 x 16 tokens with
labels (the loss of a causal LM):
  - logits: max |patched - unpatched| <= 2^-8 max |unpatched| (measured:
    1e-4 to 2.3e-4 of it);
  - every parameter's loss gradient (the experts' in HF's layout: comet's w1
    is gate_up_proj, w2 is down_proj, gate first): ||g - g_ref|| <= 2e-2
    ||g_ref|| (measured: at most 5.3e-3).
Skipped without torch or transformers (>= 5: fused experts modules)."""

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: comet.torch is not tested")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: patch_model is not tested")

import comet.torch as ct  # noqa: E402

if not hasattr(transformers, "Qwen3MoeConfig") or int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("patch_model needs transformers >= 5 (fused experts modules), got %s" % transformers.__version__,
                allow_module_level=True)

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=64)


def config(name):
    if name == "mixtral":
        c = transformers.MixtralConfig(intermediate_size=48, num_local_experts=6, num_experts_per_tok=2, **COMMON)
    elif name == "qwen2_moe":
        c = transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=48,
                                        shared_expert_intermediate_size=80, num_experts=6, num_experts_per_tok=2,
                                        decoder_sparse_step=1, mlp_only_layers=[], **COMMON)
    else:
        c = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=6,
                                        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], head_dim=16,
                                        **COMMON)
    c._attn_implementation = "eager"
    return c


def tiny_model(name):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(name))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_patched_model_matches_the_unpatched_one(name):
    model = tiny_model(name)
    patched = ct.patch_model(copy.deepcopy(model))
    blocks = [m for m in patched.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    assert len(blocks) == 2 and all(isinstance(b.experts, ct.MoEExperts) for b in blocks)
    assert all(b.experts.w1.requires_grad and b.experts.w2.requires_grad for b in blocks)
    if name == "qwen2_moe":
        assert all(isinstance(b.shared_expert, torch.nn.Module) for b in blocks)  # stays torch
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    out = patched(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.logits.dtype == torch.float32
    err = float((out.logits - ref.logits).detach().abs().max())
    assert err <= 2 ** -8 * float(ref.logits.detach().abs().max()), err
    want = dict(model.named_parameters())
    got = dict(patched.named_parameters())
    assert len(got) == len(want)
    for key, p in got.items():
        ref_key = key.replace("experts.w1", "experts.gate_up_proj").replace("experts.w2", "experts.down_proj")
        g, g_ref = p.grad.float(), want[ref_key].grad
        rel = float((g - g_ref).norm() / g_ref.norm())
        assert rel <= 2e-2, (key, rel)


def test_patching_twice_and_what_it_refuses():
    model = tiny_model("qwen3_moe")
    ct.patch_model(model)
    experts = [b.experts for b in model.modules() if hasattr(b, "experts") and hasattr(b, "gate")]
    ct.patch_model(model)  # already comet's: left as it is
    assert experts == [b.experts for b in model.modules() if hasattr(b, "experts") and hasattr(b, "gate")]
    assert any(k.endswith("mlp.experts.w1") for k in model.state_dict())
    with pytest.raises(ValueError, match="has no sparse MoE block comet knows"):
        ct.patch_model(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        ct.patch_model(tiny_model("mixtral"), group=object())
    with torch.no_grad():  # inference through the patched model
        assert model(input_ids=torch.zeros(1, 5, dtype=torch.long)).logits.shape == (1, 5, 128)
