"""Packed log-probs on the real tiny model: attention never crosses samples, alignment, temperature."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gyre.config.shared import ModelConfig
from gyre.model_init import init_model
from gyre_trainer.attention import resolve_attn_implementation
from gyre_trainer.model import load_model, packed_logprobs

LENGTHS = [7, 1, 12, 5]  # a one-token sample too: it has no predicted token at all


def alone(model, ids: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: one sample through the plain HF forward (no packing), shifted by hand."""
    logits = model(input_ids=ids.unsqueeze(0)).logits[0].double() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = torch.zeros(len(ids), dtype=torch.float64, device=ids.device)
    ent = torch.zeros(len(ids), dtype=torch.float64, device=ids.device)
    for t in range(1, len(ids)):
        lp[t] = logp[t - 1, ids[t]]
        ent[t] = -(logp[t - 1].exp() * logp[t - 1]).sum()
    return lp, ent


def packed_row(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.cat(samples)
    positions = torch.cat([torch.arange(len(s)) for s in samples])
    return ids, positions, torch.tensor([len(s) for s in samples])


@pytest.fixture
def samples():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1024, (n,), generator=gen) for n in LENGTHS]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_equals_each_sample_alone(tiny_llama64, samples, temperature):
    ids, positions, lengths = packed_row(samples)
    with torch.no_grad():
        lp, ent = packed_logprobs(tiny_llama64, ids, positions, lengths, temperature)
        expected = [alone(tiny_llama64, s, temperature) for s in samples]
    assert lp.shape == ids.shape and ent.shape == ids.shape
    torch.testing.assert_close(lp, torch.cat([e[0] for e in expected]), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ent, torch.cat([e[1] for e in expected]), rtol=1e-9, atol=1e-9)
    starts = np.cumsum([0, *LENGTHS[:-1]])
    assert lp[starts].tolist() == [0.0] * len(LENGTHS) and ent[starts].tolist() == [0.0] * len(LENGTHS)
    assert (lp[lp != 0] < 0).all()


def test_float32_packed_matches_alone_closely(tiny_llama, samples):
    ids, positions, lengths = packed_row(samples)
    with torch.no_grad():
        lp, _ = packed_logprobs(tiny_llama, ids, positions, lengths)
        expected = torch.cat([alone(tiny_llama, s)[0] for s in samples]).float()
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, expected, rtol=1e-5, atol=1e-5)


def test_changing_one_sample_leaves_its_neighbours_untouched(tiny_llama64, samples):
    ids, positions, lengths = packed_row(samples)
    edited = [s.clone() for s in samples]
    edited[0][:] = 5  # the sample that everything after it would attend to if attention leaked
    ids2, _, _ = packed_row(edited)
    with torch.no_grad():
        before, _ = packed_logprobs(tiny_llama64, ids, positions, lengths)
        after, _ = packed_logprobs(tiny_llama64, ids2, positions, lengths)
    first = LENGTHS[0]
    assert not torch.allclose(before[:first], after[:first])
    torch.testing.assert_close(before[first:], after[first:], rtol=0, atol=1e-12)


def test_rows_of_a_micro_batch_are_independent_and_padding_is_its_own_segment(tiny_llama64, samples):
    row_a, row_b = samples[:2], samples[2:]  # 8 and 17 tokens: pad row a with a 9-token segment
    pad = torch.zeros(9, dtype=torch.long)
    ids_a, pos_a, len_a = packed_row([*row_a, pad])
    ids_b, pos_b, len_b = packed_row(row_b)
    with torch.no_grad():
        lp, ent = packed_logprobs(
            tiny_llama64, torch.stack([ids_a, ids_b]), torch.stack([pos_a, pos_b]), [len_a, len_b]
        )
        single_a, _ = packed_logprobs(tiny_llama64, *packed_row(row_a))
        single_b, _ = packed_logprobs(tiny_llama64, ids_b, pos_b, len_b)
    assert lp.shape == (2, 17)
    torch.testing.assert_close(lp[0, :8], single_a, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lp[1], single_b, rtol=1e-9, atol=1e-9)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention of one sequence, (L, H, D) q and (L, H_kv, D) k/v, as flash-attn's kernels compute it."""
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


def _flash_fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    return torch.stack([_attend(q[b], k[b], v[b], softmax_scale) for b in range(q.shape[0])])


def _flash_varlen_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                     softmax_scale=None, causal=False):  # fmt: skip
    bounds = cu_seqlens_q.tolist()
    spans = zip(bounds[:-1], bounds[1:], strict=True)
    return torch.cat([_attend(q[a:b], k[a:b], v[a:b], softmax_scale) for a, b in spans])


def test_flash_attention_2_keeps_the_samples_of_every_row_of_a_micro_batch_apart(tiny_model, samples, monkeypatch):
    """transformers' flash_attention_2 dispatch finds packed samples from position ids only for a single row; a
    micro-batch of several rows attended across samples (0.17 nats off here) until packed_logprobs passed
    cu_seqlens. flash-attn's CUDA kernels cannot run on a CPU: they are stood in for by exact torch kernels with
    flash-attn's signatures; transformers' own dispatch (where the defect was) runs unchanged. The `gpu`-marked
    test below runs the real kernel where flash-attn is installed."""
    import transformers.modeling_flash_attention_utils as flash_utils

    kernels = (_flash_fn, _flash_varlen_fn, None, None, None)
    monkeypatch.setattr(flash_utils, "_lazy_imports", lambda *args, **kwargs: kernels)
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    model = load_model(ModelConfig(name=str(tiny_model)), "cpu", torch.float64)
    reference = load_model(ModelConfig(name=str(tiny_model)), "cpu", torch.float64)
    model.config._attn_implementation = "flash_attention_2"  # what load_model picks where flash-attn is installed
    row_a, row_b = packed_row(samples[:3]), packed_row([samples[3], samples[0][:3], samples[2][:12]])
    ids, positions = torch.stack([row_a[0], row_b[0]]), torch.stack([row_a[1], row_b[1]])
    with torch.no_grad():
        got, _ = packed_logprobs(model, ids, positions, [row_a[2], row_b[2]])
        expected = torch.stack([torch.cat([alone(reference, s)[0] for s in row]) for row in
                                (samples[:3], [samples[3], samples[0][:3], samples[2][:12]])])  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def _scaled_logits_model(kind: str):
    from transformers import CohereConfig, CohereForCausalLM, GraniteConfig, GraniteForCausalLM

    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    if kind == "granite":  # logits / logits_scaling after the head
        return GraniteForCausalLM(GraniteConfig(**shape, logits_scaling=8.0)).double()
    return CohereForCausalLM(CohereConfig(**shape, logit_scale=0.0625)).double()  # logits * logit_scale


@pytest.mark.parametrize("kind", ["granite", "cohere"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_models_that_scale_their_logits_get_the_log_probs_of_those_logits(kind, temperature):
    """Granite divides the head's output by `logits_scaling`, Cohere multiplies it by `logit_scale`: the
    chunked head path (which computes softmax(head(hidden)) itself) gave the log-probs of unscaled logits,
    0.2-0.4 nats off here. Reference: log_softmax of the model's own logits."""
    model = _scaled_logits_model(kind)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (11,), generator=gen)
    positions = torch.cat([torch.arange(5), torch.arange(6)])
    lp, ent = packed_logprobs(model, ids, positions, [5, 6], temperature)
    with torch.no_grad():
        expected, expected_ent = [], []
        for sample in (ids[:5], ids[5:]):
            logp = torch.log_softmax(model(input_ids=sample[None]).logits[0] / temperature, dim=-1)
            expected.append(torch.cat([torch.zeros(1, dtype=logp.dtype), logp[:-1].gather(-1, sample[1:, None])[:, 0]]))
            entropy = -(logp[:-1].exp() * logp[:-1]).sum(-1)
            expected_ent.append(torch.cat([torch.zeros(1, dtype=logp.dtype), entropy]))
    torch.testing.assert_close(lp.detach(), torch.cat(expected), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ent, torch.cat(expected_ent), rtol=1e-9, atol=1e-9)


def test_a_model_returning_its_heads_output_keeps_the_chunked_head(tiny_llama64, samples):
    # Llama returns the head's output untouched: the memory-saving chunked path stays on for it
    packed_logprobs(tiny_llama64, *packed_row(samples))
    assert tiny_llama64.gyre_logits_post_processed is False


def test_gradients_flow_through_logprobs_only(tiny_llama, samples):
    ids, positions, lengths = packed_row(samples)
    lp, ent = packed_logprobs(tiny_llama, ids, positions, lengths)
    assert lp.requires_grad and not ent.requires_grad
    lp.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in tiny_llama.parameters())


def test_activation_checkpointing_gives_the_same_gradients(tiny_model, samples):
    ids, positions, lengths = packed_row(samples)
    grads = []
    for checkpointing in (False, True):
        model = load_model(
            ModelConfig(name=str(tiny_model)), "cpu", torch.float64, activation_checkpointing=checkpointing
        )
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == checkpointing
        packed_logprobs(model, ids, positions, lengths)[0].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)


def test_bad_inputs_are_rejected(tiny_llama, samples, tmp_path):
    ids, positions, lengths = packed_row(samples)
    with pytest.raises(ValueError, match="sum to"):
        packed_logprobs(tiny_llama, ids, positions, lengths[:-1])
    with pytest.raises(ValueError, match="temperature"):
        packed_logprobs(tiny_llama, ids, positions, lengths, temperature=0.0)
    with pytest.raises(ValueError, match="disagree"):
        packed_logprobs(tiny_llama, ids.unsqueeze(0), positions, [lengths])
    with pytest.raises(FileNotFoundError, match="gyre model init"):
        load_model(ModelConfig(name=str(tmp_path / "missing")), "cpu")


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_every_cpu_attention_keeps_samples_apart(tiny_model, samples, implementation):
    model = load_model(ModelConfig(name=str(tiny_model)), "cpu", torch.float64, attn_implementation=implementation)
    ids, positions, lengths = packed_row(samples)
    with torch.no_grad():
        lp, _ = packed_logprobs(model, ids, positions, lengths)
        expected = torch.cat([alone(model, s)[0] for s in samples])
    # eager's additive mask leaves ~1e-8 of float64 noise; a leak across samples would be ~1e-1.
    torch.testing.assert_close(lp, expected, rtol=1e-6, atol=1e-6)


def test_attention_choice_by_device():
    assert resolve_attn_implementation("auto", "cpu") == "sdpa"
    assert resolve_attn_implementation("eager", "cpu") == "eager"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_attn_implementation("varlen", "cpu")
    with pytest.raises(ValueError, match="unknown attn_implementation"):
        resolve_attn_implementation("fast", "cpu")


def gpu_implementations() -> list[str]:
    names = ["sdpa", "flex_attention"]
    if importlib.util.find_spec("flash_attn") is not None:
        names.append("flash_attention_2")
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401

        names.append("varlen")
    except ImportError:
        pass
    return names


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("implementation", ["auto", *gpu_implementations()])
@pytest.mark.parametrize("preset", ["tiny", "small"])  # small: grouped-query attention
def test_packed_equals_alone_on_gpu_in_bfloat16(tmp_path_factory, samples, implementation, preset):
    model_dir = init_model(tmp_path_factory.mktemp(preset) / "model", preset=preset, seed=0)
    model = load_model(ModelConfig(name=str(model_dir)), "cuda", attn_implementation=implementation)
    reference = load_model(ModelConfig(name=str(model_dir)), "cuda", attn_implementation="sdpa")
    assert next(model.parameters()).dtype == torch.bfloat16
    # Position ids and lengths stay on the CPU: packed_logprobs moves what the model needs.
    ids, positions, lengths = packed_row(samples)
    lp, _ = packed_logprobs(model, ids.cuda(), positions, lengths)
    with torch.no_grad():
        expected = torch.cat([alone(reference, s.cuda())[0] for s in samples])
    torch.testing.assert_close(lp.detach().double(), expected, rtol=0, atol=0.05)
    # Gradients agree with the dense-mask path too (bf16: compare directions).
    lp.sum().backward()
    packed_logprobs(reference, ids.cuda(), positions, lengths)[0].sum().backward()
    grad = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    ref_grad = torch.cat([p.grad.float().flatten() for p in reference.parameters()])
    assert torch.nn.functional.cosine_similarity(grad, ref_grad, dim=0) > 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("implementation", ["auto", *gpu_implementations()])
def test_rows_of_a_micro_batch_stay_apart_on_gpu(tmp_path_factory, samples, implementation):
    """Two packed rows in one forward (micro_batch_size 2): each sample equals itself alone (bf16 tolerance)."""
    model_dir = init_model(tmp_path_factory.mktemp("small") / "model", preset="small", seed=0)
    model = load_model(ModelConfig(name=str(model_dir)), "cuda", attn_implementation=implementation)
    reference = load_model(ModelConfig(name=str(model_dir)), "cuda", attn_implementation="sdpa")
    rows = (samples[:3], [samples[3], samples[0][:3], samples[2][:12]])  # 20 tokens each
    packed = [packed_row(row) for row in rows]
    ids, positions = torch.stack([p[0] for p in packed]).cuda(), torch.stack([p[1] for p in packed])
    with torch.no_grad():
        lp, _ = packed_logprobs(model, ids, positions, [p[2] for p in packed])
        expected = torch.stack([torch.cat([alone(reference, s.cuda())[0] for s in row]) for row in rows])
    torch.testing.assert_close(lp.double(), expected, rtol=0, atol=0.05)


def test_the_first_call_draws_the_same_dropout_masks_as_any_later_one(tiny_model, samples):
    """The first call's logits check (a forward) must not use up random numbers: with LoRA dropout it did, so a
    resumed run (checking at its first step) and `gyre replay` drew other dropout masks than the original run."""
    from types import SimpleNamespace

    from gyre_trainer.lora import apply_lora

    lora = SimpleNamespace(rank=4, alpha=8, dropout=0.5, target_modules=["q_proj", "v_proj"])
    fresh, checked = (apply_lora(load_model(ModelConfig(name=str(tiny_model)), "cpu", torch.float64), lora)
                      for _ in range(2))  # fmt: skip
    checked.load_state_dict(fresh.state_dict())
    packed_logprobs(checked, *packed_row(samples))  # its check is done
    results = []
    for model in (fresh, checked):
        torch.manual_seed(7)
        lp, _ = packed_logprobs(model, *packed_row(samples))
        results.append((lp.detach(), torch.get_rng_state()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def _hybrid_model(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    """A tiny random model of a transformers class whose layers ignore the packed rows' position ids."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model.train()


# Mamba-2 layers; gated delta-net layers; a mask of its own (float32 where a kernel takes or keeps no float64)
@pytest.mark.parametrize("arch, dtype", [("falcon_h1", torch.float64), ("qwen3_5_text", torch.float32),
                                         ("afmoe", torch.float32)])  # fmt: skip
def test_a_model_whose_layers_mix_packed_samples_gets_each_sample_alone(arch, dtype, samples, caplog):
    """Position ids keep samples apart only where transformers' mask code runs for every layer: Falcon-H1's state-space
    layers, Qwen3.5's linear attention and AFMoE's own masks carried one sample into the next (0.01-0.4 nats on these
    tiny models), silently."""
    model = _hybrid_model(arch, dtype)
    close = {"rtol": 1e-9, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    ids, positions, lengths = packed_row(samples)
    lp, ent = packed_logprobs(model, ids, positions, lengths)
    with torch.no_grad():
        expected = [alone(model, s) for s in samples]
    torch.testing.assert_close(lp.detach().double(), torch.cat([e[0] for e in expected]), **close)
    torch.testing.assert_close(ent.double(), torch.cat([e[1] for e in expected]), **close)
    assert "mixes the samples of a packed row" in caplog.text
    # the gradient is each sample's alone too, and two rows of a micro-batch (one padded) stay apart
    lp.sum().backward()
    packed_grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    sum(alone(model, s)[0].sum() for s in samples).backward()
    alone_grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.testing.assert_close(packed_grad, alone_grad, **close)
    pad = torch.zeros(5, dtype=torch.long)
    rows = [packed_row([samples[0], samples[2], pad]),
            packed_row([samples[3], samples[1], samples[0], samples[0], pad[:4]])]  # fmt: skip
    shapes = []  # the forwards' (rows, width): samples longest first, padded to the longest of their forward
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)  # fmt: skip
    with torch.no_grad():
        two, _ = packed_logprobs(model, torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]),
                                 [r[2] for r in rows])  # fmt: skip
    hook.remove()
    assert shapes == [(4, 12), (4, 5)]  # lengths 12, 7, 7, 7 | 5, 5 (padding), 4 (padding), 1: 68 tokens, not 8 x 12
    torch.testing.assert_close(two[0, :19].double(), torch.cat([expected[0][0], expected[2][0]]), **close)
    torch.testing.assert_close(two[1, 6:20].double(), torch.cat([expected[0][0]] * 2), **close)
    assert model.training


def test_a_model_that_keeps_packed_samples_apart_is_run_packed_also_with_dropout(tiny_model, samples):
    from types import SimpleNamespace

    from gyre_trainer.lora import apply_lora

    # dropout draws other masks for the probe's two rows: it is off while the probe runs, and on again after
    lora = SimpleNamespace(rank=4, alpha=8, dropout=0.5, target_modules=["q_proj", "v_proj"])
    model = apply_lora(load_model(ModelConfig(name=str(tiny_model)), "cpu", torch.float64), lora)
    packed_logprobs(model, *packed_row(samples))
    assert model.gyre_packing_mixes_samples is False
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    assert dropouts and all(m.training for m in dropouts)


def test_rl_training_loads_the_model_without_dropout_and_publishes_its_config_unchanged(
    tiny_model, samples, tmp_path, caplog
):
    """A model with dropout in its config (OPT, GPT-2, Phi-2: 0.1) trained in training mode drew a new mask per
    forward, so the trainer's log-probs of the sampled tokens, and the importance ratio comparing them with the
    sampler's (no dropout there), were noisy. The RL trainer builds it with every dropout at 0; the config it
    publishes keeps the model's values; SFT keeps dropout as the model has it."""
    from gyre.config.trainer import TrainerConfig
    from gyre_trainer.dist import DistContext
    from gyre_trainer.process import TrainerProcess
    from gyre_trainer.publish import config_bytes
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model)
    config.attention_dropout = 0.5
    AutoModelForCausalLM.from_pretrained(tiny_model, config=config).save_pretrained(tmp_path / "m")
    runs = {}
    for dropout in (True, False):
        model = load_model(ModelConfig(name=str(tmp_path / "m")), "cpu", torch.float64, dropout=dropout,
                           attn_implementation="sdpa")  # fmt: skip
        assert model.training and model.config.attention_dropout == 0.5
        assert b'"attention_dropout": 0.5' in config_bytes(model.config)
        runs[dropout] = [packed_logprobs(model, *packed_row(samples))[0].detach() for _ in range(2)]
        assert model.training and "mixes the samples" not in caplog.text  # the probe is not fooled by the dropout
    assert not torch.equal(*runs[True])  # a mask per forward
    assert torch.equal(*runs[False])
    # the RL trainer's own loading
    cfg = TrainerConfig(model={"name": str(tmp_path / "m"), "dtype": "float32"}, device="cpu")
    model = TrainerProcess(cfg, DistContext())._load_base_model()
    lp = [packed_logprobs(model, *packed_row(samples))[0].detach() for _ in range(2)]
    assert model.training and torch.equal(*lp)


def test_a_lora_target_that_names_no_layer_is_refused_naming_it(tiny_model):
    """peft refuses only target_modules of which nothing matches: ["q_proj", "v_prj"] trained adapters on q_proj
    alone, the typo unseen; each entry must match a layer (also for a multi-run's added adapter)."""
    from types import SimpleNamespace

    from gyre_trainer.lora import add_adapter, apply_lora

    lora = SimpleNamespace(rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_prj"])
    fresh = load_model(ModelConfig(name=str(tiny_model)), "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"target_modules: 'v_prj' names no layer of the model \(did you mean "
                                         r"'v_proj'\?\); its linear layers: .*q_proj"):  # fmt: skip
        apply_lora(fresh, lora)
    peft = apply_lora(fresh, SimpleNamespace(**{**vars(lora), "target_modules": ["q_proj", "v_proj"]}))
    assert {n.split(".lora_A")[0].rpartition(".")[2] for n, _ in peft.named_parameters() if "lora_A" in n} == {
        "q_proj", "v_proj"}  # fmt: skip
    with pytest.raises(ValueError, match=r"'v_prj' names no layer"):
        add_adapter(peft, "beta", lora)
