"""transformers' causal-LM architectures, each from a tiny config (no download), as a user brings
them: the checkpoint exactly as `save_pretrained` writes it (renamed keys and all), built on meta
and streamed from it; the logits, two training steps, `generate` and the weights saved back equal
to the same model loaded by `from_pretrained` in memory. What cannot stream is refused with an
error that says why, and listed here (REFUSED) with the reason; docs/models.md has the table.
"""
import json

import pytest
import torch

from test_c_abi import daemon  # noqa: F401 (a fixture)
from test_pretrained import VOCAB, stream, tokens, train

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# model_type -> config overrides (names that type's config uses, or what it needs to be small;
# None: the setting left out). Dropout off: the model in memory is compared in eval mode.
ARCHITECTURES = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "gemma": {}, "gemma2": {},
    "phi": dict(partial_rotary_factor=0.5), "phi3": {},
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_neox": dict(rotary_pct=0.5), "gptj": dict(n_embd=32, n_layer=2, n_head=4,
                                                    n_positions=64, rotary_dim=4),
    "opt": dict(ffn_dim=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0),
    "bloom": dict(n_layer=2, n_head=4),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, head_dim=None), "stablelm": {},
    "starcoder2": {}, "olmo": {}, "olmo2": {}, "cohere": {}, "granite": {},
    "gpt_bigcode": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0),
    "codegen": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4),
    "persimmon": {}, "nemotron": {}, "helium": {}, "glm": {}, "smollm3": {},
}


def config(kind: str):
    options = {k: v for k, v in dict(SMALL, **ARCHITECTURES[kind]).items() if v is not None}
    return transformers.AutoConfig.for_model(kind, **options)


def build(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(kind))


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_an_architecture_streams_trains_generates_and_saves_as_in_memory(daemon, tmp_path,
                                                                        kind):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    build(kind).save_pretrained(ckpt, max_shard_size="40KB")  # as transformers writes it
    reference = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config(kind))
    s = stream(model, daemon, checkpoint=str(ckpt))
    try:
        assert len(s.units) == 2, s.units
        with torch.no_grad():
            assert torch.equal(model(tokens(99)).logits, reference(tokens(99)).logits)
        assert train(model, daemon, steps=2) == train(reference, daemon, steps=2)
        prompt = tokens(7, n=1, length=4)
        ask = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, **ask), reference.generate(prompt, **ask))
        out, want = tmp_path / "out", tmp_path / "want"
        s.save_pretrained(out, max_shard_size="40KB")
        reference.save_pretrained(want, max_shard_size="40KB")
        assert _keys(out) == _keys(want)  # what transformers writes
        back = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
        for k, v in reference.state_dict().items():
            assert torch.equal(back[k], v), k
    finally:
        s.close()


def _keys(directory):
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    return set(safetensors_torch.load_file(directory / "model.safetensors"))


def test_legacy_keys_from_pretrained_ignores_are_accepted(daemon, tmp_path):  # noqa: F811
    """A checkpoint older transformers wrote, with a rotary table per layer: from_pretrained
    ignores those keys, and so does streaming."""
    ckpt = tmp_path / "ckpt"
    build("llama").save_pretrained(ckpt, max_shard_size="1GB")
    f = ckpt / "model.safetensors"
    tensors = safetensors_torch.load_file(f)
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    safetensors_torch.save_file(tensors, f, metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config("llama"))
    s = stream(model, daemon, checkpoint=str(ckpt))
    try:
        with torch.no_grad():
            assert torch.equal(model(tokens(99)).logits, reference(tokens(99)).logits)
    finally:
        s.close()


# What cannot stream yet, and the error that says so. Mixture-of-experts classes load their
# experts through transformers' converters (per-expert tensors stacked into one); streaming
# reads each tensor into its place as it is stored.
REFUSED = {
    "mixtral": (dict(num_local_experts=2, num_experts_per_tok=1), "needs transformers' conversion"),
    "qwen2_moe": (dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32), "needs transformers' conversion"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_an_architecture_that_cannot_stream_is_refused_saying_why(daemon, tmp_path, kind):  # noqa: F811,E501
    extra, message = REFUSED[kind]
    cfg = transformers.AutoConfig.for_model(kind, **dict(SMALL, **extra))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "ckpt")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=message):
        stream(model, daemon, checkpoint=str(tmp_path / "ckpt"))
